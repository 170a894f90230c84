"""eval/bench_decode_bandwidth.py's kernel-alone rows on CPU (bytes counted, shares of the bound), the attention shape
it takes from a model config, and bench_gpu.py's `--decode-bandwidth` handing its device, dtype and model over."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from hf_kvcache.kernels import cpu_blockwise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import bench_decode_bandwidth
import bench_gpu


@pytest.mark.skipif(cpu_blockwise.unavailable() is not None, reason="the native CPU kernel does not build here")
def test_kernel_rows_count_the_bytes_read_and_compare_with_a_plain_read():
    n, heads, dim, layers = 64, 2, 64, 2
    rows = bench_decode_bandwidth.kernel_rows([n], layers, repeats=2, heads=heads, groups=2, dim=dim)
    by = {r["cache"]: r for r in rows}
    assert set(by) == {"fp8 per-token (native kernel)", "kivi int4 (native kernel)"}
    # FP8 per token: one byte per element and a bfloat16 scale per token, for keys and values
    assert by["fp8 per-token (native kernel)"]["bytes_read"] == layers * 2 * heads * n * (dim + 2)
    # KIVI INT4: half a byte per element; keys one float32 scale and zero per channel per 32 tokens, values per 32
    # channels of a token
    keys = heads * (n * dim // 2 + 2 * 4 * dim * n // 32)
    values = heads * (n * dim // 2 + 2 * 4 * n * dim // 32)
    assert by["kivi int4 (native kernel)"]["bytes_read"] == layers * (keys + values)
    for r in rows:
        assert r["kernel_ms"] > 0 and r["through_blockwise_attention_ms"] > 0 and r["kernel_on_cached_bytes_ms"] > 0
        assert r["share_of_bound"] == pytest.approx(r["kernel_gb_per_s"] / r["read_bound_gb_per_s"])
        assert r["read_bound_ms"] == pytest.approx(r["bytes_read"] / r["read_bound_gb_per_s"] / 1e6)
        assert 0 < r["multiply_add_floor_ms"] < 1000  # built and timed (float32 on CPU)


def test_multiply_add_floor_counts_one_per_element_and_query_row(monkeypatch):
    """The floor times elements x query rows / 16 vector multiply-adds, split over torch's threads."""
    calls = []
    monkeypatch.setattr(
        bench_decode_bandwidth, "_multiply_adds", lambda: lambda n, threads: calls.append((n, threads)) or 0.002
    )
    monkeypatch.setattr(bench_decode_bandwidth.torch, "get_num_threads", lambda: 2)
    assert bench_decode_bandwidth.multiply_add_floor_ms(2 * 30 * 3 * 8192 * 64, 3, repeats=3) == pytest.approx(2.0)
    assert calls == [(2 * 30 * 3 * 8192 * 64 * 3 // 16, 2)] * 4  # a warm-up, then the repeats


def test_attention_shape_from_a_config():
    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert bench_decode_bandwidth.attention_shape(smollm2) == {"heads": 3, "groups": 3, "dim": 64}
    explicit = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    assert bench_decode_bandwidth.attention_shape(explicit) == {"heads": 2, "groups": 4, "dim": 128}


def test_bench_gpu_hands_the_table_its_device_dtype_and_model(monkeypatch, tmp_path):
    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        out = Path(argv[argv.index("--out") + 1])
        out.with_suffix(".json").write_text(json.dumps({"rows": [{"part": "decode"}]}))

    monkeypatch.setattr(bench_decode_bandwidth, "main", fake_main)
    result = bench_gpu.main(["--decode-bandwidth", "1024", "8192", "--out", str(tmp_path), "--name", "cpu"])
    assert result == {"rows": [{"part": "decode"}]}
    argv = seen["argv"]
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--model") + 1] == "smollm2"
    assert argv[argv.index("--lengths") + 1 :] == ["1024", "8192"]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "cpu_decode_bandwidth")
