"""`hf-kvcache serve --kv-compress`: prompt eviction for the server's requests (hf_kvcache.paged.eviction), and what a
request may ask for itself.

The server's default comes from `--kv-compress` ("none": nothing evicted unless a request asks). A request may name
its own in the body's `kv_compress` field (the OpenAI client's `extra_body={"kv_compress": "keydiff:budget=0.25"}`,
keeping a quarter of the prompt, hf_kvcache.paged.compress_spec; "none": this request keeps its whole prompt),
validated like the flag: a bad value or a method this model cannot run is an HTTP 400 naming `kv_compress`. A
server started without `--kv-compress` refuses the field (400), since its pages were built without eviction.

Admission counts a request at its peak: its whole prompt while it prefills (eviction happens when the last prompt
chunk has been written; with a `chunk`, what it keeps plus a chunk, CompressSpec.peak), then what it keeps plus
`max_tokens`. A request whose peak exceeds all of the KV memory is refused (400,
hf_kvcache.paged.serve_requests.admit); the scheduler then admits requests as pages are free, so the pool fills with
compressed requests.
"""

from __future__ import annotations

from . import compress_spec, eviction_checks, request_specs
from .compress_spec import FIELD, CompressSpec, parse
from .serve_requests import RequestRejected

_MISSING = object()


class ServerCompression:
    """The server's `--kv-compress` (`default`, None for "none") over the continuous-batching config `cb_config` of a
    model with config `model_config`; `enabled` is False when the server was started without the flag."""

    def __init__(self, cb_config, default: CompressSpec | None, model_config, enabled: bool = True):
        self.cb_config, self.default, self.model_config, self.enabled = cb_config, default, model_config, enabled
        request_specs.request_specs(cb_config)  # named on the config now, before transformers copies it into a manager

    def take(self, body: dict, request_id: str) -> None:
        """Read (and remove) a request's `kv_compress` field; register its spec for `request_id`. Raises
        RequestRejected naming the field."""
        value = body.pop(FIELD, _MISSING)
        if value is _MISSING:
            return
        if not self.enabled:
            raise RequestRejected(
                f"`{FIELD}`: this server was started without --kv-compress, so its pages do not evict; start it with "
                "--kv-compress none to let requests choose, or drop the field",
                FIELD,
            )
        try:
            spec = eviction_checks.for_model(parse(value), self.model_config)
            eviction_checks.check_model(spec, self.model_config, compress_spec.layout_of(self.cb_config))
        except ValueError as error:
            raise RequestRejected(str(error), FIELD) from None
        request_specs.set_request_spec(self.cb_config, request_id, spec)

    def spec_of(self, request_id) -> CompressSpec | None:
        return request_specs.request_specs(self.cb_config).get(request_id, self.default)

    def kept(self, request_id, prompt: int) -> int:
        """Prompt tokens request `request_id` keeps after its prefill."""
        spec = self.spec_of(request_id)
        return prompt if spec is None else spec.kept(prompt)

    def peak(self, request_id, prompt: int) -> int:
        """Prompt tokens request `request_id` holds at most while it prefills (CompressSpec.peak)."""
        spec = self.spec_of(request_id)
        return prompt if spec is None else spec.peak(prompt)

    def forget(self, request_id) -> None:
        request_specs.forget_request_spec(self.cb_config, request_id)

    @property
    def layout(self) -> str:
        """How the pages lay out what requests keep (`kv_compress_layout`: "token" or "head")."""
        return compress_spec.layout_of(self.cb_config)

    def label(self) -> str:
        return "none" if self.default is None else self.default.label()
