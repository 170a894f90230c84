"""`hf-kvcache serve` through HTTP with the `openai` client: the server runs in a subprocess on 127.0.0.1 (a free
port, bounded start and request times, stopped by the fixture), as users start it.

- Greedy answers equal `generate` on the same chat prompts: model-dtype pages against DynamicCache, FP8 pages
  against our QuantizedFP8Cache with the pages' format (per-token E4M3 scales in bfloat16, Hadamard-rotated keys).
  Compared up to the first near-tie of the reference (a top-2 logit gap under NEAR_TIE), where batching order alone
  may flip the choice; the prompts are long enough apart that this is checked, not assumed.
- Streaming returns the same text as the plain request; completions work.
- Load: 64 requests from 16 concurrent clients, mixed prompt and output lengths, half streamed, in a KV memory that
  holds about a dozen of them: every request completes with its tokens, several held pages at once, and afterwards
  no page is held.
- Faults: a prompt longer than the memory can ever hold gets HTTP 400 naming the limit and the server keeps
  serving; a client that disconnects mid-stream frees its pages; bad values get HTTP 400 naming the field.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import torch

from hf_kvcache.kernels import cpu_blockwise
from hf_kvcache.paged.serve_process import ServerProcess

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

START_TIMEOUT = 240  # s: import, load SmolLM2, bind
REQUEST_TIMEOUT = 120  # s per request
NEAR_TIE = 0.01  # logits: float32 batching noise is ~1e-5, SmolLM2's own near-ties are common under 0.1
PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.", "Write one sentence about the sea."]
NEW_TOKENS = 16


class Server(ServerProcess):
    """The server on CPU; `client` the openai client, a failed start a test failure."""

    def __init__(self, *flags: str):
        try:
            super().__init__("--device", "cpu", *flags, start_timeout=START_TIMEOUT, request_timeout=REQUEST_TIMEOUT)
        except RuntimeError as error:
            pytest.fail(str(error))
        self.client = self.openai_client()


@pytest.fixture(scope="module")
def smollm2():
    try:
        from hf_kvcache.evaluation.models import load_model

        return load_model("smollm2")
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"offline SmolLM2 not available: {error}")


@pytest.fixture(scope="module")
def model_pages(smollm2):
    server = Server("--kv-cache-dtype", "auto", "--kv-memory", "64MiB")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fp8_pages(smollm2):
    """FP8 pages in 24 MiB, pages of 32 tokens: ~2,100 tokens, about a dozen of the load test's requests."""
    server = Server("--kv-cache-dtype", "fp8_e4m3", "--kv-memory", "24MiB", "--cb-block-size", "32")
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


def test_fp8_pages_equal_quantized_fp8_cache(fp8_pages, smollm2):
    from hf_kvcache import QuantizedFP8Cache

    model, tokenizer = smollm2
    compared = 0
    for prompt in PROMPTS:
        cache = QuantizedFP8Cache(
            model,
            format="fp8_e4m3",
            granularity="token",
            key_rotation="hadamard",
            key={"scale_dtype": "bfloat16"},
            value={"scale_dtype": "bfloat16"},
        )
        expected, steps = reference(model, tokenizer, prompt, cache)
        answer = chat(fp8_pages, prompt)
        assert answer.startswith(expected), (prompt, answer, expected)
        compared += steps
    assert compared >= 2 * NEW_TOKENS


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
    deadline = time.monotonic() + 30
    while (state := fp8_pages.kv_cache())["pages_in_use"] or state["requests_active"]:
        assert time.monotonic() < deadline, f"pages still held 30 s after the client left: {state}"
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
