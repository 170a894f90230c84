"""One request's fault is one request's error (hf_kvcache.paged.request_faults), in continuous batching with prompt
eviction on a float32 tiny Llama, faults injected by monkeypatching:

- a request whose compaction raises fails alone, with an error naming `kv_compress`, the request and the cause; the
  requests batched beside it generate exactly what they generate without the fault, and every page is free after;
- a request whose scoring raises during the forward (KVzap's arrival scores) fails alone in the same way;
- a forward that raises fails the requests of its batch only: the loop keeps serving, a later request generates what
  it generates alone, and no page is held; the same on FP8 pages without eviction (attention from the codes raising);
- where transformers' way of failing one request changed (the contract broken), the error is fatal as transformers
  has it, not swallowed.
The same through HTTP, with the pages counted by GET /v1/kv_cache: tests/test_serve_http.py.
"""

from __future__ import annotations

import pytest
from conftest import build_model, planted_surrogate, random_ids
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_kvcache  # noqa: F401  (installs the paged cache)
from hf_kvcache.integration.continuous_batching import REQUEST_FAULTS
from hf_kvcache.integration.contracts import broken
from hf_kvcache.paged import eviction
from hf_kvcache.paged.cache import QuantizedPagedAttentionCache
from hf_kvcache.paged.compress_spec import parse
from hf_kvcache.paged.eviction_checks import for_model

PROMPT_LENGTHS = (40, 67, 23, 90)
NEW_TOKENS = 6
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
INJECTED = "injected fault"


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _cb(compress="knorm:budget=0.25", kv_dtype=None):
    cb = ContinuousBatchingConfig(
        num_blocks=48, page_size=8, max_batch_tokens=64, allow_block_sharing=False, max_memory_percent=0.9
    )
    if compress is not None:
        cb.kv_compress = compress
    if kv_dtype is not None:
        cb.kv_cache_dtype = kv_dtype
    return cb


def _prompts():
    return [random_ids(1, n, seed=n)[0].tolist() for n in PROMPT_LENGTHS]


class _Run:
    """A running manager: submit requests, read their results, count the pages held."""

    def __init__(self, model, cb, specs=None):
        self.manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=cb)
        self.manager.start()
        self.specs = specs or {}

    def submit(self, prompt, rid):
        if rid in self.specs:
            while self.manager.batch_processor is None:
                pass
            self.manager.batch_processor.cache.eviction.set_request_spec(rid, self.specs[rid])
        return self.manager.add_request(prompt, request_id=rid, max_new_tokens=NEW_TOKENS)

    def results(self, ids):
        """The results of `ids` (failed or not), in any order of arrival."""
        got = {}
        for _ in range(1000):
            if set(ids) <= set(got):
                break
            result = self.manager.get_result(timeout=1)
            if result is not None:
                got[result.request_id] = result
        assert set(ids) <= set(got), f"no result for {set(ids) - set(got)}"
        return {rid: got[rid] for rid in ids}

    def held(self) -> int:
        cache = self.manager.batch_processor.cache
        return sum(len(t) for a in cache.cache_allocators.values() for t in a.block_table.values())

    def alive(self) -> bool:
        return self.manager.is_running()

    def stop(self):
        self.manager.stop(block=True)


def _all(model, prompts, cb, specs=None):
    run = _Run(model, cb, specs)
    try:
        ids = [run.submit(p, f"req_{i}") for i, p in enumerate(prompts)]
        results = run.results(ids)
        return results, run.held(), run.alive()
    finally:
        run.stop()


def _fault_in_compress(monkeypatch, victim: str):
    original = eviction.PagedEviction._compress

    def compress(self, state, info, final):
        if state.request_id == victim:
            raise RuntimeError(INJECTED)
        return original(self, state, info, final)

    monkeypatch.setattr(eviction.PagedEviction, "_compress", compress)


def test_a_request_whose_compaction_fails_fails_alone(model, monkeypatch):
    prompts = _prompts()
    clean, held, _ = _all(model, prompts, _cb())
    assert all(r.error is None for r in clean.values()) and held == 0
    _fault_in_compress(monkeypatch, "req_1")
    results, held, alive = _all(model, prompts, _cb())
    error = results["req_1"].error
    assert error is not None and "kv_compress: request req_1 failed compressing its prompt" in error, error
    assert INJECTED in error
    for rid in ("req_0", "req_2", "req_3"):
        assert results[rid].error is None
        assert results[rid].generated_tokens == clean[rid].generated_tokens
    assert held == 0 and alive


@pytest.fixture(scope="module")
def surrogate_dir(tmp_path_factory, model):
    directory = tmp_path_factory.mktemp("surrogate")
    planted_surrogate(model).save(directory)
    return str(directory)


def test_a_request_whose_scoring_fails_during_the_forward_fails_alone(model, surrogate_dir, monkeypatch):
    """KVzap scores each prompt chunk as it arrives, inside the forward: the victim asks for another budget, and its
    scorer raises at layer 1."""
    default = f"kvzap:budget=0.25:surrogate={surrogate_dir}"
    victim = parse(f"kvzap:budget=0.5:surrogate={surrogate_dir}")
    running = for_model(victim, model.config.get_text_config())  # (the spec as it runs: its chunk chosen)
    prompts = _prompts()
    clean, _, _ = _all(model, prompts, _cb(default), specs={"req_2": victim})
    original = eviction.prompt_scorer

    def prompt_scorer(spec, layer_idx, surrogate):
        scorer = original(spec, layer_idx, surrogate)
        if spec == running and layer_idx == 1:

            def score_arrivals(hidden):
                raise ValueError(INJECTED)

            scorer.score_arrivals = score_arrivals
        return scorer

    monkeypatch.setattr(eviction, "prompt_scorer", prompt_scorer)
    results, held, alive = _all(model, prompts, _cb(default), specs={"req_2": victim})
    error = results["req_2"].error
    assert error is not None and "req_2 failed scoring its prompt at layer 1: ValueError: injected fault" in error
    for rid in ("req_0", "req_1", "req_3"):
        assert results[rid].error is None
        assert results[rid].generated_tokens == clean[rid].generated_tokens
    assert held == 0 and alive


def _fault_in_forward(monkeypatch, victim: str):
    """The model's forward raises (at layer 1's cache update) in every forward whose batch holds `victim`."""
    in_batch = set()
    before = eviction.PagedEviction.before_forward

    def before_forward(self, processor, model):
        in_batch.clear()
        in_batch.update(f.state.request_id for f in processor.inputs_and_outputs.requests_in_batch)
        return before(self, processor, model)

    update = QuantizedPagedAttentionCache.update

    def faulty_update(self, key_states, value_states, layer_idx, kwargs):
        if victim in in_batch and layer_idx == 1:
            raise RuntimeError(INJECTED)
        return update(self, key_states, value_states, layer_idx, kwargs)

    monkeypatch.setattr(eviction.PagedEviction, "before_forward", before_forward)
    monkeypatch.setattr(QuantizedPagedAttentionCache, "update", faulty_update)


def test_a_failed_forward_fails_its_batch_and_the_loop_goes_on(model, monkeypatch):
    prompts = _prompts()
    clean, _, _ = _all(model, prompts[:2], _cb())
    _fault_in_forward(monkeypatch, "bad")
    run = _Run(model, _cb())
    try:
        first = run.results([run.submit(prompts[0], "req_0")])["req_0"]
        bad = run.results([run.submit(prompts[3], "bad")])["bad"]
        after = run.results([run.submit(prompts[1], "req_1")])["req_1"]
        held, alive = run.held(), run.alive()
    finally:
        run.stop()
    assert bad.error is not None and "the forward of this request's batch (1 requests) failed" in bad.error
    assert INJECTED in bad.error
    assert first.error is None and first.generated_tokens == clean["req_0"].generated_tokens
    assert after.error is None and after.generated_tokens == clean["req_1"].generated_tokens
    assert held == 0 and alive


def test_quantized_pages_without_eviction_fail_a_faulty_forward_alone_too(model, monkeypatch):
    """FP8 pages, no kv_compress: attention from the codes raises once (armed just before the victim is submitted,
    alone): the victim fails, the requests before and after it generate what they generate without the fault."""
    from hf_kvcache.paged import codes_attention

    prompts = _prompts()
    cb = lambda: _cb(None, kv_dtype="fp8_e4m3")
    clean, _, _ = _all(model, prompts[:2], cb())
    armed = []
    attend = codes_attention.PagedCodes.attend

    def faulty_attend(self, *args, **kwargs):
        if armed:
            armed.clear()
            raise RuntimeError(INJECTED)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(codes_attention.PagedCodes, "attend", faulty_attend)
    run = _Run(model, cb())
    try:
        first = run.results([run.submit(prompts[0], "req_0")])["req_0"]
        assert run.manager.batch_processor.cache.attention_path == "codes"
        armed.append(True)
        bad = run.results([run.submit(prompts[3], "bad")])["bad"]
        after = run.results([run.submit(prompts[1], "req_1")])["req_1"]
        held, alive = run.held(), run.alive()
    finally:
        run.stop()
    assert bad.error is not None and INJECTED in bad.error and "forward of this request's batch" in bad.error
    assert first.generated_tokens == clean["req_0"].generated_tokens
    assert after.error is None and after.generated_tokens == clean["req_1"].generated_tokens
    assert held == 0 and alive


def test_where_the_contract_is_broken_the_fault_stays_fatal(model, monkeypatch):
    _fault_in_forward(monkeypatch, "req_0")
    with broken(REQUEST_FAULTS):
        results, _, alive = _all(model, _prompts()[:1], _cb())
    assert INJECTED in results["req_0"].error
    assert not alive  # transformers' own handling: the loop stopped
