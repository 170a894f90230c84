"""`hf-kvcache serve` through HTTP with the `openai` client: the server runs in a subprocess on 127.0.0.1 (a free
port, bounded start and request times, stopped by the fixture), as users start it.

- Greedy answers (float32 servers, as the references here): model-dtype pages equal `generate` with DynamicCache up to
  the first near-tie of the reference (a top-2 logit gap under NEAR_TIE, where float32 batching noise alone may flip
  the choice); FP8 pages equal `generate_batch` with the same pages in this process token for token (their numerics
  against QuantizedFP8Cache are tests/test_paged.py's).
- Streaming returns the same text as the plain request; completions work.
- Load: 64 requests from 16 concurrent clients, mixed prompt and output lengths, half streamed, in a KV memory that
  holds about a dozen of them: every request completes with its tokens, several held pages at once, and afterwards
  no page is held.
- Faults: a prompt longer than the memory can ever hold gets HTTP 400 naming the limit and the server keeps
  serving; a client that disconnects mid-stream frees its pages; bad values get HTTP 400 naming the field; with faults
  injected (tests/fault_injecting_serve.py), a request failing in its compaction gets HTTP 500 while the requests
  beside it are answered, a failed forward fails its batch's request (plain or streamed) and the server answers the
  next as before, and no page is held after either.
- Time limits are hang guards only (minutes), never a verdict on speed.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import offline_model

from hf_kvcache.kernels import cpu_blockwise
from hf_kvcache.paged.serve_process import ServerProcess

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

# Hang guards only, never a verdict on speed: CI runs on whatever load the machine has (a busy 2-core machine once
# took over 120 s for a request of the mixed load)
START_TIMEOUT = 900  # s: import, load SmolLM2, bind
REQUEST_TIMEOUT = 900  # s per request
HANG_GUARD = 600  # s for pages to go back after the requests ended
NEAR_TIE = 0.01  # logits: float32 batching noise is ~1e-5, SmolLM2's own near-ties are common under 0.1
PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.", "Write one sentence about the sea."]
NEW_TOKENS = 16
FP8_PAGE = 32  # tokens per page of the FP8 servers


class Server(ServerProcess):
    """The server on CPU; `client` the openai client, a failed start a test failure."""

    def __init__(self, *flags: str, launcher=None):
        try:
            super().__init__(
                "--device",
                "cpu",
                *flags,
                start_timeout=START_TIMEOUT,
                request_timeout=REQUEST_TIMEOUT,
                launcher=launcher,
            )
        except RuntimeError as error:
            pytest.fail(str(error))
        self.client = self.openai_client()


@pytest.fixture(scope="module")
def smollm2():
    return offline_model("smollm2")


@pytest.fixture(scope="module")
def model_pages(smollm2):
    server = Server("--kv-cache-dtype", "auto", "--kv-memory", "64MiB", "--dtype", "float32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fp8_pages(smollm2):
    """FP8 pages in 24 MiB, pages of 32 tokens: ~2,100 tokens, about a dozen of the load test's requests. float32, as
    the references in this process."""
    server = Server(
        "--kv-cache-dtype", "fp8_e4m3", "--kv-memory", "24MiB", "--cb-block-size", str(FP8_PAGE), "--dtype", "float32"
    )  # fmt: skip
    yield server
    server.stop()


def chat(server, prompt: str, **kwargs) -> str:
    response = server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS, temperature=0, **kwargs
    )
    return response.choices[0].message.content


@torch.inference_mode()
def reference(model, tokenizer, prompt: str, cache) -> str:
    """Greedy text of `generate` with `cache`, cut before the first near-tie of the greedy choice."""
    from hf_kvcache import cache_kwargs

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **cache_kwargs(cache),
    )
    tokens = out.sequences[0, ids.shape[1] :]
    keep = len(tokens)
    for step, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if top2[0] - top2[1] < NEAR_TIE:
            keep = step
            break
    return tokenizer.decode(tokens[:keep], skip_special_tokens=True), keep


def test_model_dtype_pages_equal_generate(model_pages, smollm2):
    from hf_kvcache import FullCache

    model, tokenizer = smollm2
    compared = 0
    for prompt in PROMPTS:
        expected, steps = reference(model, tokenizer, prompt, FullCache(model))
        answer = chat(model_pages, prompt)
        assert answer.startswith(expected), (prompt, answer, expected)
        compared += steps
    assert compared >= 2 * NEW_TOKENS  # the comparison was not cut to nothing by near-ties


@torch.inference_mode()
def same_pages_in_process(model, tokenizer, prompt: str, kv_dtype: str, page_size: int) -> str:
    """The greedy answer of `generate_batch` in this process with the server's page format (the library's own
    continuous batching, a lone request)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=page_size)
    cb.kv_cache_dtype = kv_dtype
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    out = model.generate_batch([list(ids)], generation_config=generation, continuous_batching_config=cb, warmup=False)
    (result,) = out.values()
    assert result.error is None, result.error
    return tokenizer.decode(result.generated_tokens, skip_special_tokens=True)


def test_fp8_pages_answer_as_the_library_does_in_process(fp8_pages, smollm2):
    """A lone greedy request through HTTP gets, token for token and to the end, what `generate_batch` with the same
    FP8 pages gives in this process (float32 both). The pages' numerics against QuantizedFP8Cache are
    tests/test_paged.py's (a tiny model with wide logit gaps): on SmolLM2, two float32 paths that differ by 1e-6
    before quantization round some values to neighbouring FP8 codes, which moves logits by up to ~0.5 within 16
    tokens (measured: attention from the codes against the dequantize path, the rainbow prompt), enough to flip
    SmolLM2's near-ties."""
    model, tokenizer = smollm2
    for prompt in PROMPTS:
        expected = same_pages_in_process(model, tokenizer, prompt, "fp8_e4m3", FP8_PAGE)
        assert len(tokenizer(expected)["input_ids"]) >= 4  # (the capital of France ends at 7 tokens)
        assert chat(fp8_pages, prompt) == expected, prompt


def test_streaming_and_completions(fp8_pages):
    plain = chat(fp8_pages, PROMPTS[0])
    stream = fp8_pages.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain and plain
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    completion = fp8_pages.client.completions.create(
        model="smollm2", prompt="The quick brown fox", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8


def _load_request(server, i: int) -> tuple[int, int]:
    """Request i of the load test: (tokens generated, max_tokens asked)."""
    words = " ".join(["alpha", "beta", "gamma", "delta"][j % 4] for j in range(10 + 23 * (i % 7)))
    max_tokens = 4 + (i * 5) % 13
    messages = [{"role": "user", "content": f"Repeat the last word of: {words}"}]
    if i % 2:
        stream = server.client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        chunks = [c for c in stream]
        usage = chunks[-1].usage
        return usage.completion_tokens, max_tokens
    response = server.client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return response.usage.completion_tokens, max_tokens


def test_load_64_requests_16_clients_no_page_leak(fp8_pages):
    seen = []
    stop = False

    def watch():
        while not stop:
            seen.append(fp8_pages.kv_cache())
            time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        watcher = pool.submit(watch)
        results = list(pool.map(lambda i: _load_request(fp8_pages, i), range(64)))
        stop = True
        watcher.result()
    assert len(results) == 64
    assert all(1 <= got <= asked for got, asked in results), results
    assert max(s["requests_active"] for s in seen) >= 4  # requests were served concurrently
    after = fp8_pages.kv_cache()
    assert after["pages_in_use"] == 0 and after["requests_active"] == 0 and after["requests_waiting"] == 0, after
    assert after["pages_total"] * after["page_size"] == after["tokens_capacity"]
    # on CPU (where the native kernel builds) FP8 pages attend straight from their codes
    assert after["attention_path"] == ("codes" if cpu_blockwise.unavailable() is None else "dequantize"), after


def test_prompt_longer_than_memory_is_refused_and_server_keeps_serving(fp8_pages):
    limit = fp8_pages.kv_cache()["tokens_capacity"]
    with pytest.raises(openai.BadRequestError) as error:
        fp8_pages.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "word " * (limit + 100)}], max_tokens=4
        )
    body = error.value.body
    assert body["code"] == "context_length_exceeded" and f"at most {limit} tokens" in body["message"], body
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(fp8_pages, PROMPTS[0], extra_body={"max_tokens": limit})
    assert chat(fp8_pages, PROMPTS[0])  # still serving
    assert fp8_pages.kv_cache()["pages_in_use"] == 0


def test_client_disconnect_mid_stream_frees_pages(fp8_pages):
    stream = fp8_pages.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=1000,
        temperature=0,
        stream=True,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    held = fp8_pages.kv_cache()
    assert held["pages_in_use"] >= 1 and held["requests_active"] == 1, held
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + HANG_GUARD
    while (state := fp8_pages.kv_cache())["pages_in_use"] or state["requests_active"]:
        assert time.monotonic() < deadline, f"pages still held {HANG_GUARD} s after the client left: {state}"
        time.sleep(0.1)
    assert chat(fp8_pages, PROMPTS[1])


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", "12"),
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_p", 1.5),
        ("seed", 1.5),
        ("stream", "yes"),
        ("n", 2),
        ("messages", []),
        ("messages", [{"content": "no role"}]),
    ],
)
def test_bad_values_get_400_naming_the_field(fp8_pages, field, value):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    status, answer = fp8_pages.post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"].startswith(field) and f"`{field}" in answer["error"]["message"], answer


def test_unknown_field_and_bad_prompt(fp8_pages):
    status, answer = fp8_pages.post(
        "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokenz": 4}
    )
    assert status == 422 and "max_tokenz" in json.dumps(answer)
    status, answer = fp8_pages.post("/v1/completions", {"model": "smollm2", "prompt": "", "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "prompt"


# -- prompt eviction (--kv-compress, the request's kv_compress field) ----------------------------------------------


@pytest.fixture(scope="module")
def compressed_pages(smollm2):
    """FP8 pages in 24 MiB (pages of 32 tokens) evicting 75% of each prompt by KeyDiff; requests may ask otherwise."""
    server = Server(
        "--kv-cache-dtype", "fp8_e4m3", "--kv-memory", "24MiB", "--cb-block-size", str(FP8_PAGE), "--dtype", "float32",
        "--kv-compress", "keydiff:budget=0.25",
    )  # fmt: skip
    yield server
    server.stop()


def _words(n: int) -> str:
    return " ".join(["alpha", "beta", "gamma", "delta", "omega"][j % 5] for j in range(n))


def test_eviction_keeps_a_quarter_frees_pages_and_a_request_may_ask_for_none(compressed_pages, smollm2):
    server = compressed_pages
    before = server.kv_cache()
    assert before["kv_compress"] == "keydiff:0.75"  # label(): the share evicted, as the results name it
    prompt = f"Count the words: {_words(300)}"
    assert chat(server, prompt)
    state = server.kv_cache()["eviction"]
    assert state["requests_compressed"] == 1 and state["pages_freed"] >= 6, state
    assert state["tokens_kept"] == -(-state["tokens_prefilled"] // 4), state  # ceil(25%) of the prompt
    # a request asking for none is not compressed: it answers as the same pages do in this process
    model, tokenizer = smollm2
    expected = same_pages_in_process(model, tokenizer, PROMPTS[2], "fp8_e4m3", FP8_PAGE)
    assert chat(server, PROMPTS[2], extra_body={"kv_compress": "none"}) == expected
    after = server.kv_cache()["eviction"]
    assert after["requests"] == state["requests"] + 1 and after["requests_compressed"] == 1, after
    # and one asking for another method is compressed by it
    assert chat(server, prompt, extra_body={"kv_compress": {"method": "sink_window", "budget": 0.5}})
    last = server.kv_cache()["eviction"]
    assert last["requests_compressed"] == 2
    assert last["tokens_kept"] - after["tokens_kept"] == -(-(last["tokens_prefilled"] - after["tokens_prefilled"]) // 2)
    # and one compressed every 64 prompt tokens keeps the same share in the end
    assert chat(server, prompt, extra_body={"kv_compress": "keydiff:budget=0.25:chunk=64"})
    chunked = server.kv_cache()["eviction"]
    assert chunked["requests_compressed"] == 3
    assert chunked["tokens_kept"] - last["tokens_kept"] == -(
        -(chunked["tokens_prefilled"] - last["tokens_prefilled"]) // 4
    )


@pytest.fixture(scope="module")
def head_pages(smollm2):
    """Model-dtype head pages (`--kv-layout head`), pages of 16, KVzap keeping 25% of each prompt. float32."""
    server = Server(
        "--kv-cache-dtype", "auto", "--kv-memory", "32MiB", "--cb-block-size", "16", "--dtype", "float32",
        "--kv-compress", "kvzap:budget=0.25", "--kv-layout", "head",
    )  # fmt: skip
    yield server
    server.stop()


def test_head_pages_answer_as_generate_with_the_same_per_head_budgets(head_pages, smollm2):
    """Through HTTP, each (layer, KV head) keeping its own share: the text `generate` gives when every head attends
    to what it keeps (eviction_reference.generate_with_head_eviction), for the server's KVzap and a request's
    KeyDiff with uniform heads; then every page is free."""
    from hf_kvcache.evaluation.eviction_reference import generate_with_head_eviction
    from hf_kvcache.paged.compress_spec import parse

    model, tokenizer = smollm2
    server = head_pages
    prompt = f"Count the words: {_words(200)}. The words are"
    ids = tokenizer(prompt).input_ids
    for setting in (None, "keydiff:budget=0.25:head_budget=uniform"):
        extra = {} if setting is None else {"extra_body": {"kv_compress": setting}}
        response = server.client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, **extra
        )
        spec = parse(setting or "kvzap:budget=0.25")
        expected = tokenizer.decode(generate_with_head_eviction(model, ids, spec, NEW_TOKENS), skip_special_tokens=True)
        assert response.choices[0].text == expected, setting
    state = server.kv_cache()
    assert state["kv_compress_layout"] == "head" and state["attention_path"] == "heads", state
    assert state["eviction"]["requests_compressed"] == 2, state
    deadline = time.monotonic() + HANG_GUARD
    while server.kv_cache()["pages_in_use"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.kv_cache()["pages_in_use"] == 0


@pytest.mark.parametrize(
    "value, match",
    [
        ("magic:0.5", "`kv_compress.method` must be one of"),
        ("keydiff:1.5", r"`kv_compress.ratio`"),
        ("keydiff:budget=1.5", r"`kv_compress.budget`"),
        ({"method": "knorm", "budget": 0.5, "speed": 2}, "unknown keys"),
        ("kvzap:budget=0.5", None),  # SmolLM2 has a shipped surrogate, so kvzap is accepted
    ],
)
def test_bad_kv_compress_gets_400_naming_the_field(compressed_pages, value, match):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "kv_compress": value}
    status, answer = compressed_pages.post("/v1/chat/completions", body)
    if match is None:
        assert status == 200, answer
        return
    assert status == 400 and answer["error"]["param"] == "kv_compress", answer
    assert re.search(match, answer["error"]["message"]), answer


def test_a_server_without_kv_compress_refuses_the_field(fp8_pages):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "kv_compress": 0.5}
    status, answer = fp8_pages.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "kv_compress" and "--kv-compress" in answer["error"]["message"]


def test_admission_counts_the_peak_then_the_compressed_size(compressed_pages):
    """A request whose prompt + max_tokens exceed the memory is admitted when its prompt fits and what it keeps +
    max_tokens fits; a prompt larger than the memory is still refused."""
    server = compressed_pages
    limit = server.kv_cache()["tokens_capacity"]
    prompt = f"Count: {_words(limit // 2)}"
    response = server.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=limit * 2 // 3,
        temperature=0,
        stop=None,
    )
    assert response.usage.prompt_tokens + limit * 2 // 3 > limit  # uncompressed, it would have been refused
    with pytest.raises(openai.BadRequestError) as error:
        server.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": _words(limit + 50)}], max_tokens=4
        )
    assert (
        error.value.body["code"] == "context_length_exceeded"
        and "kept after kv_compress" in error.value.body["message"]
    )
    assert server.kv_cache()["pages_in_use"] == 0


def _abandon(server, prompt: str, after_chunks: int) -> None:
    """Stream `prompt` and leave after `after_chunks` chunks (0: as soon as the response starts, mid-prefill of a
    long prompt)."""
    stream = server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0, stream=True
    )
    for received, _chunk in enumerate(stream):
        if received >= after_chunks:
            break
    stream.close()


def test_mixed_load_with_disconnects_leaves_no_page_held(compressed_pages):
    server = compressed_pages

    def one(i: int):
        if i % 4 == 0:
            return _abandon(server, f"Summarise: {_words(600 + 40 * i)}", after_chunks=0)
        if i % 4 == 1:
            return _abandon(server, f"Continue: {_words(100 + 10 * i)}", after_chunks=3)
        spec = "none" if i % 8 == 2 else None
        extra = {"kv_compress": spec} if spec else {}
        return chat(server, f"Repeat the last word of: {_words(50 + 37 * i)}", extra_body=extra)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(32)))
    state = _idle(server)
    assert state["eviction"]["requests_compressed"] >= 12, state
    assert chat(server, PROMPTS[0])


@pytest.fixture(scope="module")
def faulty_pages(smollm2):
    """The compressed server with faults injected (tests/fault_injecting_serve.py): a request asking for
    max_tokens 7 fails in its compaction, a batch holding one asking for 5 fails in its forward."""
    launcher = [sys.executable, str(Path(__file__).with_name("fault_injecting_serve.py"))]
    server = Server(
        "--kv-cache-dtype", "fp8_e4m3", "--kv-memory", "24MiB", "--cb-block-size", "32", "--kv-compress",
        "keydiff:budget=0.25", launcher=launcher,
    )  # fmt: skip
    yield server
    server.stop()


def _idle(server) -> dict:
    deadline = time.monotonic() + HANG_GUARD
    while (state := server.kv_cache())["pages_in_use"] or state["requests_active"] or state["requests_waiting"]:
        assert time.monotonic() < deadline, f"pages still held {HANG_GUARD} s after the requests: {state}"
        time.sleep(0.2)
    return state


def test_a_request_failing_in_its_compaction_fails_alone_and_frees_its_pages(faulty_pages):
    server = faulty_pages

    def one(i: int):
        prompt = f"Repeat the last word of: {_words(120 + 40 * i)}"
        try:
            response = server.client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=7 if i == 2 else 8
            )
        except openai.InternalServerError as error:
            return error
        return response.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert isinstance(results[2], openai.InternalServerError), results
    assert all(isinstance(r, int) and 1 <= r <= 8 for i, r in enumerate(results) if i != 2), results
    state = _idle(server)
    assert state["eviction"]["requests_compressed"] >= 5, state
    assert "injected compaction fault" in server.output()
    assert chat(server, PROMPTS[0])  # still serving


def test_a_failed_forward_fails_its_batch_only_and_the_server_goes_on(faulty_pages):
    server = faulty_pages
    before = chat(server, PROMPTS[1])
    with pytest.raises(openai.InternalServerError):
        chat(server, PROMPTS[1], extra_body={"max_tokens": 5})
    assert _idle(server)["pages_in_use"] == 0
    assert chat(server, PROMPTS[1]) == before  # the loop goes on, answering as before
    stream = server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=5, stream=True
    )
    with pytest.raises(openai.APIError):  # a stream gets the error as its last event
        for _ in stream:
            pass
    assert _idle(server)["pages_in_use"] == 0
    assert "injected forward fault" in server.output()
