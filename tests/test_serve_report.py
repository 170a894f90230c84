"""serve-bench's report (hf_kvcache.evaluation.serve_report): the summary's ratios are per-round ratios to the
model-dtype run at the same budget, then medians; the concurrency ratio exists only where every run reached a
memory-bound steady state; the files hold every run (the trace in the JSON only, the union of the runs' columns in the
CSV)."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from hf_kvcache.evaluation.serve_report import summarize, summary_lines, write_results
from hf_kvcache.evaluation.serve_workload import ServeBenchSettings

SETTINGS = ServeBenchSettings(formats=("model", "fp8_e4m3"), budget_scales=(1.0, 1.25), rounds=3)


def run(round_, scale, fmt, mean, steady=True, **extra) -> dict:
    """One run's row; `mean` concurrent requests at the steady state, everything else derived from it."""
    return {
        "round": round_,
        "budget_scale": scale,
        "format": fmt,
        "steady_measured": steady,
        "steady_reason": "" if steady else "the queue ran dry",
        "steady_mean_concurrent_requests": mean,
        "steady_peak_concurrent_requests": mean + 2,
        "peak_concurrent_requests": mean + 4,
        "num_blocks": 10 * mean,
        "tokens_per_s": 100.0 + mean,
        "ttft_mean_s": 1.0,
        "kl_mean": 0.001 * (round_ + 1) if fmt != "model" else 0.0,
        "kv_bytes": int(2**20 * scale),
        "trace": [{"forward": 0, "resident": mean}],
        **extra,
    }


def runs(fp8_means=(40.0, 38.0, 44.0), steady_fp8=(True, True, True)) -> list[dict]:
    rows = []
    for i in range(3):
        for scale in (1.0, 1.25):
            rows.append(run(i, scale, "model", 20.0 * scale))
            rows.append(run(i, scale, "fp8_e4m3", fp8_means[i] * scale, steady_fp8[i], top1_agreement=0.99))
    return rows


def test_summary_is_the_median_of_per_round_ratios():
    summary = summarize(runs(), SETTINGS)
    assert sorted(summary) == ["fp8_e4m3@x1.0", "fp8_e4m3@x1.25"]
    row = summary["fp8_e4m3@x1.0"]
    assert row["memory_bound"] is True
    assert row["concurrency_ratio"] == pytest.approx(2.0)  # median of 40/20, 38/20, 44/20
    assert row["steady_peak_ratio"] == pytest.approx(42 / 22)
    assert row["whole_run_peak_ratio"] == pytest.approx(44 / 24)
    assert row["pages_ratio"] == pytest.approx(2.0)
    assert row["kl_mean"] == pytest.approx(0.002)  # median of 0.001, 0.002, 0.003
    assert summary["fp8_e4m3@x1.25"]["concurrency_ratio"] == pytest.approx(2.0)  # 50/25: each budget its own base


def test_no_concurrency_ratio_unless_every_run_was_memory_bound():
    row = summarize(runs(steady_fp8=(True, False, True)), SETTINGS)["fp8_e4m3@x1.0"]
    assert row["memory_bound"] is False
    assert row["concurrency_ratio"] is None and row["steady_peak_ratio"] is None
    assert row["whole_run_peak_ratio"] == pytest.approx(44 / 24)  # (the whole-run peak needs no steady state)
    lines = summary_lines({"summary": {"fp8_e4m3@x1.0": row}, "quantized_fp8_cache_kl_same_text": None})
    assert lines == [
        f"fp8_e4m3@x1.0: no memory-bound steady state in every run (see the JSON), whole-run peak "
        f"x{44 / 24:.2f}, pages x2.00, tokens/s x{140 / 120:.2f}, TTFT x1.00, KL 2.00e-03"
    ]


def test_files_hold_every_run(tmp_path):
    rows = runs()
    result = {
        "settings": dataclasses.asdict(SETTINGS),
        "runs": rows,
        "summary": summarize(rows, SETTINGS),
        "quantized_fp8_cache_kl_same_text": {"QuantizedFP8Cache": {"kl_mean": 0.004, "top1_agreement": 0.98}},
    }
    paths = write_results(result, str(tmp_path / "serve.bench"))
    assert paths == [str(tmp_path / f"serve.bench.{s}") for s in ("json", "csv", "png")]  # the dot in the name kept
    saved = json.loads((tmp_path / "serve.bench.json").read_text())
    assert saved["runs"][0]["trace"] == [{"forward": 0, "resident": 20.0}]
    with open(tmp_path / "serve.bench.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and "trace" not in table[0]
    assert "top1_agreement" in table[0]  # a column only the FP8 runs have (the first row is a model-dtype run)
    assert table[0]["top1_agreement"] == "" and table[1]["top1_agreement"] == "0.99"
    assert (tmp_path / "serve.bench.png").stat().st_size > 1000
    assert summary_lines(result)[-1] == "QuantizedFP8Cache, same text: KL 4.00e-03, top-1 0.980"
