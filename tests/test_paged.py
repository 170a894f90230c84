"""Quantized pages for transformers' continuous batching (hf_kvcache.paged, issue 15).

- generate_batch with FP8 / INT8 pages equals the same requests run one by one through QuantizedFP8Cache with the
  same quantizer and key rotation (Hadamard by default for FP8, none), teacher-forced on the same tokens (float32
  tiny model: within float rounding);
- a request's first forward attends its own tokens unquantized, later reads see the codes (cache.update directly);
- hybrid models (sliding + full layers) run with quantized sliding and full pages;
- page accounting: every page is free again after each batch of a persistent manager, pages are reused, a request
  holds only the pages of its tokens; the benchmark's per-forward records (admission limit, memory-bound steady
  state: hf_kvcache.evaluation.concurrency);
- the memory budget holds more tokens with quantized pages (byte ratio), the block-table path is off with a clear
  error, bad configs name their field, and a changed transformers internal is reported by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_config, build_model, random_ids
from transformers import DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching.distributed import DistributedHelper

import hf_kvcache
from hf_kvcache import QuantizedFP8Cache
from hf_kvcache.evaluation.agreement import record_logits
from hf_kvcache.evaluation.concurrency import ADMISSION_LIMITS, ForwardRecord, admission_limit, steady_state
from hf_kvcache.evaluation.divergence import cache_logprobs, divergence_metrics
from hf_kvcache.integration.continuous_batching import ALLOCATORS, CACHE_INIT, QUANTIZED_PAGES
from hf_kvcache.integration.contracts import problem, require
from hf_kvcache.paged import PagedKVSpec, QuantizedPagedAttentionCache, UnsupportedTransformersError
from hf_kvcache.paged.cache import first_forward_masks
from hf_kvcache.paged.spec import DEFAULT_KEY_ROTATION
from hf_kvcache.stores.factory import make_codec
from hf_kvcache.stores.quantization import QuantSpec
from hf_kvcache.stores.workspace import TransientWorkspace

PROMPT_LENGTHS = (5, 17, 30, 9)
NEW_TOKENS = 10


def _prompts():
    return [random_ids(1, n, seed=n)[0].tolist() for n in PROMPT_LENGTHS]


def _cb(kv_dtype=None, options=None, **kwargs):
    settings = dict(num_blocks=16, page_size=8, max_batch_tokens=128, allow_block_sharing=False, max_memory_percent=0.9)
    settings.update(kwargs)
    cb = ContinuousBatchingConfig(**settings)
    if kv_dtype is not None:
        cb.kv_cache_dtype = kv_dtype
        cb.kv_cache_quantization = options
    return cb


GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)


def _run(model, prompts, cb, force=None, **kwargs):
    with record_logits(model, force) as rec:
        out = model.generate_batch(
            prompts, generation_config=GREEDY, continuous_batching_config=cb, warmup=False, **kwargs
        )
    assert all(o.error is None for o in out.values()), [o.error for o in out.values()]
    return {rid: o.generated_tokens for rid, o in out.items()}, rec


@pytest.fixture(scope="module")
def llama_reference():
    """The tiny Llama, its prompts, and a model-dtype paged run of them (tokens, recorder): shared by the tests
    that compare against it (a generate_batch call costs seconds of manager start/stop)."""
    model = build_model("llama")
    prompts = _prompts()
    tokens, rec = _run(model, prompts, _cb())
    return model, prompts, tokens, rec


@pytest.mark.parametrize(
    "kv_dtype, options, reference",
    [
        # like with like: default FP8 pages (Hadamard keys) vs QuantizedFP8Cache's default (Hadamard keys), ...
        ("fp8_e4m3", None, dict(format="fp8_e4m3")),
        # ... unrotated pages vs the unrotated cache
        ("fp8_e4m3", {"key_rotation": "none"}, dict(format="fp8_e4m3", key_rotation="none")),
        (
            "int8",
            {"group_size": 8},
            dict(
                key={"format": "int8", "granularity": "token", "group_size": 8, "scale_dtype": "bfloat16"},
                value={"format": "int8", "granularity": "token", "group_size": 8, "scale_dtype": "bfloat16"},
                key_rotation=DEFAULT_KEY_ROTATION["int8"],
            ),
        ),
    ],
)
def test_quantized_pages_match_quantized_fp8_cache_one_by_one(llama_reference, kv_dtype, options, reference):
    model, prompts, ref_tokens, ref_rec = llama_reference
    force = {rid: dict(enumerate(t)) for rid, t in ref_tokens.items()}
    tokens, rec = _run(model, prompts, _cb(kv_dtype, options), force)
    assert tokens == ref_tokens  # teacher-forced: same positions
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    paged, full = rec.logprobs(), ref_rec.logprobs()
    worst, kl_paged = 0.0, []
    # the same weights in another object: our cache switches its model to the hf_kvcache attention bridge (the shared
    # model stays on sdpa for the other tests)
    twin = build_model("llama")
    for i, rid in enumerate(sorted(tokens, key=lambda r: int(r.split("_")[1]))):
        ids = torch.tensor(prompts[i] + tokens[rid])
        cache = QuantizedFP8Cache(twin, attention="dequantize", **reference)
        one_by_one = cache_logprobs(twin, ids, cache, len(prompts[i]))[:NEW_TOKENS]
        worst = max(worst, float((paged[rid] - one_by_one).abs().max()))
        kl_paged.append(divergence_metrics(full[rid], paged[rid])["kl_mean"])
    assert worst < 1e-4, worst
    assert max(kl_paged) > 0  # the pages really are quantized (the runs are not the same computation)


def test_first_forward_attends_unquantized_then_reads_codes():
    config = build_config("llama")
    # compared with the codec alone; the dequantize path returns the keys attention reads
    cb = _cb("fp8_e4m3", {"key_rotation": "none", "attention": "dequantize"}, num_blocks=8, page_size=4)
    cache = QuantizedPagedAttentionCache(config, cb, "cpu", DistributedHelper(None, None), torch.float32)
    allocator = cache.cache_allocators["full_attention"]
    heads, dim = 2, 16
    gen = torch.Generator().manual_seed(0)

    def step(batch):  # batch: [(request_id, past, new keys [n, H, D])] -> keys returned by cache.update
        read, write, cu_q, cu_k = [[]], [[]], [0], [0]
        for rid, past, new in batch:
            assert (
                allocator.needs_new_blocks(rid, past, new.shape[0]) <= cache.pool.count_free_blocks(0)
                or cache.pool.num_free_sectors > 0
            )
            for _ in range(allocator.needs_new_sectors(rid, past, new.shape[0])):
                cache.pool.allocate_sector(allocator.index)
            allocator.allocate_cache_to_request(rid, past, new.shape[0])
            cache.extend_read_and_write_indices(rid, past, new.shape[0], read, write)
            cu_q.append(cu_q[-1] + new.shape[0])
            cu_k.append(cu_k[-1] + past + new.shape[0])
        keys = torch.cat([new for _, _, new in batch]).transpose(0, 1).unsqueeze(0)
        kwargs = {
            "read_index": [torch.tensor(read[0])],
            "write_index": [torch.tensor(write[0])],
            "cu_seq_lens_q": torch.tensor(cu_q),
            "cu_seq_lens_k": {"full_attention": torch.tensor(cu_k)},
            "max_length_k": {"full_attention": max(cu_k)},
        }
        k, _ = cache.update(keys, keys.clone(), 0, kwargs)
        return k[0].transpose(0, 1)  # [read tokens, H, D]

    def fp8_roundtrip(x):  # the codec alone: [n, H, D] -> quantized and back
        codec = make_codec(QuantSpec("fp8_e4m3", "token"))
        codec.allocate(1, heads, dim, x.shape[0], torch.float32, "cpu")
        codec.put(codec.encode(x.transpose(0, 1).unsqueeze(0)), start=0)
        out = torch.empty(1, heads, x.shape[0], dim)
        codec.decode_into(out, x.shape[0], TransientWorkspace())
        return out[0].transpose(0, 1)

    a0 = torch.randn(6, heads, dim, generator=gen)
    got = step([("a", 0, a0)])
    assert torch.equal(got, a0)  # first forward: its own tokens, unquantized
    a1, b0 = torch.randn(1, heads, dim, generator=gen), torch.randn(5, heads, dim, generator=gen)
    got = step([("a", 6, a1), ("b", 0, b0)])  # a decodes while b's prompt arrives, in one batch
    expected_a = fp8_roundtrip(torch.cat([a0, a1]))
    assert torch.equal(got[:7], expected_a)  # a's past and new token read back from the codes
    assert not torch.equal(got[:7], torch.cat([a0, a1]))
    assert torch.equal(got[7:], b0)  # b's first forward: unquantized
    got = step([("b", 5, torch.randn(1, heads, dim, generator=gen))])
    assert torch.equal(got[:5], fp8_roundtrip(b0))
    for rid in ("a", "b"):
        cache.free_blocks(rid)
    assert cache.compute_free_capacity() == 1.0


def test_first_forward_masks_pack_requests_in_order():
    # three requests: prefill of 3 (no past), decode of 1 (past 4), prefill of 2; then 2 padding positions
    cu_q, cu_k = torch.tensor([0, 3, 4, 6]), torch.tensor([0, 3, 8, 10])
    read_mask, new_mask = first_forward_masks(cu_q, cu_k, 12, 8)
    assert read_mask.tolist() == [True] * 3 + [False] * 5 + [True] * 2 + [False] * 2
    assert new_mask.tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2


def test_hybrid_model_sliding_and_full_layers_quantized():
    model = build_model(
        "qwen2",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        use_sliding_window=True,
        max_window_layers=0,
    )
    prompts = _prompts()
    ref_tokens, ref_rec = _run(model, prompts, _cb())
    force = {rid: dict(enumerate(t)) for rid, t in ref_tokens.items()}
    cb = _cb("fp8_e4m3")
    with record_logits(model, force) as rec:
        out = model.generate_batch(prompts, generation_config=GREEDY, continuous_batching_config=cb, warmup=False)
        cache = rec.manager.batch_processor.cache if rec.manager.batch_processor is not None else None
    assert {rid: o.generated_tokens for rid, o in out.items()} == ref_tokens
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    assert max(len(p) for p in prompts) + NEW_TOKENS > 8  # requests outgrow the window: the ring buffer wraps
    full, paged = ref_rec.logprobs(), rec.logprobs()
    ref = torch.cat([full[r] for r in sorted(full)])
    got = torch.cat([paged[r] for r in sorted(full)])
    metrics = divergence_metrics(ref, got)
    assert 0 < metrics["kl_mean"] < 0.05, metrics
    assert metrics["top1_agreement"] >= 0.9, metrics
    del cache


def test_hybrid_allocators_are_quantized():
    config = build_config(
        "qwen2",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        use_sliding_window=True,
        max_window_layers=0,
    )
    cache = QuantizedPagedAttentionCache(
        config, _cb("int8", {"group_size": 8}), "cpu", DistributedHelper(None, None), torch.float32
    )
    names = {name: type(a).__name__ for name, a in cache.cache_allocators.items()}
    assert names == {
        "sliding_attention": "QuantizedSlidingAttentionCacheAllocator",
        "full_attention": "QuantizedFullAttentionCacheAllocator",
    }
    # the module-level mapping transformers builds from is back to its own classes
    assert cb_cache.ATTN_TYPE_TO_ALLOCATOR["full_attention"].__name__ == "FullAttentionCacheAllocator"


def test_pages_in_use_return_to_zero_after_every_batch_and_are_reused():
    model = build_model("llama")
    prompts = _prompts()
    cb = _cb("fp8_e4m3", num_blocks=2)  # tight (8 FP8 pages; prompts alone need 10): requests wait for pages
    caches, peaks = [], []
    try:
        for _ in range(2):
            with record_logits(model) as rec:
                out = model.generate_batch(
                    prompts,
                    generation_config=GREEDY,
                    continuous_batching_config=cb,
                    warmup=False,
                    persistent_manager=True,
                )
                cache = model._cached_continuous_batching_manager.batch_processor.cache
            assert all(o.error is None and len(o.generated_tokens) == NEW_TOKENS for o in out.values())
            caches.append(cache)
            peaks.append(max(rec.bytes_in_use))
            assert cache.compute_free_capacity() == 1.0  # every page free again
            for allocator in cache.cache_allocators.values():
                assert allocator.block_table == {}
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert caches[0] is caches[1]  # the second batch reused the same pages
    assert min(peaks) > 0
    assert max(rec.resident) < len(prompts)  # the budget was binding: pages were freed and reused within a batch


def test_requests_hold_only_the_pages_of_their_tokens_and_memory_limits_admission():
    """No page reserved ahead, none kept by a finished request: at every forward each request of the batch holds
    ceil(tokens stored after the forward / page size) pages, the recorder's pages in use are the block tables', and
    with a tight budget the recorder sees memory refuse waiting requests; every page is free at the end."""
    model = build_model("llama")
    prompts = _prompts()
    cb = _cb("fp8_e4m3", num_blocks=2)  # 8 FP8 pages of 8 tokens: requests wait for pages
    checked, mismatches, caches = [], [], set()

    def check_pages(module, args, output):
        processor = rec.manager.batch_processor
        caches.add(processor.cache)
        allocator = processor.cache.cache_allocators["full_attention"]
        for future in processor.inputs_and_outputs.requests_in_batch:
            state = future.state
            stored = state.position_offset  # already past + this forward's query when the model runs
            held = len(allocator.block_table[state.request_id])
            checked.append(state.request_id)
            if held != -(-stored // allocator.tokens_per_page):
                mismatches.append((state.request_id, stored, held))
        assert sum(len(b) for b in allocator.block_table.values()) == rec.steps[-1].pages_in_use

    with record_logits(model) as rec:
        handle = model.register_forward_hook(check_pages)
        try:
            out = model.generate_batch(prompts, generation_config=GREEDY, continuous_batching_config=cb, warmup=False)
        finally:
            handle.remove()
    (cache,) = caches
    assert all(o.error is None and len(o.generated_tokens) == NEW_TOKENS for o in out.values())
    assert set(checked) == set(out) and not mismatches, mismatches
    assert len(rec.steps) == len(rec.batch_sizes) > 0
    assert {s.admission_limit for s in rec.steps} <= set(ADMISSION_LIMITS)
    assert "memory" in {s.admission_limit for s in rec.steps}  # the tight budget refused waiting requests
    assert max(s.pages_in_use for s in rec.steps) <= cache.num_blocks
    assert cache.compute_free_capacity() == 1.0 and cache.cache_allocators["full_attention"].block_table == {}


@pytest.mark.parametrize(
    "waiting, tokens, requests, expected",
    [
        (0, 10, 2, "no waiting request"),
        (3, 64, 5, "batch tokens"),
        (3, 20, 8, "requests per batch"),
        (3, 20, 5, "memory"),
    ],
)
def test_admission_limit_names_what_stopped_admission(waiting, tokens, requests, expected):
    assert admission_limit(waiting, tokens, 64, requests, 8) == expected


def _forward(resident, waiting, limit, pages_each=2):
    return ForwardRecord(
        resident=frozenset(resident),
        pages_in_use=pages_each * len(resident),
        waiting_requests=waiting,
        batch_requests=len(resident),
        batch_tokens=len(resident),
        admission_limit=limit,
    )


def test_steady_state_starts_when_the_fill_has_left_and_ends_with_the_queue():
    fill = _forward("abc", 5, "memory")  # first refusal: a, b, c resident (the fill)
    records = [
        _forward("ab", 7, "batch tokens"),
        fill,
        _forward("bcd", 4, "memory"),  # c and b of the fill still resident: warm-up
        _forward("cde", 4, "memory"),
        _forward("def", 3, "memory", pages_each=3),  # the fill has left: steady state from here
        _forward("efgh", 1, "batch tokens"),
        _forward("fgh", 1, "memory", pages_each=3),
        _forward("gh", 0, "no waiting request"),  # queue empty: the drain
    ]
    steady = steady_state(records)
    assert steady["measured"] and steady["reason"] is None
    assert (steady["first_memory_bound_forward"], steady["start_forward"], steady["end_forward"]) == (1, 4, 6)
    assert steady["forwards"] == 3 and steady["memory_bound_forwards"] == 2
    assert steady["memory_bound_share"] == pytest.approx(2 / 3)
    assert steady["mean_concurrent_requests"] == 3 and steady["peak_concurrent_requests"] == 3
    assert steady["pages_per_request"] == 3


def test_steady_state_is_not_measured_when_the_queue_runs_dry_or_memory_never_refuses():
    dry = [
        _forward("abc", 2, "memory"),
        _forward("bcd", 0, "no waiting request"),
        _forward("d", 0, "no waiting request"),
    ]
    steady = steady_state(dry)
    assert not steady["measured"] and "queue ran dry" in steady["reason"]
    token_bound = [_forward("ab", 3, "batch tokens"), _forward("c", 0, "no waiting request")]
    steady = steady_state(token_bound)
    assert not steady["measured"] and "memory never refused" in steady["reason"]


def test_memory_budget_holds_more_tokens_with_quantized_pages():
    config = build_config("llama", head_dim=64, num_attention_heads=4, hidden_size=256)
    helper = DistributedHelper(None, None)
    model_pages = cb_cache.PagedAttentionCache(config, _cb(num_blocks=64), "cpu", helper, torch.bfloat16)
    fp8 = QuantizedPagedAttentionCache(config, _cb("fp8_e4m3", num_blocks=64), "cpu", helper, torch.bfloat16)
    int4 = QuantizedPagedAttentionCache(
        config, _cb("int4", {"group_size": 32}, num_blocks=64), "cpu", helper, torch.bfloat16
    )
    same = abs(fp8.cache_tensor.nbytes - model_pages.cache_tensor.nbytes)
    assert same <= 2 * fp8.bytes_per_sector  # the same memory (to a sector's rounding)...
    ratio = fp8.num_blocks / model_pages.num_blocks
    assert ratio >= 1.9, ratio  # ...holds 1.9x the tokens: 2 * 64 bf16 bytes vs 64 codes + a 2-byte scale per head
    assert int4.num_blocks / model_pages.num_blocks >= 3.0
    assert fp8.tokens_capacity() == fp8.num_blocks * 8


def test_block_table_path_is_off_with_a_clear_error():
    config = build_config("llama")
    cache = QuantizedPagedAttentionCache(
        config, _cb("fp8_e4m3", max_blocks_per_request=8), "cpu", DistributedHelper(None, None), torch.float32
    )
    assert cache.max_decode_fast_path_length == 0  # transformers never takes the block-table path with these pages
    with pytest.raises(NotImplementedError, match="block-table path.*flash"):
        cache.cache_allocators["full_attention"].get_cache_for_block_table(0)
    plain = QuantizedPagedAttentionCache(
        config, _cb(max_blocks_per_request=8), "cpu", DistributedHelper(None, None), torch.float32
    )
    assert plain.max_decode_fast_path_length > 0  # without kv_cache_dtype: transformers' own cache


@pytest.mark.parametrize(
    "kv_dtype, options, match",
    [
        ("fp4", None, r"`kv_cache_dtype` must be one of .*'fp8_e4m3'"),
        ("fp8_e4m3", {"groups": 8}, r"`kv_cache_quantization` has unknown keys \['groups'\]"),
        ("fp8_e4m3", {"granularity": "head"}, r"`kv_cache_quantization.granularity` must be one of \('token',\)"),
        ("fp8_e4m3", {"group_size": 0}, r"`kv_cache_quantization.group_size` must be a positive integer"),
        ("fp8_e4m3", {"key_rotation": "qr"}, r"`kv_cache_quantization.key_rotation` must be one of"),
        ("fp8_e4m3", {"scale_dtype": "int8"}, r"`kv_cache_quantization`: .*scale_dtype"),
        ("fp8_e4m3", "group_size=8", r"`kv_cache_quantization` must be a dict"),
        ("model", {"group_size": 8}, r"`kv_cache_quantization` .* `kv_cache_dtype` is 'model'"),
        ("fp8_e4m3", {"group_size": 12}, r"`kv_cache_quantization`: `group_size` \(12\) must divide .*head_dim \(16\)"),
    ],
)
def test_bad_configs_name_the_field(kv_dtype, options, match):
    config = build_config("llama")
    with pytest.raises(ValueError, match=match):
        QuantizedPagedAttentionCache(
            config, _cb(kv_dtype, options), "cpu", DistributedHelper(None, None), torch.float32
        )


def test_enable_paged_switches_a_model_and_back():
    model = build_model("llama")
    with pytest.raises(ValueError, match="`kv_cache_dtype` must be one of"):
        hf_kvcache.enable_paged(model, kv_dtype="fp9")
    hf_kvcache.enable_paged(model, kv_dtype="fp8_e4m3")
    cb = ContinuousBatchingConfig(num_blocks=16, page_size=8)
    with record_logits(model) as rec:
        model.generate_batch(_prompts()[:2], generation_config=GREEDY, continuous_batching_config=cb, warmup=False)
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    fp8_bytes = rec.cache_facts["bytes_per_token_per_layer"]
    assert fp8_bytes == 2 * (2 * 16 + 2 * 2)  # per token and layer: keys and values, 2 heads of codes + scales
    assert not hasattr(cb, "kv_cache_dtype")  # the caller's config is not modified
    hf_kvcache.enable_paged(model, kv_dtype=None)  # off: transformers' own method again
    assert "init_continuous_batching" not in vars(model)


def test_transformers_internals_relied_on_are_present_and_checked(monkeypatch):
    from hf_kvcache.integration import contracts

    require(*QUANTIZED_PAGES)  # this transformers has them all
    monkeypatch.setattr(contracts, "_results", {})  # checked afresh below (results are cached per process)
    monkeypatch.delattr(cb_cache, "ATTN_TYPE_TO_ALLOCATOR")
    with pytest.raises(UnsupportedTransformersError, match="ATTN_TYPE_TO_ALLOCATOR"):
        require(*QUANTIZED_PAGES)
    assert "ATTN_TYPE_TO_ALLOCATOR" in problem(CACHE_INIT)
    monkeypatch.undo()
    monkeypatch.setattr(contracts, "_results", {})
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    monkeypatch.setattr(FullAttentionCacheAllocator, "rows_per_token", 1)
    with pytest.raises(UnsupportedTransformersError, match="FullAttentionCacheAllocator.rows_per_token"):
        require(*QUANTIZED_PAGES)
    assert "rows_per_token" in problem(ALLOCATORS)


def test_spec_round_trip_and_defaults():
    spec = PagedKVSpec.from_fields("int8", {"key_rotation": "hadamard"})
    assert spec.quant_spec(64).group_size == 32 and spec.quant_spec(16).group_size is None
    assert (
        PagedKVSpec.from_fields(
            kv_dtype=spec.kv_dtype, options={k: v for k, v in spec.to_dict().items() if k != "kv_dtype"}
        )
        == spec
    )
    assert PagedKVSpec.from_fields(None) is None and PagedKVSpec.from_fields("model") is None
    # key rotation defaults: Hadamard for FP8 (as QuantizedFP8Cache) and INT4, none for INT8 (measured, spec.py)
    assert [PagedKVSpec.from_fields(d).key_rotation for d in ("fp8_e4m3", "fp8_e5m2", "int8", "int4")] == [
        "hadamard",
        "hadamard",
        "none",
        "hadamard",
    ]
    assert PagedKVSpec.from_fields("fp8_e4m3", {"key_rotation": "none"}).key_rotation == "none"
    allocator = QuantizedPagedAttentionCache(
        build_config("llama"), _cb("fp8_e4m3"), "cpu", DistributedHelper(None, None), torch.float32
    ).cache_allocators["full_attention"]
    eye = torch.eye(allocator.key_rotation.shape[0])
    assert torch.allclose(allocator.key_rotation @ allocator.key_rotation.T, eye, atol=1e-6)  # orthogonal...
    assert not torch.allclose(allocator.key_rotation, eye)  # ...and not the identity: keys really are rotated


def test_reference_runs_agree_with_dynamic_cache(llama_reference):
    # the recorder maps logits rows to requests correctly: model-dtype pages == DynamicCache, teacher-forced
    model, prompts, tokens, rec = llama_reference
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"  # installed, but transformers' pages
    assert rec.cache_facts["bytes_per_token_per_layer"] == 2 * 2 * 16 * 4
    rows = rec.logprobs()
    for i, rid in enumerate(sorted(tokens, key=lambda r: int(r.split("_")[1]))):
        ids = torch.tensor(prompts[i] + tokens[rid])
        ref = cache_logprobs(model, ids, DynamicCache(config=model.config), len(prompts[i]))[:NEW_TOKENS]
        assert float((rows[rid] - ref).abs().max()) < 1e-4


def test_serve_bench_settings_and_cli_errors_name_the_option():
    from hf_kvcache.cli import build_parser, main
    from hf_kvcache.evaluation.serve_bench import ServeBenchSettings, parse_format

    args = build_parser().parse_args(["serve-bench", "--requests", "3", "--formats", "model,fp8_e4m3:hadamard"])
    assert args.requests == 3 and args.formats == "model,fp8_e4m3:hadamard"
    assert parse_format("fp8_e4m3:hadamard") == ("fp8_e4m3", {"key_rotation": "hadamard"})
    with pytest.raises(ValueError, match="`formats` must start with 'model'"):
        ServeBenchSettings(formats=("fp8_e4m3", "model"))
    with pytest.raises(ValueError, match="page dtype must be one of"):
        ServeBenchSettings(formats=("model", "fp6"))
    with pytest.raises(ValueError, match="`budget_scales` must be positive and include 1.0"):
        ServeBenchSettings(budget_scales=(0.5, 2.0))
    with pytest.raises(ValueError, match=r"whole multiples of `page_size` \(16\) tokens: 100 x 1.0 = 100"):
        ServeBenchSettings(budget_tokens=100, budget_scales=(1.0,))
    with pytest.raises(ValueError, match=r"whole multiples of `page_size` \(16\) tokens: 64 x 0.1 = 6.4"):
        ServeBenchSettings(budget_tokens=64, budget_scales=(0.1, 1.0))
    with pytest.raises(ValueError, match=r"`prompt_min` \(9\) must be <= `prompt_max` \(8\)"):
        ServeBenchSettings(prompt_min=9, prompt_max=8)
    assert main(["serve-bench", "--prompt-lengths", "12"]) == 2  # MIN-MAX expected: a clear error, exit code 2


def test_install_on_a_changed_transformers_leaves_it_untouched_and_quantized_pages_raise(monkeypatch):
    """No silent fallback: where an internal changed, `import hf_kvcache` leaves continuous batching as it is, and
    asking for quantized pages raises naming the internal (tests/test_upstream_contracts.py fakes each contract)."""
    from transformers.generation.continuous_batching import continuous_api

    from hf_kvcache.integration import contracts
    from hf_kvcache.paged import cache as paged_cache

    monkeypatch.setattr(contracts, "_results", {})
    monkeypatch.setattr(continuous_api, "PagedAttentionCache", cb_cache.PagedAttentionCache)
    monkeypatch.setattr(cb_cache, "ATTN_TYPE_TO_ALLOCATOR", None)
    assert paged_cache.install(strict=False) is False
    assert continuous_api.PagedAttentionCache is cb_cache.PagedAttentionCache  # untouched
    with pytest.raises(UnsupportedTransformersError, match="ATTN_TYPE_TO_ALLOCATOR"):
        hf_kvcache.enable_paged(build_model("llama"), kv_dtype="fp8_e4m3")
    with pytest.raises(UnsupportedTransformersError, match="ATTN_TYPE_TO_ALLOCATOR"):
        build_model("llama").generate_batch(
            [[2, 3, 4]], generation_config=GREEDY, continuous_batching_config=_cb("fp8_e4m3"), warmup=False
        )


def test_continuous_batching_after_our_caches_switched_the_model_to_the_bridge():
    """generate with one of our caches switches the model to the attention bridge; continuous batching accepts only
    its own implementations, so `generate_batch` hands the model back to sdpa first (same tokens as a model that
    never ran our caches), and the next generate with our cache switches it again."""
    prompts = _prompts()
    reference, _ = _run(build_model("llama"), prompts, _cb())
    model = build_model("llama")
    ids = torch.tensor([prompts[1]])
    first = model.generate(
        ids,
        **hf_kvcache.cache_kwargs(hf_kvcache.SinkCache(model, sinks=2, window=8)),
        max_new_tokens=4,
        do_sample=False,
    )
    assert model.config._attn_implementation == "hf_kvcache_sdpa"
    tokens, _ = _run(model, prompts, _cb())
    assert tokens == reference
    assert model.config._attn_implementation == "sdpa"
    again = model.generate(
        ids,
        **hf_kvcache.cache_kwargs(hf_kvcache.SinkCache(model, sinks=2, window=8)),
        max_new_tokens=4,
        do_sample=False,
    )
    assert model.config._attn_implementation == "hf_kvcache_sdpa"
    assert torch.equal(again, first)
