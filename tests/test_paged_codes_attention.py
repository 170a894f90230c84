"""Attention straight from quantized pages (hf_kvcache.paged.codes_attention, issue 49).

The kernel equals the gather-and-dequantize path (then per-request causal softmax attention in float32) on every
layout continuous batching produces: ragged batches mixing decode rows, first forwards and later prefill chunks,
requests spanning many pages whose pages are not adjacent, page boundaries inside a forward, every page format
(FP8 E4M3 / E5M2, INT8, INT4; rotated keys or not), and long requests split over column ranges. Unmarked attention
calls still go to transformers' functions; what cannot run from the codes says why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import model_zoo
import pytest
import torch
from conftest import build_config
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_kvcache.integration.continuous_batching import attention_takes_cache_rows
from hf_kvcache.kernels import cpu_blockwise
from hf_kvcache.paged import QuantizedPagedAttentionCache
from hf_kvcache.paged import codes_attention as ca

pytestmark = pytest.mark.skipif(cpu_blockwise.unavailable() is not None, reason="the native CPU kernel does not build")

HEADS, KV_HEADS, DIM = 4, 2, 16
FORMATS = [
    ("fp8_e4m3", None),  # Hadamard-rotated keys by default
    ("fp8_e4m3", {"key_rotation": "none"}),
    ("fp8_e5m2", {"scale_dtype": "float32"}),
    ("int8", {"group_size": 8}),
    ("int4", {"group_size": 8, "key_rotation": "none"}),
]


def _cache(kv_dtype, options, attention, page_size=4, num_blocks=64):
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        page_size=page_size,
        max_batch_tokens=256,
        allow_block_sharing=False,
        max_memory_percent=0.9,
    )
    cb.kv_cache_dtype = kv_dtype
    cb.kv_cache_quantization = {**(options or {}), "attention": attention}
    return QuantizedPagedAttentionCache(build_config("llama"), cb, "cpu", DistributedHelper(None, None), torch.float32)


class Driver:
    """Feeds the same forwards to a cache on each path, as continuous batching would (pages allocated per request,
    read / write indices, packed keys and values)."""

    def __init__(self, cache):
        self.cache, self.past = cache, {}
        self.allocator = cache.cache_allocators["full_attention"]

    def forward(self, batch, keys, values):
        """batch: [(request_id, new tokens)]; keys / values [1, Hkv, N, D] packed in batch order -> kwargs, update's
        (keys, values)."""
        cache, allocator = self.cache, self.allocator
        read, write, cu_q, cu_k = [[]], [[]], [0], [0]
        for rid, new in batch:
            past = self.past.get(rid, 0)
            for _ in range(allocator.needs_new_sectors(rid, past, new)):
                cache.pool.allocate_sector(allocator.index)
            allocator.allocate_cache_to_request(rid, past, new)
            cache.extend_read_and_write_indices(rid, past, new, read, write)
            cu_q.append(cu_q[-1] + new)
            cu_k.append(cu_k[-1] + past + new)
            self.past[rid] = past + new
        kwargs = {
            "read_index": [torch.tensor(read[0])],
            "write_index": [torch.tensor(write[0])],
            "cu_seq_lens_q": torch.tensor(cu_q, dtype=torch.int32),
            "cu_seq_lens_k": {"full_attention": torch.tensor(cu_k, dtype=torch.int32)},
            "max_length_k": {"full_attention": max(cu_k)},
        }
        k, v = cache.update(keys, values, 0, kwargs)
        return kwargs, k, v


def _reference(query, keys, values, cu_q, cu_k):
    """Per-request causal attention (new tokens last) in float32: [1, N, Hq, D]."""
    out = torch.zeros(query.shape[2], HEADS, DIM)
    for r in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        if q1 == q0:
            continue
        q = query[:, :, q0:q1]
        k = keys[:, :, k0:k1].repeat_interleave(HEADS // KV_HEADS, 1)
        v = values[:, :, k0:k1].repeat_interleave(HEADS // KV_HEADS, 1)
        n, nq = k1 - k0, q1 - q0
        mask = torch.arange(n)[None, :] <= (torch.arange(nq)[:, None] + n - nq)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=DIM**-0.5)
        out[q0:q1] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


# forwards of requests a-d: first forwards, decode rows, a later prefill chunk (d's prompt in two chunks), pages
# interleaved between requests, a request spanning many 4-token pages
SCHEDULE = [
    [("a", 6)],
    [("a", 1), ("b", 5)],
    [("a", 1), ("b", 1), ("c", 23), ("d", 7)],
    [("c", 1), ("d", 9), ("a", 1)],
    [("b", 1), ("c", 1), ("d", 1), ("a", 3)],
    [("d", 1), ("c", 1)],
]


def _forwards(kv_dtype, options):
    """The SCHEDULE through a codes-path cache and a gather-path cache of the same pages: per forward, (random
    generator, query, the codes path's kwargs and returned keys / values, per-request attention over the gather
    path's rows)."""
    codes, reference = Driver(_cache(kv_dtype, options, "codes")), Driver(_cache(kv_dtype, options, "dequantize"))
    assert codes.cache.attention_path == "codes" and reference.cache.attention_path == "dequantize"
    gen = torch.Generator().manual_seed(0)
    for batch in SCHEDULE:
        n = sum(new for _, new in batch)
        keys, values = (torch.randn(1, KV_HEADS, n, DIM, generator=gen) for _ in range(2))
        query = torch.randn(1, HEADS, n, DIM, generator=gen)
        kw_codes, k_codes, v_codes = codes.forward(batch, keys, values)
        kw_ref, k_ref, v_ref = reference.forward(batch, keys, values)
        expected = _reference(query, k_ref, v_ref, kw_ref["cu_seq_lens_q"], kw_ref["cu_seq_lens_k"])
        yield gen, query, kw_codes, k_codes, v_codes, expected


@pytest.mark.parametrize("kv_dtype, options", FORMATS)
def test_codes_attention_equals_the_dequantize_path_on_ragged_paged_batches(kv_dtype, options):
    worst = 0.0
    for _, query, kw_codes, k_codes, v_codes, expected in _forwards(kv_dtype, options):
        assert k_codes.shape[2] == 0  # the codes path returns no rows: nothing was gathered
        paged = kw_codes[ca.KWARG]
        got = ALL_ATTENTION_FUNCTIONS["sdpa"](None, query, k_codes, v_codes, None, scaling=DIM**-0.5, **kw_codes)[0]
        assert torch.equal(got, paged.attend(query, DIM**-0.5))
        worst = max(worst, float((got - expected).abs().max()))
    assert worst < 2e-5, worst


def test_a_request_spanning_many_pages_split_over_column_ranges_equals_one_range():
    driver = Driver(_cache("fp8_e4m3", None, "codes", page_size=4, num_blocks=512))
    gen = torch.Generator().manual_seed(1)
    for batch in ([("a", 200), ("b", 90)], [("a", 1), ("b", 1)]):
        n = sum(new for _, new in batch)
        keys, values = (torch.randn(1, KV_HEADS, n, DIM, generator=gen) for _ in range(2))
        kwargs, _, _ = driver.forward(batch, keys, values)
    paged = kwargs[ca.KWARG]
    query = torch.randn(1, HEADS, 2, DIM, generator=gen)
    one, split = paged.attend(query, DIM**-0.5), paged.attend(query, DIM**-0.5, split_columns=16)
    assert (one - split).abs().max() < 1e-5
    assert one.abs().sum() > 0


def test_unmarked_calls_go_to_transformers_attention():
    ca.install()
    fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert getattr(fn, "_hf_kvcache_batch_attention", False)
    ca.install()  # idempotent: never wrapped twice
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is fn
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = fn(module, q, k, v, None, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert torch.equal(got, expected)


def test_default_path_and_what_cannot_read_the_codes():
    assert _cache("fp8_e4m3", None, "auto").attention_path == "codes"
    # power-of-two scales would be read as float32 copies of every page's scales: auto gathers instead ...
    assert _cache("fp8_e4m3", {"scale_dtype": "e8m0"}, "auto").attention_path == "dequantize"
    # ... and asking for the codes says why not, naming the field
    with pytest.raises(ValueError, match=r"kv_cache_quantization\.attention.*e8m0"):
        _cache("fp8_e4m3", {"scale_dtype": "e8m0"}, "codes")
    with pytest.raises(ValueError, match=r"kv_cache_quantization\.attention.*\('auto', 'codes', 'dequantize'\)"):
        _cache("fp8_e4m3", None, "fast")


# transformers' paged attention functions drop what the kernel applies: sdpa ignores GPT-OSS's sinks (`s_aux`), and
# neither sdpa (which raises) nor paged|eager applies Gemma 2's logit softcap; compared under paged|eager without it
EAGER = {"gpt_oss", "gemma2"}
DIFFERENT = {"gemma2": "transformers' paged|eager ignores attn_logit_softcapping; the kernel applies it"}


def _generate(model, prompts, attention, force=None):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hf_kvcache.evaluation.agreement import record_logits

    cb = ContinuousBatchingConfig(
        num_blocks=32, page_size=8, max_batch_tokens=64, allow_block_sharing=False, max_memory_percent=0.9
    )
    cb.kv_cache_dtype, cb.kv_cache_quantization = "fp8_e4m3", {"attention": attention}
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    try:
        with record_logits(model, force) as rec:
            out = model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=cb, warmup=False)
    except ValueError as error:  # a layer type continuous batching has no pages for
        return {}, None, [error]
    errors = [o.error for o in out.values() if o.error]
    return {rid: o.generated_tokens for rid, o in out.items()}, rec, errors


@pytest.mark.parametrize("arch", sorted(model_zoo.ZOO))
def test_every_architecture_attends_from_the_codes_as_the_dequantize_path(arch):
    """generate_batch with FP8 pages, teacher-forced: the codes path's log-probabilities equal the dequantize path's
    (float32 tiny models); models whose attention uses the cache's rows otherwise take the dequantize path."""
    model = model_zoo.ZOO[arch]()
    model.config._attn_implementation = "paged|eager" if arch in EAGER else "sdpa"
    prompts = [[3 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate((5, 17, 30, 9))]
    tokens, ref, errors = _generate(model, prompts, "dequantize")
    if not errors and not (tokens and all(tokens.values())):  # (a processor that failed to start: empty outputs)
        errors = ["no tokens generated"]
    if errors:
        pytest.skip(f"transformers' continuous batching does not run {arch}: {str(errors[0]).splitlines()[0][:120]}")
    reason = attention_takes_cache_rows(model.config)
    force = {rid: dict(enumerate(t)) for rid, t in tokens.items()}
    got, rec, errors = _generate(model, prompts, "auto", force)
    assert not errors and got == tokens
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    if reason is not None:  # auto took the dequantize path: the same computation
        assert all(torch.equal(rec.logprobs()[r], ref.logprobs()[r]) for r in tokens)
        return
    worst = max(float((rec.logprobs()[r] - ref.logprobs()[r]).abs().max()) for r in tokens)
    if arch in DIFFERENT:
        assert worst > 1e-3, DIFFERENT[arch]
    else:
        assert worst < 1e-4, worst


# -- the Triton kernel (CUDA's), under Triton's CPU interpreter -------------------------------------------------------
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETED, reason="runs in the subprocess of test_triton_paged_kernel_under_the_interpreter")
@pytest.mark.parametrize("kv_dtype, options", FORMATS)
def test_triton_paged_kernel_equals_the_dequantize_path(kv_dtype, options):
    worst = 0.0
    for gen, query, kw_codes, _, _, expected in _forwards(kv_dtype, options):
        paged = kw_codes[ca.KWARG]
        sinks = torch.randn(HEADS, generator=gen)
        got = paged.attend(query, DIM**-0.5, backend="triton")
        worst = max(worst, float((got - expected).abs().max()))
        # sinks and softcap: as the native kernel applies them
        native = paged.attend(query, DIM**-0.5, softcap=2.0, sinks=sinks, backend="native")
        triton_out = paged.attend(query, DIM**-0.5, softcap=2.0, sinks=sinks, backend="triton")
        worst = max(worst, float((native - triton_out).abs().max()))
    assert worst < 2e-5, worst


def test_triton_paged_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("already under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", __file__, "-k", "triton_paged_kernel_equals"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(FORMATS)} passed" in proc.stdout, proc.stdout[-2000:]
