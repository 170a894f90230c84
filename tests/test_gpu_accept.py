"""Stage 1 of the GPU acceptance run (eval/gpu/accept.sh, `-m cuda`): what our users run on a GPU, on random weights
in SmolLM2's shape (eval/gpu/random_models.py), against references computed on the CPU or through the dequantize
path.

The tests run on CUDA when there is one (bfloat16, 8 of SmolLM2's 30 layers) and are skipped otherwise, unless
HF_KVCACHE_ACCEPT_DEVICE=cpu (what `DEVICE=cpu bash eval/gpu/accept.sh run correctness ...` sets, and so the test
suite's end-to-end run of the command: tests/test_gpu_accept_command.py): then the same logic runs on the CPU in
float32 with 2 layers and the Triton kernel under its interpreter (TRITON_INTERPRET=1, set by the command), so it
cannot rot between lent GPUs.
- every cache name: `generate` runs on the device, and its teacher-forced log-probs there match the same cache's on
  the CPU in float32 (KL under KL_TOL: bfloat16 rounding on CUDA, float rounding on CPU);
- the Triton kernel that attends from FP8 / INT codes, inside the model (forced, and counted), equals the
  dequantize path;
- FP8 conversion and integer (quanto) packing on the device produce the CPU's codes;
- FP8 pages in `generate_batch` equal QuantizedFP8Cache run one request at a time (teacher-forced);
- FP8 / INT8 pages attending straight from their codes (the Triton paged kernel) equal the dequantize path;
- prompt eviction in `generate_batch` (model-dtype and FP8 pages) compresses every request and gives its pages back;
- head pages (`kv_compress_layout` 'head') give the token pages' log-probabilities with nothing evicted, and compress
  every request;
- compiled decode (`reduce-overhead`: CUDA graphs; on CPU dynamo's eager backend) of the fixed-budget caches compiles
  no graph after its warm-up.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import planted_surrogate

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.caches.catalog import CACHE_IMPLEMENTATIONS
from hf_kvcache.caches.scorers import ScorerCache
from hf_kvcache.evaluation.cache_spec import make_cache
from hf_kvcache.evaluation.divergence import cache_logprobs, divergence_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from gpu.random_models import random_model

_ASKED = os.environ.get("HF_KVCACHE_ACCEPT_DEVICE")
DEVICE = _ASKED or ("cuda" if torch.cuda.is_available() else None)
ON_CUDA = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
LAYERS = 8 if ON_CUDA else 2  # (8 of 30 on CUDA: compile times and bfloat16 drift stay small)
#: KL(CPU float32 || device) per position: bfloat16 rounding on CUDA, float rounding when both sides are the CPU's
KL_TOL = 2e-2 if ON_CUDA else 1e-6
PROMPT, STEPS = 48, 8

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE is None or (DEVICE == "cuda" and not torch.cuda.is_available()),
        reason="needs a GPU (or HF_KVCACHE_ACCEPT_DEVICE=cpu)",
    ),
]
if _ASKED not in (None, "cpu", "cuda"):
    raise ValueError(f"HF_KVCACHE_ACCEPT_DEVICE must be 'cpu' or 'cuda', got {_ASKED!r}")

#: KVzip's reconstruction request as token ids (random weights come without a tokenizer)
REQUEST_IDS = {"first": [5, 6], "next": [7, 8], "suffix": [9, 10]}
#: a config per registered cache name, small enough for PROMPT + STEPS tokens to evict
CONFIGS = {
    "sink": {"sinks": 4, "window": 20},
    "sliding": {"window": 24},
    "h2o": {"budget": 24},
    "random_eviction": {"budget": 24},
    "composite": {"preset": "sinks_heavy_recent", "budget": 24},
    "kivi": {"bits": 4, "group_size": 16, "residual": 16},
    "fp8": {},
    "knorm": {"budget": 24},
    "keydiff": {"budget": 24},
    "tova": {"budget": 24},
    "snapkv": {"budget": 24, "window": 8},
    "expected_attention": {"budget": 24},
    "kvzip": {"budget": 24, "head_budget": "adaptive", "request_ids": REQUEST_IDS},
    "kvzap": {"budget": 24},  # (and a surrogate planted for the model: `_logprobs`)
    # the caches of scorers added to hf_kvcache.scorers.registry, with the scorer's settings for a few tokens
    **{
        cls.cache_name: {"budget": 24, **cls.scorer_class.small}
        for cls in CACHE_IMPLEMENTATIONS.values()
        if issubclass(cls, ScorerCache)
    },
}


@functools.cache
def _models():
    """(model on DEVICE in DTYPE, the same weights on the CPU in float32)."""
    cpu = random_model("smollm2-135m", torch.float32, "cpu", layers=LAYERS, seed=0)
    device = random_model("smollm2-135m", torch.float32, "cpu", layers=LAYERS, seed=0).to(DEVICE, DTYPE)
    return device, cpu


def _ids(total: int = PROMPT + STEPS) -> torch.Tensor:
    return torch.randint(3, 49152, (total,), generator=torch.Generator().manual_seed(1))


def _config(model, name) -> dict:
    """CONFIGS[name], with a KVzap surrogate planted for this random model (random weights, seeded: the same on both
    devices)."""
    config = dict(CONFIGS[name])
    if name == "kvzap":
        config["surrogate"] = planted_surrogate(model)
    return config


def _logprobs(model, name, config) -> torch.Tensor:
    cache = make_cache(model, name, dict(config), context_len=PROMPT, total_len=PROMPT + STEPS)
    return cache_logprobs(model, _ids(), cache, PROMPT).float().cpu()


def test_every_registered_cache_has_a_config_here():
    assert set(hf_kvcache.CACHE_IMPLEMENTATIONS) <= set(CONFIGS), set(hf_kvcache.CACHE_IMPLEMENTATIONS) - set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cache_generates_on_the_device_and_matches_the_cpu(name):
    if name not in hf_kvcache.CACHE_IMPLEMENTATIONS:
        pytest.skip(f"{name} is not registered here")
    model, cpu = _models()
    ids = _ids(PROMPT)[None].to(DEVICE)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=STEPS,
        do_sample=False,
        cache_implementation=name,
        cache_config=_config(model, name),
        pad_token_id=2,
        disable_compile=True,
    )
    assert out.shape == (1, PROMPT + STEPS) and out.device.type == torch.device(DEVICE).type
    got = _logprobs(model, name, _config(model, name))
    ref = _logprobs(cpu, name, _config(cpu, name))
    assert torch.isfinite(got).all()
    kl = divergence_metrics(ref, got)["kl_mean"]
    assert kl < KL_TOL, (name, kl)


def _count_calls(monkeypatch, module, attribute) -> list:
    calls = []
    original = getattr(module, attribute)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, attribute, counted)
    return calls


@pytest.mark.parametrize(
    "name, config",
    [
        ("fp8", {}),
        ("kivi", {"bits": 4, "group_size": 16, "residual": 16}),
        ("composite", {"preset": "sinks_heavy_recent", "budget": 24}),
    ],
)
def test_triton_kernel_inside_the_model_equals_the_dequantize_path(name, config, monkeypatch):
    pytest.importorskip("triton")
    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the Triton kernel runs under TRITON_INTERPRET=1 (set before triton is imported)")
    from hf_kvcache.attention import codes
    from hf_kvcache.kernels import triton_blockwise

    model, _ = _models()
    ref = _logprobs(model, name, {**config, "attention": "dequantize"})
    # every read from codes goes to the Triton kernel (on CPU: not the native one), and the calls are counted
    monkeypatch.setattr(codes, "native_decode", lambda: False)
    monkeypatch.setattr(codes, "blockwise_attention", functools.partial(codes.blockwise_attention, backend="triton"))
    calls = _count_calls(monkeypatch, triton_blockwise, "triton_blockwise_attention")
    got = _logprobs(model, name, {**config, "attention": "blockwise"})
    assert len(calls) >= (STEPS - 1) * model.config.num_hidden_layers  # every decode step, every layer
    kl = divergence_metrics(ref, got)["kl_mean"]
    assert kl < KL_TOL, (name, kl)


@pytest.mark.parametrize(
    "spec",
    [
        {"format": "fp8_e4m3"},
        {"format": "fp8_e5m2"},
        {"format": "int4", "granularity": "token", "group_size": 32, "backend": "quanto"},
        {"format": "int2", "granularity": "channel", "group_size": 32, "backend": "quanto"},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_codes_on_the_device_equal_the_cpu(spec):
    from hf_kvcache.stores.factory import make_codec
    from hf_kvcache.stores.quantization import QuantSpec

    if spec.get("backend") == "quanto":
        pytest.importorskip("optimum.quanto")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to(DTYPE)
    encoded = {}
    for device in ("cpu", DEVICE):
        codec = make_codec(QuantSpec.from_value(spec))
        codec.allocate(2, 3, 64, 64, DTYPE, device)
        encoded[device] = {k: v.cpu() for k, v in codec.encode(x.to(device)).items()}
    assert encoded["cpu"].keys() == encoded[DEVICE].keys()
    for key, value in encoded["cpu"].items():
        other = encoded[DEVICE][key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        if value.is_floating_point():  # scales and zeros: the device's float rounding
            torch.testing.assert_close(other, value, rtol=1e-2 if ON_CUDA else 0, atol=1e-6 if ON_CUDA else 0)
        else:  # codes: one code of 256 may land on the next value where the device rounds a product differently
            assert (other != value).float().mean() < (4e-3 if ON_CUDA else 1e-12), key


def test_fp8_pages_in_generate_batch_equal_quantized_fp8_cache():
    from test_paged import GREEDY, NEW_TOKENS, _cb, _prompts, _run

    model, _ = _models()
    twin = random_model("smollm2-135m", torch.float32, "cpu", layers=LAYERS, seed=0).to(DEVICE, DTYPE)
    prompts = _prompts()
    ref_tokens, _ = _run(model, prompts, _cb())
    force = {rid: dict(enumerate(t)) for rid, t in ref_tokens.items()}
    tokens, rec = _run(model, prompts, _cb("fp8_e4m3", {"key_rotation": "none"}), force)
    assert tokens == ref_tokens and GREEDY.max_new_tokens == NEW_TOKENS
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    paged = rec.logprobs()
    worst = 0.0
    for i, rid in enumerate(sorted(tokens, key=lambda r: int(r.split("_")[1]))):
        ids = torch.tensor(prompts[i] + tokens[rid])
        cache = hf_kvcache.QuantizedFP8Cache(twin, attention="dequantize", format="fp8_e4m3", key_rotation="none")
        one_by_one = cache_logprobs(twin, ids, cache, len(prompts[i]))[:NEW_TOKENS].float().cpu()
        worst = max(worst, divergence_metrics(one_by_one, paged[rid].float())["kl_mean"])
    assert worst < KL_TOL, worst


@pytest.mark.parametrize("kv_dtype, options", [("fp8_e4m3", {}), ("int8", {"group_size": 32})])
def test_paged_attention_from_codes_equals_the_dequantize_path(kv_dtype, options, monkeypatch):
    """Quantized pages in generate_batch attending straight from the codes (the Triton paged kernel: on CUDA
    through attention="codes", on CPU forced under the interpreter) give the dequantize path's log-probabilities."""
    pytest.importorskip("triton")
    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the Triton kernel runs under TRITON_INTERPRET=1 (set before triton is imported)")
    from test_paged import NEW_TOKENS, _cb, _prompts, _run

    from hf_kvcache.kernels import triton_paged
    from hf_kvcache.paged import codes_attention

    model, _ = _models()
    prompts = _prompts()
    ref_tokens, ref = _run(model, prompts, _cb(kv_dtype, {**options, "attention": "dequantize"}))
    force = {rid: dict(enumerate(t)) for rid, t in ref_tokens.items()}
    if not ON_CUDA:  # the CPU would take the native kernel
        attend = codes_attention.PagedCodes.attend
        monkeypatch.setattr(
            codes_attention.PagedCodes, "attend", lambda self, *a, **k: attend(self, *a, **k, backend="triton")
        )
    calls = _count_calls(monkeypatch, triton_paged, "triton_paged_attention")
    tokens, rec = _run(model, prompts, _cb(kv_dtype, {**options, "attention": "codes"}), force)
    assert tokens == ref_tokens
    assert len(calls) >= (NEW_TOKENS - 1) * model.config.num_hidden_layers  # every decode step, every layer
    worst = max(divergence_metrics(ref.logprobs()[r].float(), rec.logprobs()[r].float())["kl_mean"] for r in tokens)
    assert worst < KL_TOL, worst


@pytest.mark.parametrize(
    "compress, kv_dtype",
    [("knorm:budget=0.25", None), ("snapkv:budget=0.25", "fp8_e4m3"), ("keydiff:budget=0.25:chunk=16", "fp8_e4m3")],
)
def test_prompt_eviction_in_generate_batch_on_the_device(compress, kv_dtype):
    """Prompt eviction in continuous batching on the device (positions shifted on its tensors, rows moved there,
    CUDA graphs and async batching turned off; chunk by chunk, the scheduler's split capped): every request is
    compressed and finishes, its first token (predicted before eviction, unless compressed chunk by chunk) is the
    uncompressed run's, and its pages past the kept tokens went back (every page is free after the run)."""
    from test_paged import _prompts, _run
    from test_paged_eviction import _cb as eviction_cb

    model, _ = _models()
    prompts = [p * 3 for p in _prompts()]  # 15-90 tokens: several pages of 8 each
    full, _ = _run(model, prompts, eviction_cb(kv_dtype=kv_dtype))
    tokens, rec = _run(model, prompts, eviction_cb(compress, kv_dtype=kv_dtype))
    stats = rec.eviction_stats
    assert stats.requests_compressed == len(prompts) and stats.pages_freed > 0, stats
    assert stats.tokens_kept == sum(-(-len(p) // 4) for p in prompts)
    if ":chunk=" not in compress:
        assert {r: t[0] for r, t in tokens.items()} == {r: t[0] for r, t in full.items()}
    assert all(len(t) == len(full[r]) for r, t in tokens.items())


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_head_pages_on_the_device(kv_dtype, monkeypatch):
    """Pages of one (layer, KV head) (`kv_compress_layout` 'head') on the device: with nothing evicted, their
    log-probabilities (teacher-forced) are the token pages' (the Triton paged kernel with one KV head per pair on
    CUDA; on CPU under the interpreter, else the native kernel); compressed, every request finishes with its pages
    back and holds the sum of its heads' pages."""
    from test_paged import _prompts, _run
    from test_paged_eviction import _cb as eviction_cb

    from hf_kvcache.paged import head_attention

    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        attend = head_attention.HeadPagedCodes.attend
        monkeypatch.setattr(
            head_attention.HeadPagedCodes, "attend", lambda s, *a, **k: attend(s, *a, **k, backend="triton")
        )
    model, _ = _models()
    prompts = [p * 3 for p in _prompts()]
    whole = eviction_cb("knorm:budget=100000", kv_dtype=kv_dtype)
    ref_tokens, ref = _run(model, prompts, whole)
    force = {rid: dict(enumerate(t)) for rid, t in ref_tokens.items()}
    heads_cb = eviction_cb("knorm:budget=100000", kv_dtype=kv_dtype)
    heads_cb.kv_compress_layout = "head"
    tokens, rec = _run(model, prompts, heads_cb, force)
    assert tokens == ref_tokens
    worst = max(divergence_metrics(ref.logprobs()[r].float(), rec.logprobs()[r].float())["kl_mean"] for r in tokens)
    assert worst < KL_TOL, worst
    compressed = eviction_cb("knorm:budget=0.25", kv_dtype=kv_dtype)
    compressed.kv_compress_layout = "head"
    tokens, rec = _run(model, prompts, compressed)
    stats = rec.eviction_stats
    assert stats.requests_compressed == len(prompts) and stats.pages_freed > 0, stats
    assert all(len(t) == len(ref_tokens[r]) for r, t in tokens.items())


@pytest.mark.parametrize(
    "name, config",
    [
        ("sink", {"sinks": 4, "window": 20}),
        ("sliding", {"window": 24}),
        ("h2o", {"budget": 24}),
        ("fp8", {"max_length": PROMPT + 32}),
    ],
)
def test_compiled_decode_of_fixed_budget_caches_does_not_recompile(name, config):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, _ = _models()
    cache = make_cache(model, name, dict(config), context_len=PROMPT, total_len=PROMPT + 32)
    assert cache.is_compileable, name
    options = {"mode": "reduce-overhead"} if ON_CUDA else {"backend": "eager"}

    def forward(**kwargs):
        return model.forward(**kwargs)

    decode = torch.compile(forward, fullgraph=True, **options)
    ids = torch.randint(3, 49152, (1, PROMPT + 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.inference_mode():
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        graphs = []
        for i in range(PROMPT, PROMPT + 32):  # eviction starts within these steps (budgets under PROMPT)
            if ON_CUDA:
                torch.compiler.cudagraph_mark_step_begin()
            out = decode(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
            graphs.append(int(counters["stats"]["unique_graphs"]))
    assert torch.isfinite(out.logits.float()).all()
    warm = 8
    assert graphs[-1] == graphs[warm], (name, graphs)  # nothing compiled after the warm-up steps
