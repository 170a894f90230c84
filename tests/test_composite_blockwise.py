"""CompositeCache's `attention` option: attention straight from the regions' codes (hf_kvcache.layers.codes_read)
gives, at every layer and forward (chunked prefill, decode, left padding), the output and the column scores that
softmax attention over the dequantized regions gives, for every heavy-hitter scorer, in bfloat16, and on the model
zoo's softcap, attention sinks, QK-norm and partial rotary; it makes no host sync in decode and never fills the
dequantization workspace; "auto" reads codes only where there are some, on CUDA and (native kernel) in CPU decode.
The Triton kernel (CUDA's path) reads a composite layer's segments as the torch path does, under the interpreter.

Whole-model runs of the two paths are not compared token by token over many steps: float32 summation order differs
(~1e-6), and an evicting policy turns such a difference into another eviction whenever two scores are that close."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, greedy_decode_syncs, left_pad, random_ids

import hf_kvcache
import hf_kvcache.attention.bridge as bridge
from hf_kvcache import CompositeCache, cache_kwargs
from hf_kvcache.attention.scored import scored_attention
from hf_kvcache.kernels import dequantize
from hf_kvcache.layers.codes_read import resolve_attention


@pytest.fixture(scope="module")
def llama():
    # initializer_range 0.1 as tests/test_blockwise_integration.py: float32 noise stays ~1e-6 per layer
    return build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)


def regions(scorer: str, **options) -> list[dict]:
    """4 full-precision sinks, an 8-token FP8 window, 8 FP8 heavy hitters ranked by `scorer`: evicting by token 21."""
    return [
        {"role": "sinks", "tokens": 4},
        {"role": "window", "start": 0, "end": 8, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {"role": "heavy", "tokens": 8, "keys": "fp8_e4m3", "values": "fp8_e4m3", "scorer": scorer, **options},
    ]


class AttendChecker:
    """Wraps the bridge's `attend`: before each call, the reference (scored_attention over the dequantized segments
    of the same read, with the layer's validity and the scores of the policy's `attention_window`); after it, the
    output and the column scores handed to the policy must match."""

    def __init__(self, monkeypatch):
        self.calls = {"decode": 0, "chunk": 0}
        self.worst = {"output": 0.0, "scores": 0.0}
        original = bridge.attend

        def checked(module, layer, query, key, value, spec, kwargs, rotation=None):
            read = layer.codes_read
            if read is None or read.keys is None:  # the first prefill: attention as usual
                return original(module, layer, query, key, value, spec, kwargs, rotation)
            rotated = query if rotation is None else query.float() @ rotation  # (the bridge defers a key rotation)
            # the reference in float32 (the kernels' contract: dequantize, then softmax attention in float32)
            keys = torch.cat([dequantize(s).float() for s in read.keys], 2)
            values = torch.cat([dequantize(s).float() for s in read.values], 2)
            q = query.shape[2]
            window = layer.policy.attention_window
            valid, causal_tail = spec if spec is not None else (None, q if q > 1 else 0)
            reference, reference_scores = scored_attention(
                rotated.float(),
                keys,
                values,
                valid,
                causal_tail,
                kwargs.get("scaling") or module.scaling,
                query_weight=layer.forward_info.real.float(),
                softcap=kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None)) or None,
                sinks=getattr(module, "sinks", None),
                score_from=q - window if window is not None and q > window else 0,
            )
            seen = []
            observe = layer.policy.observe
            layer.policy.observe = lambda lay, scores: (seen.append(scores.clone()), observe(lay, scores))[1]
            try:
                out, _ = original(module, layer, query, key, value, spec, kwargs, rotation)
            finally:
                del layer.policy.observe
            self.calls["decode" if q == 1 else "chunk"] += 1
            error = ((out.float() - reference) / (1 + reference.abs())).abs().max().item()  # relative above 1
            self.worst["output"] = max(self.worst["output"], error)
            assert len(seen) == int(layer.policy.needs_attention)
            if seen:
                self.worst["scores"] = max(self.worst["scores"], (seen[0] - reference_scores).abs().max().item())
            return out, None

        monkeypatch.setattr(bridge, "attend", checked)


def forwards(model, cache, ids, mask=None, chunks=(12, 10, 9), steps=8):
    """Prefill `ids` in `chunks`, then `steps` greedy tokens (left padding: `mask`)."""
    hf_kvcache.enable(model)
    mask = torch.ones_like(ids) if mask is None else mask
    t = 0
    with torch.no_grad():
        for c in chunks:
            m = mask[:, : t + c]
            positions = (m.cumsum(-1) - 1).clamp(min=0)[:, t:]
            out = model(input_ids=ids[:, t : t + c], attention_mask=m, position_ids=positions, **cache_kwargs(cache))
            t += c
        for _ in range(steps):
            mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
            out = model(
                input_ids=out.logits[:, -1:].argmax(-1),
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1)[:, -1:],
                **cache_kwargs(cache),
            )
    return out


@pytest.mark.parametrize(
    "scorer, options",
    [("h2o", {}), ("tova", {}), ("snapkv", {"window": 4, "kernel": 3}), ("expected_attention", {}), ("keydiff", {})],
)
def test_codes_attention_equals_dequantized_softmax(llama, monkeypatch, scorer, options):
    checker = AttendChecker(monkeypatch)
    cache = CompositeCache(llama, regions=regions(scorer, **options), attention="blockwise")
    forwards(llama, cache, random_ids(1, 31, seed=3))
    layers = llama.config.num_hidden_layers
    assert checker.calls == {"chunk": 2 * layers, "decode": 8 * layers}
    assert checker.worst["output"] < 1e-5 and checker.worst["scores"] < 1e-5, checker.worst
    assert all(layer.attention_from_codes for layer in cache.compressed_layers)
    assert cache.compressed_layers[0].policy.has_evicted(cache.compressed_layers[0].seen)
    if scorer not in ("expected_attention", "keydiff"):  # (these scorers read the stored keys themselves)
        assert cache.workspace_nbytes() == 0


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "qwen3", "gpt_neox"])
def test_model_zoo(monkeypatch, arch):
    """Softcap and sliding/global layers (Gemma 2), attention sinks (GPT-OSS), QK-norm (Qwen3), partial rotary with
    the sinks re-rotated in place (GPT-NeoX)."""
    from model_zoo import build

    model = build(arch)
    checker = AttendChecker(monkeypatch)
    cache = CompositeCache(model, regions=regions("h2o"), attention="blockwise")
    forwards(model, cache, random_ids(1, 31, seed=10))
    compressed = len(cache.compressed_layers)
    assert compressed >= 1 and checker.calls == {"chunk": 2 * compressed, "decode": 8 * compressed}
    assert checker.worst["output"] < 1e-5 and checker.worst["scores"] < 1e-5, checker.worst


def test_bfloat16(monkeypatch):
    """A bfloat16 model (what GPUs run): the codes path computes in float32 and rounds the output to bfloat16 once
    (within one bfloat16 rounding, 2^-8 relative, of the float32 reference)."""
    model = build_model(
        "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1
    ).to(torch.bfloat16)
    checker = AttendChecker(monkeypatch)
    cache = CompositeCache(model, regions=regions("h2o"), attention="blockwise")
    out = forwards(model, cache, random_ids(1, 31, seed=12))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    assert checker.calls["decode"] == 8 * model.config.num_hidden_layers
    assert checker.worst["output"] <= 2**-8 and checker.worst["scores"] < 1e-5, checker.worst


def test_latent_attention_auto_dequantizes_and_blockwise_is_refused(monkeypatch):
    """DeepSeek-V3 (MLA) expands the cached latent before attention: nothing can read its codes."""
    from model_zoo import build

    model = build("deepseek_v3")
    ids = random_ids(1, 26, seed=11)
    options = dict(regions=regions("h2o"), sink_positions="original")  # (latent keys cannot be re-rotated)
    cache = CompositeCache(model, **options)
    forwards(model, cache, ids, chunks=(20, 6), steps=2)
    assert not any(layer.attention_from_codes for layer in cache.compressed_layers)
    with pytest.raises(RuntimeError, match="attention='dequantize'"):
        forwards(model, CompositeCache(model, attention="blockwise", **options), ids, chunks=(20, 6))


def test_left_padding_and_prompt_mode(llama, monkeypatch):
    checker = AttendChecker(monkeypatch)
    ids, mask = left_pad([random_ids(1, 31, seed=4)[0], random_ids(1, 24, seed=5)[0]])
    for compress in ("always", "prompt"):
        cache = CompositeCache(llama, regions=regions("h2o"), compress=compress, attention="blockwise")
        forwards(llama, cache, ids, mask)
    assert checker.calls["decode"] == 2 * 8 * llama.config.num_hidden_layers
    assert checker.worst["output"] < 1e-5 and checker.worst["scores"] < 1e-5, checker.worst


def test_chunk_logits_and_preset(llama):
    """The second chunk (the first that reads stored codes, before any eviction decision) gives the same logits on
    both paths; the preset takes the option too."""
    ids = random_ids(1, 40, seed=6)
    logits = {}
    for attention in ("dequantize", "blockwise"):
        cache = CompositeCache(llama, preset="sinks_heavy_recent", budget=20, attention=attention)
        hf_kvcache.enable(llama)
        with torch.no_grad():
            llama(input_ids=ids[:, :24], **cache_kwargs(cache))
            logits[attention] = llama(input_ids=ids[:, 24:], **cache_kwargs(cache)).logits
        assert all(layer.attention_from_codes == (attention == "blockwise") for layer in cache.compressed_layers)
    torch.testing.assert_close(logits["blockwise"], logits["dequantize"], atol=1e-4, rtol=0)


def test_decode_from_codes_makes_no_host_sync(llama):
    ids, mask = left_pad([random_ids(1, 30, seed=7)[0], random_ids(1, 22, seed=8)[0]])
    cache = CompositeCache(llama, regions=regions("h2o"), attention="blockwise")
    hf_kvcache.enable(llama)
    assert greedy_decode_syncs(llama, cache, ids, mask, steps=6) == [{}] * 6
    assert all(layer.attention_from_codes for layer in cache.compressed_layers)


@pytest.mark.parametrize("native", [True, False])
def test_auto_reads_codes_where_a_kernel_runs_with_quantized_regions_and_bad_options_are_named(
    llama, native, monkeypatch
):
    if not native:
        monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    cache = CompositeCache(llama, preset="sinks_heavy_recent", budget=20)
    forwards(llama, cache, random_ids(1, 26, seed=9), chunks=(26,), steps=1)
    assert cache.attention == "auto"
    # CPU: decode steps from the codes with the native kernel (prefill chunks dequantize); without it, never
    assert all(layer.attention_from_codes == native for layer in cache.compressed_layers)
    layer = cache.compressed_layers[0]
    assert resolve_attention(layer, torch.device("cuda")) is True  # where "auto" reads the codes
    full = CompositeCache(llama, preset="sinks_heavy_recent", budget=20, precision="full")
    forwards(llama, full, random_ids(1, 26, seed=9), chunks=(26,), steps=1)
    assert resolve_attention(full.compressed_layers[0], torch.device("cuda")) is False  # nothing quantized: SDPA
    full.compressed_layers[0].attention = "blockwise"  # (asked for: the block walk over full-precision segments)
    assert resolve_attention(full.compressed_layers[0], torch.device("cuda")) is True
    with pytest.raises(ValueError, match=r"`attention` must be one of \('auto', 'blockwise', 'dequantize'\)"):
        CompositeCache(llama, preset="sinks_heavy_recent", budget=20, attention="codes")
    with pytest.raises(ValueError, match="`attention_block`"):
        CompositeCache(llama, preset="sinks_heavy_recent", budget=20, attention_block=0)


TRITON_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
import hf_kvcache
from conftest import build_model, left_pad, random_ids
import test_composite_blockwise as t
from hf_kvcache.kernels import blockwise_attention

model = build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
ids, mask = left_pad([random_ids(1, 31, seed=4)[0], random_ids(1, 10, seed=5)[0]])  # the short row: empty slots
cache = hf_kvcache.CompositeCache(model, regions=t.regions("h2o"), attention="blockwise")
t.forwards(model, cache, ids, mask, steps=3)
errors = []
for layer in cache.compressed_layers:
    width = layer.policy.capacity
    keys, values = layer.store.segments(width)
    valid = layer.slot_valid[..., :width]
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(layer.layer_idx))
    args = (query, keys, values, valid, 0.2)
    ref, ref_scores = blockwise_attention(*args, return_column_scores=True, backend="torch")
    out, scores = blockwise_attention(*args, return_column_scores=True, backend="triton")
    errors.append([[s.format for s in keys], float((out - ref).abs().max()), float((scores - ref_scores).abs().max()),
                   int((~valid).sum())])
print(json.dumps(errors))
"""


def test_triton_kernel_reads_composite_segments_under_the_interpreter():
    """The CUDA path ("auto" there) on a composite layer's real segments (full-precision sinks + FP8 ring/pool, per-head
    validity with padding holes): Triton's CPU interpreter against the torch block path."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    tests = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT.format(tests=tests)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(tests),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 2
    for formats, out_err, score_err, holes in errors:
        assert formats == ["none", "fp8_e4m3"]
        assert holes > 0  # the short row's empty slots
        assert out_err < 2e-5 and score_err < 2e-6, (out_err, score_err)
