"""What `hf-kvcache serve-bench` reports from its runs: the one-line text of a run, the summary (ratios to
model-dtype pages), the files, and the summary's text.

`summarize(runs, settings)`: per run configuration (format, and prompt eviction unless none: `RUN` = "fp8_e4m3" or
"fp8_e4m3+keydiff:0.75") and budget scale, ratios to the model-dtype run without eviction at the same budget and
round, medians over rounds (keys `RUN@xSCALE`: memory_bound, concurrency_ratio, steady_peak_ratio,
whole_run_peak_ratio, pages_ratio, tokens_per_s_ratio, ttft_mean_ratio, kl_mean). Runs are the rows of
hf_kvcache.evaluation.serve_runner.run_serve_bench (one per round, budget and format).

Results: JSON (everything, with the per-forward trace of every run), CSV (one row per run, without the trace) and a
PNG (concurrency vs budget), `out` + suffixes (`write_results`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .serve_workload import ServeBenchSettings, configurations, run_label


def steady_text(row: dict) -> str:
    """The memory-bound steady state of a run, in words."""
    if not row["steady_measured"]:
        return f"no memory-bound steady state ({row['steady_reason']})"
    return (
        f"steady state {row['steady_mean_concurrent_requests']:.1f} concurrent requests (peak "
        f"{row['steady_peak_concurrent_requests']}, {row['steady_pages_per_request']:.2f} pages each, "
        f"{row['steady_memory_bound_share']:.0%} of {row['steady_forwards']} forwards memory-bound)"
    )


def run_line(row: dict, kl_requests: int) -> str:
    """The progress line of one run."""
    return (
        f"round {row['round']} budget x{row['budget_scale']} {row.get('run', row['format'])}: {steady_text(row)}; "
        f"whole-run "
        f"peak {row['peak_concurrent_requests']} ({row['peak_admission_limit']} at the peak)"
        f", {row['tokens_per_s']:.1f} tok/s, ttft {row['ttft_mean_s']:.2f}s"
        + (f", KL {row['kl_mean']:.2e}, top-1 {row['top1_agreement']:.3f}" if "kl_mean" in row else "")
        + (f", KL first {kl_requests} {row['kl_mean_same_text']:.2e}" if "kl_mean_same_text" in row else "")
    )


def summarize(runs: list[dict], settings: ServeBenchSettings) -> dict:
    """Ratios to model-dtype pages at the same budget and round, then medians over rounds. The concurrency ratio is
    that of the mean requests resident at the memory-bound forwards of the steady state (None unless both runs
    reached one in every round: `memory_bound`); the steady state's peak and the whole run's peak are given too."""
    by_key = {(r["round"], r["budget_scale"], r.get("run", r["format"])): r for r in runs}
    summary = {}
    for fmt, compress in configurations(settings)[1:]:
        label = run_label(fmt, compress)
        for scale in settings.budget_scales:
            pairs = [(by_key[(i, scale, "model")], by_key[(i, scale, label)]) for i in range(settings.rounds)]
            memory_bound = all(base["steady_measured"] and run["steady_measured"] for base, run in pairs)

            def ratio(key, require_steady=False, pairs=pairs, memory_bound=memory_bound):
                if require_steady and not memory_bound:
                    return None
                return statistics.median(run[key] / base[key] for base, run in pairs)

            summary[f"{label}@x{scale}"] = {
                "memory_bound": memory_bound,
                "concurrency_ratio": ratio("steady_mean_concurrent_requests", True),
                "steady_peak_ratio": ratio("steady_peak_concurrent_requests", True),
                "whole_run_peak_ratio": ratio("peak_concurrent_requests"),
                "pages_ratio": ratio("num_blocks"),
                "tokens_per_s_ratio": ratio("tokens_per_s"),
                "ttft_mean_ratio": ratio("ttft_mean_s"),
                "itl_mean_ratio": ratio("itl_mean_s") if all(r.get("itl_mean_s") for p in pairs for r in p) else None,
                "kl_mean": statistics.median(run["kl_mean"] for _, run in pairs),
                "tokens_kept_share": _kept_share(pairs),
            }
    return summary


def _kept_share(pairs) -> float | None:
    """Prompt tokens kept / prefilled by eviction over the runs (None without eviction)."""
    runs = [run for _, run in pairs if run.get("eviction_tokens_prefilled")]
    if not runs:
        return None
    return sum(r["eviction_tokens_kept"] for r in runs) / sum(r["eviction_tokens_prefilled"] for r in runs)


def summary_lines(result: dict) -> list[str]:
    """The summary and the QuantizedFP8Cache same-text scores of a result, one line each."""
    lines = []
    for key, row in result["summary"].items():
        if row["memory_bound"]:
            concurrency = (
                f"steady-state concurrency x{row['concurrency_ratio']:.2f} (its peak x{row['steady_peak_ratio']:.2f})"
            )
        else:
            concurrency = "no memory-bound steady state in every run (see the JSON)"
        lines.append(
            f"{key}: {concurrency}, whole-run peak x{row['whole_run_peak_ratio']:.2f}, pages "
            f"x{row['pages_ratio']:.2f}, tokens/s x{row['tokens_per_s_ratio']:.2f}, "
            f"TTFT x{row['ttft_mean_ratio']:.2f}"
            + (f", ITL x{row['itl_mean_ratio']:.2f}" if row.get("itl_mean_ratio") else "")
            + f", KL {row['kl_mean']:.2e}"
            + (f", prompt kept {row['tokens_kept_share']:.0%}" if row.get("tokens_kept_share") else "")
        )
    for name, row in (result["quantized_fp8_cache_kl_same_text"] or {}).items():
        lines.append(f"{name}, same text: KL {row['kl_mean']:.2e}, top-1 {row['top1_agreement']:.3f}")
    return lines


def write_results(result: dict, out: str) -> list[str]:
    """JSON, CSV and PNG next to `out` (a path without suffix)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.parent / f"{base.name}.{suffix}" for suffix in ("json", "csv", "png")]  # keeps dots in the name
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    runs = [{k: v for k, v in r.items() if k != "trace"} for r in result["runs"]]  # the trace: JSON only
    # the first run's columns, then the others (the agreement metrics of later runs) in order of first appearance
    columns = list(dict.fromkeys(k for r in runs for k in r))
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(runs)
    settings = result["settings"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = dict.fromkeys(r.get("run", r["format"]) for r in runs)
    for fmt in labels:
        rows = sorted(
            (r for r in runs if r.get("run", r["format"]) == fmt and r["round"] == 0), key=lambda r: r["kv_bytes"]
        )
        mib = [r["kv_bytes"] / 2**20 for r in rows]
        (line,) = ax.plot(
            mib,
            [r["steady_mean_concurrent_requests"] for r in rows],
            marker="o",
            label=f"{fmt} pages, memory-bound steady state (mean)",
        )
        ax.plot(
            mib,
            [r["peak_concurrent_requests"] for r in rows],
            marker="x",
            ls="--",
            lw=0.8,
            color=line.get_color(),
            label=f"{fmt} pages, whole-run peak",
        )
    ax.set_xlabel("KV memory budget (MiB)")
    ax.set_ylabel("concurrent requests")
    ax.set_title(f"Continuous batching, {settings['model']} ({settings['dtype']}), page {settings['page_size']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]
