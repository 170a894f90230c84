"""Pages of one (layer, KV head) (`kv_compress` layout "head", hf_kvcache.paged.head_pages, issue 60).

- uncompressed, head pages generate what transformers' pages generate, token for token (model dtype and FP8);
- compressed, generate_batch equals an independent reference that keeps every prompt token in a DynamicCache and masks,
  per (layer, KV head), the positions that head evicted (float32 tiny Llama, greedy, prompts prefilled in chunks
  beside other requests), for every method; positions are the original ones because nothing moves there;
- a request holds exactly the sum over (layer, head) of its pages, every page is free after the batch, and the
  allotment keeps the budget on average with per-head and per-layer counts that differ;
- the attention paths agree (native kernel, PyTorch loop; Triton under TRITON_INTERPRET=1 where installed);
- errors name the field.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import build_model, planted_surrogate, random_ids
from transformers import DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_kvcache  # noqa: F401  (installs the paged cache)
from hf_kvcache.evaluation import eviction_reference
from hf_kvcache.integration.attention_inputs import capture_attention_inputs
from hf_kvcache.integration.cache_argument import cache_kwargs
from hf_kvcache.integration.continuous_batching import update_caller
from hf_kvcache.paged import codes_attention, eviction, head_attention, head_pages
from hf_kvcache.paged.compress_spec import CompressSpec, parse
from hf_kvcache.paged.head_allotment import kept_positions_per_head
from hf_kvcache.paged.prompt_scores import prompt_scorer
from hf_kvcache.scorers.base import Prompt

PROMPT_LENGTHS = (40, 67, 23, 90)
NEW_TOKENS = 8
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
REFERENCE = eviction_reference.HEAD_MASKED


#: why head pages cannot run on this transformers (None: they can; transformers 5.23 updates paged caches inside its
#: attention functions, so no attention function of ours reads the pages)
UNREADABLE = codes_attention.unreadable_pages()
needs_readable_pages = pytest.mark.skipif(UNREADABLE is not None, reason=f"head pages refused here: {UNREADABLE}")


def _prompts():
    return [random_ids(1, n, seed=n)[0].tolist() for n in PROMPT_LENGTHS]


def _cb(compress=None, kv_dtype=None, layout="head", **kwargs):
    settings = dict(num_blocks=48, page_size=8, max_batch_tokens=32, allow_block_sharing=False, max_memory_percent=0.9)
    settings.update(kwargs)
    cb = ContinuousBatchingConfig(**settings)
    if compress is not None:
        cb.kv_compress = compress
        cb.kv_compress_layout = layout
    if kv_dtype is not None:
        cb.kv_cache_dtype = kv_dtype
    return cb


def _generate(model, prompts, cb):
    out = model.generate_batch(prompts, generation_config=GREEDY, continuous_batching_config=cb, warmup=False)
    assert all(o.error is None for o in out.values()), [o.error for o in out.values()]
    return [o.generated_tokens for _, o in sorted(out.items(), key=lambda item: int(item[0].split("_")[-1]))]


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


@pytest.fixture(scope="module")
def surrogate_dir(tmp_path_factory, model):
    directory = tmp_path_factory.mktemp("surrogate")
    planted_surrogate(model).save(directory)
    return str(directory)


def _snapkv_scores(model, prompt: list[int], spec: CompressSpec) -> tuple[list[torch.Tensor], object]:
    """SnapKV's per-head scores [Hkv, P] per layer from a DynamicCache prefill (its queries rebuilt for Llama), and
    the prefill's (cache, logits)."""
    ids = torch.tensor([prompt])
    hidden, cache = {}, DynamicCache()
    with torch.no_grad(), capture_attention_inputs(model, lambda i, h: hidden.__setitem__(i, h.clone())):
        logits = model(ids, **cache_kwargs(cache)).logits
    length = len(prompt)
    cos, sin = model.model.rotary_emb(hidden[0], torch.arange(length)[None])
    scores = []
    for i, layer in enumerate(cache.layers):
        attention = model.model.layers[i].self_attn
        query = attention.q_proj(hidden[i]).view(1, length, -1, attention.head_dim).transpose(1, 2)
        query, _ = apply_rotary_pos_emb(query, query, cos, sin)
        window = query[0, :, -spec.options.get("window", 64) :]
        prompt_ = Prompt(keys=layer.keys[0], queries=window, scaling=attention.scaling)
        scores.append(prompt_scorer(spec, i).score(prompt_).float())
    return scores, (cache, logits)


def _snapkv_reference(model, prompt: list[int], spec: CompressSpec) -> list[int]:
    """SnapKV through the library's reference (eviction_reference.generate_with_head_eviction: each (layer, head)
    attends only to the prompt positions it keeps, masked), its queries rebuilt for Llama."""
    eviction_reference._register_head_masked()
    scores, (cache, logits) = _snapkv_scores(model, prompt, spec)
    heads = scores[0].shape[0]
    kept = kept_positions_per_head(spec, scores)
    masks = eviction_reference._head_masks
    masks.clear()
    for layer in range(len(scores)):
        mask = torch.zeros(heads, len(prompt), dtype=torch.bool)
        for h in range(heads):
            mask[h, kept[layer * heads + h]] = True
        masks[layer] = mask
    token, tokens = int(logits[0, -1].argmax()), []
    tokens.append(token)
    saved = model.config._attn_implementation
    model.config._attn_implementation = REFERENCE
    try:
        with torch.no_grad():
            for step in range(NEW_TOKENS - 1):
                out = model(
                    torch.tensor([[token]]), **cache_kwargs(cache), position_ids=torch.tensor([[len(prompt) + step]])
                )
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
    finally:
        model.config._attn_implementation = saved
        masks.clear()
    return tokens


def _spec(method, surrogate_dir, **fields):
    options = {"window": 8} if method == "snapkv" else {}
    surrogate = surrogate_dir if method == "kvzap" else None
    return CompressSpec(method=method, budget=0.4, surrogate=surrogate, options=options, **fields)


def test_uncompressed_head_pages_generate_what_transformers_pages_do(model):
    prompts = _prompts()
    whole = {"method": "keydiff", "budget": 10_000}  # a budget no prompt reaches
    assert _generate(model, prompts, _cb(whole)) == _generate(model, prompts, _cb())
    assert _generate(model, prompts, _cb(whole, "fp8_e4m3")) == _generate(model, prompts, _cb(None, "fp8_e4m3"))


@pytest.mark.upstream
@needs_readable_pages
@pytest.mark.parametrize("method", ["keydiff", "knorm", "sink_window", "snapkv", "kvzap"])
def test_generate_batch_equals_masking_what_each_head_evicts(model, surrogate_dir, method):
    if method == "snapkv" and update_caller() != "model attention":
        pytest.skip("snapkv's queries come through the attention function after the cache's update (>= 5.24)")
    spec = _spec(method, surrogate_dir)
    prompts = _prompts()
    got = _generate(model, prompts, _cb(spec.to_dict()))
    if method == "snapkv":  # (its queries rebuilt for Llama)
        assert got == [_snapkv_reference(model, prompt, spec) for prompt in prompts]
    else:  # the library's reference (eval/ruler_http.py --through generate --kv-layout head)
        assert got == [eviction_reference.generate_with_head_eviction(model, p, spec, NEW_TOKENS) for p in prompts]
    if method != "sink_window":  # per head, the tokens kept differ from one score per token's
        token = CompressSpec(method=method, budget=0.4, surrogate=spec.surrogate, options=spec.options)
        assert got != _generate(model, prompts, _cb(token.to_dict(), layout="token"))


@pytest.mark.upstream
@needs_readable_pages
@pytest.mark.parametrize("method", ["keydiff", "knorm", "kvzap"])
def test_chunk_by_chunk_equals_masking_what_each_head_evicted(model, surrogate_dir, method):
    """Every 16 prompt tokens compressed, each head keeping its own: the same tokens as the chunked reference; the
    heads then hold different numbers of tokens while later chunks are scored."""
    spec = _spec(method, surrogate_dir, chunk=16)
    prompts = _prompts()
    got = _generate(model, prompts, _cb(spec.to_dict()))
    assert got == [eviction_reference.generate_with_head_eviction(model, p, spec, NEW_TOKENS) for p in prompts]
    assert got != _generate(model, prompts, _cb(_spec(method, surrogate_dir).to_dict()))


@pytest.mark.parametrize("allotment", [("uniform", "uniform"), ("adaptive", "uniform"), ("uniform", "adaptive")])
def test_every_allotment_equals_the_reference(model, surrogate_dir, allotment):
    spec = _spec("keydiff", surrogate_dir, layer_budget=allotment[0], head_budget=allotment[1])
    prompts = _prompts()
    expected = [eviction_reference.generate_with_head_eviction(model, p, spec, NEW_TOKENS) for p in prompts]
    assert _generate(model, prompts, _cb(spec.to_dict())) == expected


def test_fp8_head_pages_compress_and_free_every_page(model):
    prompts = _prompts()
    results, cache, held = _manager_run(model, prompts, _cb("knorm:budget=0.3", "fp8_e4m3"))
    assert all(r.error is None for r in results.values())
    assert cache.attention_path == "heads" and held["free_after"] == held["free_before"]


def _manager_run(model, prompts, cb):
    """Run `prompts` on a manager we can inspect: (outputs, the cache, the blocks each request held right after its
    prompt was compressed, against its streams' lengths, and the pool's free blocks before and after)."""
    seen = {}
    compress = eviction.PagedEviction._compress_heads

    def recording(self, state, info, held, kept):
        result = compress(self, state, info, held, kept)
        allocator = next(iter(self.cache.cache_allocators.values()))
        rid = state.request_id
        seen[rid] = (allocator.held_blocks(rid), allocator.lengths[rid], allocator.tokens_per_page, held, result[1])
        return result

    eviction.PagedEviction._compress_heads = recording
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=cb)
    manager.start()
    try:
        while manager.batch_processor is None:
            pass
        cache = manager.batch_processor.cache
        allocator = next(iter(cache.cache_allocators.values()))
        free_before = _free_blocks(allocator)
        ids = [manager.add_request(p, request_id=f"req_{i}", max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]
        results = {}
        while len(results) < len(ids):  # (in the order they finish)
            result = manager.get_result(timeout=120)
            assert result is not None, "a request did not finish"
            results[result.request_id] = result
    finally:
        manager.stop(block=True)
        eviction.PagedEviction._compress_heads = compress
    seen["free_before"] = free_before
    seen["free_after"] = _free_blocks(allocator)
    assert not any(allocator.block_table.values()) and not allocator.tables
    return results, cache, seen


def _free_blocks(allocator) -> int:
    pool = allocator.pool
    return pool.count_free_blocks(allocator.index) + pool.num_free_sectors * allocator.blocks_per_sector


def test_a_request_holds_the_sum_of_its_heads_pages(model):
    """Right after compression a request holds sum over (layer, head) of ceil(kept / page) blocks: never the largest
    head's count in every head; lengths differ across heads and layers; every page is free after the batch."""
    prompts = _prompts()
    spec = parse("keydiff:budget=0.3")
    results, cache, seen = _manager_run(model, prompts, _cb(spec.to_dict(), page_size=4, num_blocks=96))
    assert all(r.error is None for r in results.values())
    held_pages, widest_pages = 0, 0
    for i, n in enumerate(PROMPT_LENGTHS):
        blocks, lengths, page, held, kept = seen[f"req_{i}"]
        assert held == n and kept == spec.kept(n)
        assert blocks == sum(-(-k // page) for k in lengths)
        assert sum(lengths) == kept * len(lengths)  # the budget, on average over the streams
        assert len(set(lengths)) > 1  # per-head and per-layer budgets differ
        held_pages, widest_pages = held_pages + blocks, widest_pages + len(lengths) * -(-max(lengths) // page)
    assert held_pages < widest_pages
    stats = cache.eviction.stats
    assert stats.tokens_kept == sum(spec.kept(n) for n in PROMPT_LENGTHS) and stats.pages_freed > 0


def test_the_allotment_keeps_the_budget_and_every_heads_safeguard():
    torch.manual_seed(0)
    scores = [torch.randn(3, 200) * (1 + layer) for layer in range(4)]
    spec = CompressSpec(method="keydiff", budget=0.25, recent=8, sinks=4)
    kept = kept_positions_per_head(spec, scores)
    counts = [k.numel() for k in kept]
    assert sum(counts) == spec.kept(200) * 12
    for layer in range(4):  # sinks, window and the safeguard of the layer's average in every head
        layer_counts = counts[3 * layer : 3 * layer + 3]
        pool = sum(layer_counts) - 3 * (4 + 8)  # the layer's scored share
        assert min(layer_counts) >= 4 + 8 + max(0, int((pool // 3 + 4 + 8) * 0.2) - 4)
    assert sum(counts[9:]) > sum(counts[:3])  # the layer whose scores spread most gets more of the model's budget
    for k in kept:
        assert k.tolist() == sorted(set(k.tolist())) and k[:4].tolist() == [0, 1, 2, 3] and k[-1] == 199
    uniform_spec = CompressSpec(budget=0.25, layer_budget="uniform", head_budget="uniform", recent=8)
    uniform = kept_positions_per_head(uniform_spec, scores)
    assert {k.numel() for k in uniform} == {spec.kept(200)}


def test_the_attention_paths_agree(model, monkeypatch):
    """The native kernel and the PyTorch loop give the same tokens; so does Triton interpreted, where installed."""
    prompts = _prompts()
    value = "knorm:budget=0.3"
    native = _generate(model, prompts, _cb(value))
    attend = head_attention.HeadPagedCodes.attend
    monkeypatch.setattr(
        head_attention.HeadPagedCodes, "attend", lambda self, q, s, c=None, k=None: attend(self, q, s, c, k, "torch")
    )
    assert _generate(model, prompts, _cb(value)) == native
    assert _generate(model, prompts, _cb(value, "fp8_e4m3")) == _native_fp8(model, prompts, value, monkeypatch, attend)


def _native_fp8(model, prompts, value, monkeypatch, attend):
    monkeypatch.setattr(head_attention.HeadPagedCodes, "attend", attend)
    return _generate(model, prompts, _cb(value, "fp8_e4m3"))


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "keydiff", "head_budget": "max"}, "kv_compress.head_budget"),
        ({"method": "keydiff", "layer_budget": 1}, "kv_compress.layer_budget"),
        ({"method": "keydiff", "safeguard": 1.5}, "kv_compress.safeguard"),
    ],
)
def test_bad_allotment_settings_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse(value)


@pytest.mark.parametrize(
    "value, layout, field",
    [
        ("keydiff:budget=0.3:head_budget=uniform", "token", "kv_compress.head_budget"),
        ("keydiff:budget=0.3:safeguard=0.1", "token", "kv_compress.safeguard"),
    ],
)
def test_settings_the_layout_cannot_run_name_the_field(model, value, layout, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse(value).check_layout(layout)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model.generate_batch(
            [[1, 2, 3]], generation_config=GREEDY, continuous_batching_config=_cb(value, layout=layout)
        )


def test_a_bad_layout_names_the_field(model):
    with pytest.raises(ValueError, match="kv_compress_layout"):
        model.generate_batch(
            [[1, 2, 3]], generation_config=GREEDY, continuous_batching_config=_cb("knorm", layout="row")
        )


def test_a_request_spec_is_checked_against_the_cache_layout(model):
    manager = model.init_continuous_batching(
        generation_config=GREEDY, continuous_batching_config=_cb("keydiff:budget=0.3")
    )
    manager.start()
    try:
        while manager.batch_processor is None:
            pass
        with pytest.raises(ValueError, match=r"kv_compress\.chunk"):  # (snapkv's window is the prompt's end)
            manager.batch_processor.cache.eviction.set_request_spec("r", parse("snapkv:budget=0.3:chunk=16"))
        manager.batch_processor.cache.eviction.set_request_spec("r", parse("knorm:budget=0.5:head_budget=uniform"))
    finally:
        manager.stop(block=True)


def test_preempted_requests_finish_and_free_their_pages(model):
    """Pages too few for every request at once: transformers preempts some (a soft reset: prefilled and compressed
    again with what they generated, so their tokens may differ from a roomy run's, as on token pages); every request
    finishes and every page is free after."""
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (90, 84, 77, 95, 88, 70)]
    results, cache, seen = _manager_run(model, prompts, _cb("knorm:budget=0.3", num_blocks=16, max_batch_tokens=64))
    assert all(r.error is None and len(r.generated_tokens) == NEW_TOKENS for r in results.values())
    assert seen["free_after"] == seen["free_before"]
    assert cache.eviction.stats.requests > len(prompts)  # some prompt ended twice: a request was preempted


def test_a_request_offloaded_to_cpu_gets_its_streams_back(model):
    """CPU offloading (transformers' OffloadingManager, CUDA only) copies a request's blocks out in `block_table` order,
    frees them, allocates again from `position_offset` and copies the blocks back in the new `block_table` order:
    done here by hand on a CPU cache, each stream's rows come back at their positions."""
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from hf_kvcache.paged.cache import QuantizedPagedAttentionCache

    cb = _cb("knorm:budget=0.3", num_blocks=64)
    cache = QuantizedPagedAttentionCache(model.config, cb, "cpu", DistributedHelper(None, None), torch.float32)
    allocator = next(iter(cache.cache_allocators.values()))
    assert isinstance(allocator, head_pages.HeadPagedAllocator)
    while cache.pool.num_free_sectors:
        cache.pool.allocate_sector(allocator.index)
    allocator.allocate_cache_to_request("r", 0, 40)
    allocator.lengths["r"] = [40] * allocator.streams
    torch.manual_seed(0)
    allocator._rows[0].copy_(torch.randint(0, 255, allocator._rows[0].shape, dtype=torch.uint8))
    kept = [torch.randperm(40)[: 5 + 3 * s].sort().values for s in range(allocator.streams)]  # lengths differ
    allocator.compact("r", kept)
    allocator.allocate_cache_to_request("r", 0, 1)  # the next token's page
    before = [allocator._rows[0][allocator.stream_rows("r", s, torch.arange(n))].clone()
              for s, n in enumerate(allocator.lengths["r"])]  # fmt: skip
    lengths, blocks = list(allocator.lengths["r"]), list(allocator.block_table["r"])
    saved = allocator._copy_view[torch.tensor(blocks)].clone()
    allocator.free_blocks("r", no_cache=True)
    allocator._copy_view.zero_()
    past = sum(lengths) // len(lengths)  # the request's position_offset (its average length)
    assert allocator.needs_new_blocks("r", past, 1) == len(blocks)
    allocator.allocate_cache_to_request("r", past, 1)
    allocator._copy_view.index_copy_(0, torch.tensor(allocator.block_table["r"][: len(blocks)]), saved)
    assert allocator.lengths["r"] == lengths
    for s, n in enumerate(lengths):
        assert torch.equal(allocator._rows[0][allocator.stream_rows("r", s, torch.arange(n))], before[s])


# -- the Triton kernel (CUDA's) on head pages, under Triton's CPU interpreter -----------------------------------------
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETED, reason="runs in the subprocess of test_triton_on_head_pages_under_the_interpreter")
@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3", "int4"])
def test_triton_equals_native_on_head_pages(model, monkeypatch, kv_dtype):
    worst, attend = [], head_attention.HeadPagedCodes.attend

    def both(self, query, scaling, softcap=None, sinks=None):
        native = attend(self, query, scaling, softcap, sinks, "native")
        worst.append(float((native - attend(self, query, scaling, softcap, sinks, "triton")).abs().max()))
        return native

    monkeypatch.setattr(head_attention.HeadPagedCodes, "attend", both)
    _generate(model, _prompts()[:2], _cb("knorm:budget=0.3", kv_dtype))
    assert worst and max(worst) < 2e-5, max(worst)


def test_triton_on_head_pages_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("already under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", __file__, "-k", "triton_equals_native"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.upstream
@pytest.mark.skipif(UNREADABLE is None, reason="this transformers lets attention read head pages")
def test_head_pages_are_refused_where_attention_cannot_read_them(model):
    """On transformers 5.23 (the cache is updated inside the attention functions) asking for head pages is an error
    naming `kv_compress_layout` before any request runs."""
    with pytest.raises(ValueError, match="kv_compress_layout"):
        model.generate_batch([[1, 2, 3]], generation_config=GREEDY, continuous_batching_config=_cb("knorm:budget=0.5"))
