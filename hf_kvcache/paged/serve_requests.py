"""What `hf-kvcache serve` refuses, and how: request fields of the wrong type or range, and requests that need more
KV memory than the server has. Both are HTTP 400 answers in OpenAI's error shape, naming the field:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": ...}}

so the `openai` client raises `BadRequestError` with that message, and the server keeps serving. transformers'
handlers already answer 422 for fields the endpoint does not know; these checks add the values.

- `check_body(body, endpoint)`: the sampling and length fields (`max_tokens`, `max_completion_tokens`,
  `max_output_tokens`: integers >= 1; `temperature`: a number in [0, 2]; `top_p`: in (0, 1]; `seed`: an integer;
  `stream`: a boolean; `n`: 1, the one choice the server returns), `messages` (chat: a non-empty list of objects
  with a string `role`) and `prompt` (completions: a non-empty string).
- `admit(limit, label)`: wraps a continuous-batching manager's `add_request` so a request whose prompt plus
  `max_tokens` exceeds what the pages can ever hold (`limit` tokens: all of the KV memory for one request) is
  refused before it is queued; without it such a request would wait for pages that never come. A refused request
  leaves no result handler behind (transformers registers a non-streaming request's handler before `add_request`;
  `hf_kvcache.integration.serving.forget_result_handler`).
"""

from __future__ import annotations

import math

from ..integration.serving import forget_result_handler

LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class RequestRejected(ValueError):
    """A request the server answers with HTTP 400, naming `param`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code

    def payload(self) -> dict:
        return {
            "error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}
        }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def check_body(body, endpoint: str) -> None:
    """Raise RequestRejected for the first field of `body` with a value the server cannot honour (see the module
    docstring); `endpoint` is 'chat_completion', 'completion' or 'response'."""
    if not isinstance(body, dict):
        raise RequestRejected(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    for field in LENGTH_FIELDS:
        value = body.get(field)
        if value is not None and not (_is_int(value) and value >= 1):
            raise RequestRejected(f"`{field}` must be an integer >= 1, got {value!r}", field)
    temperature = body.get("temperature")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 2):
        raise RequestRejected(f"`temperature` must be a number in [0, 2], got {temperature!r}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise RequestRejected(f"`top_p` must be a number in (0, 1], got {top_p!r}", "top_p")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestRejected(f"`seed` must be an integer, got {seed!r}", "seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestRejected(f"`stream` must be true or false, got {stream!r}", "stream")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestRejected(f"`n` must be 1 (this server returns one choice per request), got {n!r}", "n")
    if endpoint == "chat_completion":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(f"`messages` must be a non-empty list of messages, got {messages!r}", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestRejected(
                    f"`messages[{i}]` must be an object with a string `role`, got {message!r}", f"messages[{i}]"
                )
    if endpoint == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestRejected(f"`prompt` must be a non-empty string, got {prompt!r}", "prompt")


def checked_handler(aliases: dict[str, str] | None = None, compression=None):
    """A wrapper for `handle_request(body, request_id)` of transformers' handlers: check_body first, a `model` named
    by one of `aliases` (e.g. 'smollm2') renamed to the model the server holds, and the request's `kv_compress` field
    taken by `compression` (hf_kvcache.paged.serve_compression.ServerCompression; None: the field is refused)."""
    aliases = aliases or {}

    def wrap(handle_request, endpoint: str):
        async def handle(body, request_id):
            check_body(body, endpoint)
            if body.get("model") in aliases:
                body["model"] = aliases[body["model"]]
            if compression is not None:
                compression.take(body, request_id)
            elif "kv_compress" in body:
                raise RequestRejected("`kv_compress`: this server does not evict (no --kv-compress)", "kv_compress")
            try:
                return await handle_request(body, request_id)
            except BaseException:
                if compression is not None:
                    compression.forget(request_id)
                raise

        return handle

    return wrap


def admit(manager, limit: int, label: str, compression=None) -> None:
    """Refuse (RequestRejected, code 'context_length_exceeded') requests needing more than `limit` tokens of pages;
    `label` says what holds them (e.g. '64 MiB of fp8_e4m3 pages'). With prompt eviction (`compression`, a
    ServerCompression) a request needs its peak: its prompt while it prefills (with a chunk, what it keeps + a chunk),
    then what it keeps + max_tokens."""
    add_request = manager.add_request

    def checked_add_request(input_ids, *args, max_new_tokens=None, **kwargs):
        request_id = kwargs.get("request_id", args[0] if args else None)
        new = manager.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        prompt = len(input_ids)
        kept = prompt if compression is None else compression.kept(request_id, prompt)
        peak = prompt if compression is None else compression.peak(request_id, prompt)
        need = max(peak, kept + (new or 0))
        if need > limit:
            forget_result_handler(manager, request_id)
            if compression is not None:
                compression.forget(request_id)
            after = f", {kept} kept after kv_compress," if kept < prompt else ""
            raise RequestRejected(
                f"this request needs {need} tokens of KV cache (a {prompt}-token prompt{after} + max_tokens {new}), "
                f"but the server's KV memory ({label}) holds at most {limit} tokens for one request: shorten the "
                f"prompt or lower `max_tokens`",
                "max_tokens" if prompt < limit else "messages",
                "context_length_exceeded",
            )
        return add_request(input_ids, *args, max_new_tokens=max_new_tokens, **kwargs)

    manager.add_request = checked_add_request
    if compression is not None:
        cancel_request = manager.cancel_request

        def checked_cancel_request(request_id, *args, **kwargs):
            compression.forget(request_id)  # (a request cancelled before its first forward)
            return cancel_request(request_id, *args, **kwargs)

        manager.cancel_request = checked_cancel_request


def admitting(model, limit: int, label: str, compression=None) -> None:
    """Every continuous-batching manager `model` starts from now on refuses requests too long for `limit` (admit)."""
    start = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        manager = start(*args, **kwargs)
        admit(manager, limit, label, compression)
        return manager

    model.init_continuous_batching = init_continuous_batching
