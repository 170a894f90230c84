"""`hf-kvcache serve` without a server: the KV memory plan (what --kv-memory holds per page format), the admission
check on a continuous-batching manager, --kv-memory parsing, and the refusal when transformers' server changed."""

from __future__ import annotations

import argparse
import threading
import types

import pytest
import torch
from conftest import build_model

from hf_kvcache.cli.serve_command import memory_size
from hf_kvcache.integration import serving
from hf_kvcache.integration.contracts import broken
from hf_kvcache.integration.versions import UnsupportedTransformersError
from hf_kvcache.paged.serve_requests import RequestRejected, admit
from hf_kvcache.paged.server import build_server, plan_memory


@pytest.mark.parametrize(
    "text, size",
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64M", 64_000_000),
        ("4096", 4096),
        (" 1 kib ", 1024),
    ],
)
def test_memory_size(text, size):
    assert memory_size(text) == size


@pytest.mark.parametrize("text", ["", "12XB", "-1GiB", "0", "GiB", "1e9"])
def test_memory_size_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 512MiB"):
        memory_size(text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_counts_the_tokens_each_format_holds(dtype):
    model = build_model("llama").to(dtype)  # 2 layers, 2 KV heads of head_dim 16
    config = model.config
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * 16 * dtype.itemsize
    plan = plan_memory(model, 1000 * token_bytes, "fp8_e4m3", page_size=16)
    assert plan.num_blocks == 1000 // 16  # transformers' blocks: whole pages of model-dtype tokens
    assert plan.model_dtype_tokens == plan.num_blocks * 16
    # FP8: one byte per channel plus a bfloat16 scale per (token, KV head, key or value) row of 16 channels
    fp8_token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * (16 + 2)
    expected = 1000 * token_bytes // fp8_token_bytes
    assert expected - 2 * 16 <= plan.tokens <= expected + 16  # whole pages, one sector of rounding
    assert plan.tokens % 16 == 0 and plan.tokens > plan.model_dtype_tokens
    text = "\n".join(plan.lines(64))
    assert f"{plan.tokens:,} tokens = {plan.tokens // 64:,} requests of 64 tokens   <- serving" in text
    assert f"model-dtype ({str(dtype)[6:]}) pages" in text


def test_plan_refuses_memory_without_one_page():
    model = build_model("llama")
    with pytest.raises(ValueError, match=r"--kv-memory: 100 bytes hold no page: one page of 256 tokens"):
        plan_memory(model, 100, "int8")


class FakeManager:
    class generation_config:
        max_new_tokens = 50

    def __init__(self):
        self.added = []

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, **kwargs):
        self.added.append((len(input_ids), max_new_tokens))
        return request_id


def test_admission_refuses_what_the_pages_cannot_hold():
    manager = FakeManager()
    admit(manager, limit=100, label="1 MiB of int8 pages")
    assert manager.add_request(list(range(60)), request_id="a", max_new_tokens=40) == "a"
    with pytest.raises(
        RequestRejected,
        match=r"needs 101 tokens .* \(1 MiB of int8 pages\) holds at most 100 "
        r"tokens",
    ) as error:
        manager.add_request(list(range(61)), request_id="b", max_new_tokens=40)
    assert error.value.param == "max_tokens" and error.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="needs 101 tokens") as error:  # the manager's default max_new_tokens
        manager.add_request(list(range(51)), request_id="c")
    with pytest.raises(RequestRejected) as error:
        manager.add_request(list(range(120)), request_id="d", max_new_tokens=1)
    assert error.value.param == "messages"
    assert manager.added == [(60, 40)]  # nothing refused reached the manager
    assert error.value.payload()["error"]["type"] == "invalid_request_error"


@pytest.mark.upstream
def test_refused_request_leaves_no_result_handler():
    """transformers registers a non-streaming request's result handler before add_request, and only a finished result
    removes it: a refused request must not leave its entry behind (one per refusal, for the server's lifetime)."""
    import asyncio

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    manager = FakeManager()
    manager.output_router = types.SimpleNamespace(_lock=threading.Lock(), result_handlers={})

    async def register(request_id):  # transformers' own method on our manager (it needs a running loop)
        ContinuousBatchingManager.register_result_handler(manager, request_id, lambda result: None)

    admit(manager, limit=100, label="1 MiB of int8 pages")
    for request_id in ("kept", "refused", "refused-positional"):
        asyncio.run(register(request_id))
    manager.add_request(list(range(10)), request_id="kept", max_new_tokens=4)
    with pytest.raises(RequestRejected):
        manager.add_request(list(range(200)), request_id="refused", max_new_tokens=4)
    with pytest.raises(RequestRejected):
        manager.add_request(list(range(200)), "refused-positional", 4)
    assert list(manager.output_router.result_handlers) == ["kept"]


@pytest.mark.parametrize("contract", [serving.SERVE, serving.ADMISSION, serving.RESULT_HANDLERS])
def test_changed_server_internals_raise_before_loading(contract):
    with broken(contract, "faked by a test"), pytest.raises(UnsupportedTransformersError, match="faked by a test"):
        build_server("/no/such/model", "fp8_e4m3", 2**20)


def test_every_transformers_serve_option_is_a_flag():
    from hf_kvcache.cli import build_parser

    names = {o.name for o in serving.serve_options()}
    assert {"host", "port", "device", "dtype", "cb_max_batch_tokens", "attn_implementation"} <= names
    assert not names & set(serving.OWN_PARAMETERS)
    args = build_parser().parse_args(["serve", "--port", "9000", "--no-enable-cors", "--cb-max-batch-tokens", "64"])
    assert (args.port, args.enable_cors, args.cb_max_batch_tokens, args.kv_cache_dtype) == (9000, False, 64, "fp8_e4m3")


def test_serve_without_the_serving_extra_says_what_to_install(monkeypatch, capsys):
    from hf_kvcache.cli import main, serve_command

    monkeypatch.setattr(serve_command, "SERVING_PACKAGES", ("fastapi", "no_such_serving_package"))
    assert main(["serve", "--kv-memory", "1MiB"]) == 2
    assert "needs ['no_such_serving_package']: pip install 'hf-kvcache[serving]'" in capsys.readouterr().err


def test_admission_with_eviction_counts_the_prompt_then_what_is_kept():
    """With prompt eviction a request needs max(prompt, kept + max_tokens): a 80-token prompt keeping 20 fits 70 new
    tokens in 100, uncompressed it would not; a request asking for none needs its whole length; a prompt over the
    limit is refused whatever it keeps, unless it is compressed chunk by chunk."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hf_kvcache.paged.compress_spec import parse
    from hf_kvcache.paged.serve_compression import ServerCompression

    cb = ContinuousBatchingConfig()
    compression = ServerCompression(cb, parse("knorm:budget=0.25"), model_config=None)
    manager = FakeManager()
    manager.cancel_request = lambda request_id: None
    admit(manager, limit=100, label="1 MiB of int8 pages", compression=compression)
    assert manager.add_request(list(range(80)), request_id="a", max_new_tokens=70) == "a"
    from hf_kvcache.paged import request_specs

    request_specs.set_request_spec(cb, "b", None)
    with pytest.raises(RequestRejected, match=r"needs 150 tokens of KV cache \(a 80-token prompt \+ max_tokens 70\)"):
        manager.add_request(list(range(80)), request_id="b", max_new_tokens=70)
    assert "b" not in request_specs.request_specs(cb)  # a refused request's spec is forgotten
    with pytest.raises(
        RequestRejected, match=r"needs 120 tokens of KV cache \(a 120-token prompt, 30 kept after kv_compress,"
    ):
        manager.add_request(list(range(120)), request_id="c", max_new_tokens=4)
    # compressed every 16 tokens, the same prompt never holds more than 46 (kept(120) = 30, + 16): admitted
    request_specs.set_request_spec(cb, "e", parse("knorm:budget=0.25:chunk=16"))
    assert parse("knorm:budget=0.25:chunk=16").peak(120) == 46  # 30 kept + a chunk
    assert manager.add_request(list(range(120)), request_id="e", max_new_tokens=4) == "e"
    request_specs.set_request_spec(cb, "d", parse("knorm:budget=0.5"))
    manager.cancel_request("d")
    assert "d" not in request_specs.request_specs(cb)
