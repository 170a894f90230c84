"""`hf-kvcache serve`: transformers' own OpenAI-compatible server (`transformers serve`) with quantized KV pages and a
KV memory budget. Nothing here is a second HTTP server: hf_kvcache.integration.serving builds transformers' `Serve`
(FastAPI + uvicorn, its endpoints and continuous batching) and this module adds what it lacks:

- **the page format**: `kv_cache_dtype` / `kv_cache_quantization` on the server's ContinuousBatchingConfig
  (hf_kvcache.paged.spec), so its continuous batching builds our QuantizedPagedAttentionCache;
- **the KV memory**: `num_blocks` computed from the bytes given (`plan_memory`: the cache is built on the meta
  device for the chosen format and for model-dtype pages, so the figures printed at start are the ones the run
  gets);
- **admission and checks** (hf_kvcache.paged.serve_requests): HTTP 400 naming the field for bad values, and for a
  request that needs more pages than the memory holds;
- **prompt eviction** (`--kv-compress`, a request's `kv_compress` field: hf_kvcache.paged.serve_compression);
- **GET /v1/kv_cache**: the format, the pages held by requests and in all, requests holding pages and waiting, and
  what eviction did (what the load tests and `eval/bench_serve_http.py` read).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..integration import serving
from ..integration.continuous_batching import (
    ContinuousBatchingConfig,
    batch_processor,
    cache_on_meta,
    model_dtype_block_bytes,
    pages_in_use,
    request_counts,
)
from . import compress_spec, eviction_checks
from .cache import QuantizedPagedAttentionCache, install
from .serve_compression import ServerCompression
from .serve_requests import RequestRejected, admitting, checked_handler
from .spec import DTYPE_FIELD, OPTIONS_FIELD, PagedKVSpec

DEFAULT_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig.page_size


@dataclass(frozen=True)
class MemoryPlan:
    """What `kv_memory` bytes of pages hold, for the chosen format and for model-dtype pages."""

    kv_memory: int
    kv_dtype: str  # "model" or a format of hf_kvcache.paged.spec.KV_DTYPES
    model_dtype: str
    page_size: int
    num_blocks: int  # transformers' num_blocks: whole-model blocks of model-dtype pages in kv_memory
    tokens: int  # tokens the chosen pages hold (one request may use them all)
    model_dtype_tokens: int

    def requests(self, tokens_per_request: int, tokens: int | None = None) -> int:
        """Requests of `tokens_per_request` tokens (prompt + output) the pages hold at once."""
        pages = -(-tokens_per_request // self.page_size)
        return (self.tokens if tokens is None else tokens) // (pages * self.page_size)

    def lines(self, tokens_per_request: int) -> list[str]:
        rows = [(f"{self.kv_dtype} pages", self.tokens)] if self.kv_dtype != "model" else []
        rows.append((f"model-dtype ({self.model_dtype}) pages", self.model_dtype_tokens))
        width = max(len(name) for name, _ in rows)
        out = [f"KV memory {self.kv_memory / 2**20:,.1f} MiB in pages of {self.page_size} tokens holds:"]
        for i, (name, tokens) in enumerate(rows):
            mark = "   <- serving" if i == 0 else ""
            out.append(
                f"  {name:<{width}}  {tokens:>10,} tokens = {self.requests(tokens_per_request, tokens):,} "
                f"requests of {tokens_per_request:,} tokens{mark}"
            )
        return out


def page_config(kv_dtype: str, options: dict | None, page_size: int, num_blocks: int, base=None):
    """The ContinuousBatchingConfig fields of a run: `base` (transformers' own, from the --cb-* flags) or a new one,
    with our page format and `num_blocks`."""
    spec = PagedKVSpec.from_fields(kv_dtype, options)  # validates (errors name the field)
    config = base if base is not None else ContinuousBatchingConfig()
    config.page_size = page_size
    config.num_blocks = num_blocks
    setattr(config, DTYPE_FIELD, None if spec is None else spec.kv_dtype)
    setattr(
        config, OPTIONS_FIELD, None if spec is None else {k: v for k, v in spec.to_dict().items() if k != "kv_dtype"}
    )
    return config


def plan_memory(
    model, kv_memory: int, kv_dtype: str = "fp8_e4m3", options: dict | None = None, page_size: int = DEFAULT_PAGE_SIZE
) -> MemoryPlan:
    """transformers' `num_blocks` for `kv_memory` bytes, and the tokens the pages then hold (measured on caches
    built on the meta device). Raises ValueError naming --kv-memory when not one page fits."""
    config = model.config.get_text_config()
    bytes_per_block = model_dtype_block_bytes(config, model.dtype, page_size)
    num_blocks = kv_memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"--kv-memory: {kv_memory:,} bytes hold no page: one page of {page_size} tokens for every "
            f"layer takes {bytes_per_block:,} bytes in {model.dtype} (--cb-block-size sets the page)"
        )
    tokens = {}
    for name in dict.fromkeys(("model", kv_dtype)):
        cb = page_config(name, options if name != "model" else None, page_size, num_blocks)
        tokens[name] = cache_on_meta(QuantizedPagedAttentionCache, config, cb, model.dtype).tokens_capacity()
    return MemoryPlan(
        kv_memory=kv_memory,
        kv_dtype=kv_dtype,
        model_dtype=str(model.dtype).removeprefix("torch."),
        page_size=page_size,
        num_blocks=num_blocks,
        tokens=tokens[kv_dtype],
        model_dtype_tokens=tokens["model"],
    )


def kv_cache_state(serve, plan: MemoryPlan, compression: ServerCompression | None = None) -> dict:
    """GET /v1/kv_cache: the plan, and (once the first request started continuous batching) the pages held by
    requests and in all, the requests holding pages and waiting, and how attention reads the pages ("codes",
    "dequantize" or "model": QuantizedPagedAttentionCache.attention_path). With --kv-compress: the server's default
    (`kv_compress`) and what eviction did so far (`eviction`: requests whose prompt ended, of them compressed, tokens
    prefilled, tokens kept, pages freed: hf_kvcache.paged.eviction.EvictionStats)."""
    state = {
        "kv_cache_dtype": plan.kv_dtype,
        "page_size": plan.page_size,
        "kv_memory_bytes": plan.kv_memory,
        "tokens_capacity": plan.tokens,
        "started": False,
        "pages_total": None,
        "pages_in_use": None,
        "requests_active": 0,
        "requests_waiting": 0,
        "attention_path": None,
        "kv_compress": None if compression is None else compression.label(),
        "kv_compress_layout": None if compression is None else compression.layout,
        "eviction": None,
    }
    manager = serving.running_manager(serve)
    processor = None if manager is None else batch_processor(manager)
    if processor is not None:
        held, total = pages_in_use(processor)
        active, waiting = request_counts(processor)
        state.update(
            started=True,
            pages_total=total,
            pages_in_use=held,
            requests_active=active,
            requests_waiting=waiting,
            attention_path=getattr(processor.cache, "attention_path", "model"),
        )
        evicting = getattr(processor.cache, "eviction", None)
        if evicting is not None:
            state["eviction"] = evicting.stats.to_dict()
    return state


def add_routes(serve, plan: MemoryPlan, compression: ServerCompression | None = None) -> None:
    """Our error shape for RequestRejected and GET /v1/kv_cache on the server's FastAPI app."""
    from fastapi.responses import JSONResponse

    app = serving.app(serve)

    async def rejected(_request, error: RequestRejected):
        return JSONResponse(error.payload(), status_code=400)

    app.add_exception_handler(RequestRejected, rejected)

    def state():
        return JSONResponse(kv_cache_state(serve, plan, compression))

    app.add_api_route("/v1/kv_cache", state, methods=["GET"])


def build_server(
    model_path: str,
    kv_dtype: str,
    kv_memory: int,
    options: dict | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    serve_options: dict | None = None,
    alias: str | None = None,
    kv_compress=None,
    kv_layout: str | None = None,
):
    """transformers' server for `model_path` with `kv_dtype` pages in `kv_memory` bytes, wired and not started:
    (serve, plan). `serving.run(serve)` serves. Requests may name the model `alias` (e.g. 'smollm2') as well as
    `model_path`. `kv_compress` (hf_kvcache.paged.compress_spec; "none": only requests that ask; None: no eviction)
    evicts prompt tokens at the end of each prefill (hf_kvcache.paged.serve_compression), the kept tokens laid out in
    the pages by `kv_layout` (compress_spec.LAYOUTS; None: the default)."""
    PagedKVSpec.from_fields(kv_dtype, options)  # bad settings fail before the model loads
    default = compress_spec.parse(kv_compress, "--kv-compress")
    install()
    serve = serving.build_serve(force_model=model_path, cb_num_blocks=1, **(serve_options or {}))
    model = serving.served_model(serve)
    plan = plan_memory(model, kv_memory, kv_dtype, options, page_size)
    cb_config = serving.continuous_batching_config(serve)
    page_config(kv_dtype, options, page_size, plan.num_blocks, base=cb_config)
    compression = None
    if kv_layout is not None and kv_compress is None:
        raise ValueError("--kv-layout lays out what eviction keeps: give --kv-compress too (e.g. none)")
    if kv_compress is not None:
        setattr(cb_config, compress_spec.LAYOUT_FIELD, kv_layout or compress_spec.default_layout())
        try:
            layout = compress_spec.layout_of(cb_config)
            eviction_checks.check_model(default, model.config.get_text_config(), layout)
        except ValueError as error:
            raise ValueError(f"--kv-compress: {error}") from None
        default = eviction_checks.for_model(default, model.config.get_text_config())  # (no method named: the model's)
        setattr(cb_config, compress_spec.FIELD, compress_spec.NONE if default is None else default.to_dict())
        compression = ServerCompression(cb_config, default, model.config.get_text_config())
    label = f"{kv_memory / 2**20:,.1f} MiB of {kv_dtype if kv_dtype != 'model' else plan.model_dtype} pages"
    admitting(model, plan.tokens, label, compression)
    serving.wrap_handlers(serve, checked_handler({alias: model_path} if alias else None, compression))
    add_routes(serve, plan, compression)
    return serve, plan
