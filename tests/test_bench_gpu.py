"""eval/bench_gpu.py on a tiny random Llama: the rows and columns it writes, and that it counts host syncs and
reports caches that do not compile (instead of hiding them).

Two test-only caches are registered for the run: one that reads a value back to the host in every layer (`float()`
of a tensor: a sync per layer and step, and a graph break under fullgraph) and one whose update branches on a
Python step counter (dynamo guards on its value: a new graph every forward). dynamo runs with the `eager` backend
(tracing, graph breaks and recompiles exactly as with inductor, without inductor's minutes of code generation)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

import hf_kvcache
from hf_kvcache import SlidingWindowCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import bench_gpu

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # bench_gpu.tiny_llama
PROMPT, NEW = 24, 6


class SyncingCache(SlidingWindowCache):
    """Reads a value back to the host in every layer's update."""

    cache_name = "test_syncing"

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if float(key_states.abs().sum()) < 0:  # never true: the read-back is the point
            raise AssertionError
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class RecompilingCache(SlidingWindowCache):
    """Branches on Python state that changes every forward (a string: dynamo guards on its value and, unlike an int,
    never turns it into a symbolic value)."""

    cache_name = "test_recompiling"

    def __init__(self, config_or_model, window: int = 1024, layers=None):
        super().__init__(config_or_model, window=window, layers=layers)
        self.step_tag = "step 0"

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.step_tag = f"step {int(self.step_tag.split()[1]) + 1}"
        if self.step_tag.endswith("999"):  # never true within the test
            key_states = key_states + 0
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench")
    mp = pytest.MonkeyPatch()
    mp.setitem(hf_kvcache.CACHE_IMPLEMENTATIONS, "test_syncing", SyncingCache)
    mp.setitem(hf_kvcache.CACHE_IMPLEMENTATIONS, "test_recompiling", RecompilingCache)
    try:
        info = bench_gpu.main(
            [
                "--tiny",
                "--prompt-tokens",
                str(PROMPT),
                "--new-tokens",
                str(NEW),
                "--rounds",
                "2",
                "--compile-backend",
                "eager",
                "--sync-steps",
                "2",
                "--cache",
                "sink:sinks=2,budget=0.5",
                "--cache",
                "test_syncing:window=12",
                "--cache",
                "test_recompiling:window=12",
                "--out",
                str(out),
            ]
        )
    finally:
        mp.undo()
    with open(out / "gpu_bench.csv") as f:
        reader = csv.DictReader(f)
        header, csv_rows = reader.fieldnames, list(reader)
    saved = json.loads((out / "gpu_bench.json").read_text())
    rows = {(r["cache"], r["mode"]): r for r in info["rows"]}
    return info, rows, header, csv_rows, saved


CACHES = ["dynamic", "static", "sink:sinks=2,budget=0.5", "test_syncing:window=12", "test_recompiling:window=12"]


def test_one_row_per_cache_and_mode_with_every_column(run):
    _info, rows, header, csv_rows, saved = run
    assert header == bench_gpu.COLUMNS
    assert [(r["cache"], r["mode"]) for r in csv_rows] == [(c, m) for c in CACHES for m in ("eager", "compiled")]
    assert len(saved["rows"]) == len(csv_rows) == len(rows) == 10
    assert saved["cpu_run"] is True and "CPU run" in saved["note"]
    assert saved["settings"]["compile_backend"] == "eager"
    for r in csv_rows:
        assert (r["device"], r["dtype"], r["batch"], r["prompt_tokens"], r["new_tokens"]) == (
            "cpu",
            "float32",
            "1",
            str(PROMPT),
            str(NEW),
        )


def test_eager_rows_time_and_measure_memory(run):
    _, rows, *_ = run
    for cache in CACHES:
        r = rows[(cache, "eager")]
        assert r["status"] == "ok", r
        assert r["rounds"] == 2 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert r["ref"] == "dynamic" and r["prefill_vs_ref"] > 0 and r["decode_vs_ref"] > 0
        assert isinstance(r["rss_growth_bytes"], int) and r["rss_source"]
        assert r["cuda_peak_bytes"] is None  # CPU run
    assert rows[("dynamic", "eager")]["decode_vs_ref"] == 1.0
    # DynamicCache holds exactly keys + values of every token in float32
    dense = 2 * LAYERS * KV_HEADS * (PROMPT + NEW) * HEAD_DIM * 4
    assert rows[("dynamic", "eager")]["cache_bytes"] == dense
    assert rows[("dynamic", "eager")]["cache_bytes_source"] == "key/value tensors of the layers"
    sink = rows[("sink:sinks=2,budget=0.5", "eager")]
    assert sink["cache_bytes_source"] == "cache.nbytes()"
    assert 0 < sink["cache_bytes"] < dense  # 12 of 30 tokens (+ slot metadata)


def test_syncs_and_ops_are_counted(run):
    _, rows, *_ = run
    for cache in ("dynamic", "static", "sink:sinks=2,budget=0.5", "test_recompiling:window=12"):
        assert rows[(cache, "eager")]["syncs_per_decode_step"] == 0, rows[(cache, "eager")]["sync_ops"]
    syncing = rows[("test_syncing:window=12", "eager")]
    assert syncing["syncs_per_decode_step"] == LAYERS  # one float() per layer and step
    assert json.loads(syncing["sync_ops"]) == {"aten._local_scalar_dense": 2 * LAYERS}  # over --sync-steps 2
    dyn = rows[("dynamic", "eager")]
    assert dyn["aten_ops_per_decode_step"] > 0 and dyn["aten_ops_vs_dynamic"] == 1.0
    assert dyn["aten_ops_per_step_per_layer"] == pytest.approx(dyn["aten_ops_per_decode_step"] / LAYERS, abs=0.01)
    sink = rows[("sink:sinks=2,budget=0.5", "eager")]
    assert sink["extra_aten_ops_per_layer_vs_dynamic"] == pytest.approx(
        sink["aten_ops_per_step_per_layer"] - dyn["aten_ops_per_step_per_layer"], abs=0.02
    )
    assert sink["aten_ops_vs_dynamic"] > 1  # its bookkeeping costs ops
    for cache in CACHES:  # not counted under compile
        assert rows[(cache, "compiled")]["syncs_per_decode_step"] is None


def test_compiled_rows_and_failures_are_reported(run):
    _, rows, *_ = run
    for cache in ("dynamic", "static"):
        r = rows[(cache, "compiled")]
        assert (r["status"], r["compiled_phases"], r["recompiles_timed"]) == ("ok", "prefill+decode", 0), r
        assert r["ref"] == "static" and r["decode_tok_s"] > 0 and r["compiled_vs_eager_decode"] > 0
        assert r["graphs"] >= 2  # prefill and decode
    assert rows[("static", "compiled")]["decode_vs_ref"] == 1.0

    syncing = rows[("test_syncing:window=12", "compiled")]
    assert syncing["status"] == "graph_break" and syncing["compiled_phases"] == "none"
    assert syncing["prefill_compile"] == syncing["decode_compile"] == "graph_break"
    assert "test_bench_gpu.py" in syncing["reason"]  # the user-code line of the break
    assert syncing["decode_tok_s"] is None and syncing["prefill_tok_s"] is None
    breaks = json.loads(syncing["graph_breaks"])
    assert breaks["decode"]["count"] >= LAYERS  # torch._dynamo.explain without fullgraph: one per layer at least

    recompiling = rows[("test_recompiling:window=12", "compiled")]
    assert recompiling["status"] == "recompiles" and recompiling["decode_compile"] == "recompiles"
    assert recompiling["prefill_compile"] == "ok" and recompiling["compiled_phases"] == "prefill"
    assert "step_tag" in recompiling["reason"]  # dynamo's guard on the changing state
    assert recompiling["graphs"] > bench_gpu.RECOMPILE_STREAK
    assert recompiling["decode_tok_s"] is None and recompiling["prefill_tok_s"] > 0


def test_table_on_stdout(run, capsys):
    info, *_ = run
    bench_gpu.print_table(info["rows"], bench_gpu.parse_args(["--tiny", "--prompt-tokens", str(PROMPT)]))
    out = capsys.readouterr().out
    for cache in CACHES:
        assert out.count(cache) >= 2  # an eager and a compiled line
    assert "- test_syncing:window=12 [compiled] graph_break: prefill:" in out
    assert "- test_recompiling:window=12 [compiled] recompiles: decode:" in out


def test_unknown_cache_is_refused_before_loading():
    with pytest.raises(ValueError, match="unknown cache 'nosuch'"):
        bench_gpu.main(["--tiny", "--cache", "nosuch:budget=4"])


def test_cudagraph_skip_messages_are_captured():
    """What inductor logs when a graph cannot run as a CUDA graph (on CUDA devices) reaches the benchmark's rows."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with bench_gpu.CudagraphSkips() as capture:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (test)")
    log_cudagraph_skip_and_bump_counter("after the context: not captured")
    assert capture.messages == ["skipping cudagraphs due to mutated inputs (test)"]
