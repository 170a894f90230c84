"""What `hf-kvcache serve-bench` runs: its settings (validated), the page formats, the requests, and the
continuous-batching config of one run.

Workload: `requests` prompts cut from the offline corpus (pydoc topics) at distinct offsets (overlapping windows
when the corpus is shorter than requests x the longest prompt), with prompt lengths
and generation lengths drawn (seeded) from [prompt_min, prompt_max] and [new_min, new_max]. All requests are
submitted at once; the KV memory budget is `budget_tokens` tokens of the whole model in the model's dtype
(`num_blocks = budget_tokens / page_size`, so every format gets the same bytes: quantized pages hold more tokens).

Formats: "model" (pages in the model's dtype: the reference, always first) or a page dtype of
hf_kvcache.paged.spec.KV_DTYPES with optional `:ROTATION` (key rotation) and `:SCALE_DTYPE` suffixes
(`parse_format`). Invalid settings raise ValueError naming the setting and what it accepts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..common.rotation import ROTATIONS
from ..paged.compress_spec import parse as parse_compression
from ..paged.spec import ATTENTION_PATHS, KV_DTYPES, PagedKVSpec

SCALE_DTYPE_NAMES = ("bfloat16", "float16", "float32", "e8m0")

DEFAULT_FORMATS = ("model", "fp8_e4m3", "int8")


@dataclass
class ServeBenchSettings:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    device: str = "cpu"
    # default sweep: memory-bound at every budget, with requests waiting for a steady state of dozens of forwards
    # (model-dtype pages hold ~20-35 requests, FP8 pages ~40-65)
    requests: int = 384
    prompt_min: int = 8
    prompt_max: int = 32
    new_min: int = 8
    new_max: int = 24
    budget_tokens: int = 1024
    budget_scales: tuple[float, ...] = (0.75, 1.0, 1.25)
    page_size: int = 16
    max_batch_tokens: int = 1024
    formats: tuple[str, ...] = DEFAULT_FORMATS
    # prompt eviction of each format's runs (hf_kvcache.paged.compress_spec): "none" first (the reference)
    kv_compress: tuple[str, ...] = ("none",)
    kl_requests: int = 8
    rounds: int = 1
    seed: int = 0
    threads: int | None = None
    out: str = "eval/results/serve_bench"

    def __post_init__(self):
        for name in (
            "requests",
            "prompt_min",
            "prompt_max",
            "new_min",
            "new_max",
            "budget_tokens",
            "page_size",
            "max_batch_tokens",
            "rounds",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.prompt_min > self.prompt_max:
            raise ValueError(f"`prompt_min` ({self.prompt_min}) must be <= `prompt_max` ({self.prompt_max}).")
        if self.new_min > self.new_max:
            raise ValueError(f"`new_min` ({self.new_min}) must be <= `new_max` ({self.new_max}).")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.split(":")[0] == "cuda"):
            raise ValueError(f"`device` must be 'cpu' or 'cuda' / 'cuda:N', got {self.device!r}.")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"`dtype` must be one of ('bfloat16', 'float16', 'float32'), got {self.dtype!r}.")
        if not self.formats or self.formats[0] != "model":
            raise ValueError(f"`formats` must start with 'model' (the reference run), got {self.formats!r}.")
        for fmt in self.formats:
            parse_format(fmt)
        if not self.kv_compress or self.kv_compress[0] != "none":
            raise ValueError(f"`kv_compress` must start with 'none' (the reference run), got {self.kv_compress!r}.")
        for value in self.kv_compress:
            setting, layout = split_layout(value)
            spec = parse_compression(setting, "--kv-compress")
            if spec is not None:
                spec.check_layout(layout)
        if not self.budget_scales or any(not s > 0 for s in self.budget_scales) or 1.0 not in self.budget_scales:
            raise ValueError(f"`budget_scales` must be positive and include 1.0, got {self.budget_scales!r}.")
        for scale in self.budget_scales:  # whole pages only: a budget is never rounded to fit
            tokens = self.budget_tokens * scale
            if tokens != int(tokens) or int(tokens) % self.page_size:
                raise ValueError(
                    f"`budget_tokens` x `budget_scales` must be whole multiples of `page_size` ({self.page_size}) "
                    f"tokens: {self.budget_tokens} x {scale} = {tokens:g}."
                )
        if self.kl_requests < 0 or self.kl_requests > self.requests:
            raise ValueError(f"`kl_requests` must be in [0, requests={self.requests}], got {self.kl_requests}.")


def parse_format(name: str) -> tuple[str, dict]:
    """ "model", "fp8_e4m3", "int8", "fp8_e4m3:hadamard" (key rotation), "fp8_e4m3:e8m0" (scale dtype),
    "fp8_e4m3:dequantize" (attention path), "fp8_e4m3:hadamard:e8m0" ... -> (kv_dtype, options)."""
    kv_dtype, *extras = name.split(":")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"format {name!r}: the page dtype must be one of {KV_DTYPES}.")
    options = {}
    for extra in extras:
        if extra in ROTATIONS:
            options["key_rotation"] = extra
        elif extra in SCALE_DTYPE_NAMES:
            options["scale_dtype"] = extra
        elif extra in ATTENTION_PATHS:
            options["attention"] = extra
        else:
            raise ValueError(
                f"format {name!r}: {extra!r} is neither a key rotation {ROTATIONS}, a scale dtype "
                f"{SCALE_DTYPE_NAMES} nor an attention path {ATTENTION_PATHS}."
            )
    if kv_dtype == "model":
        if options:
            raise ValueError(f"format {name!r}: model-dtype pages take no options.")
        return kv_dtype, {}
    PagedKVSpec(kv_dtype=kv_dtype, **options)
    return kv_dtype, options


def make_workload(tokenizer, settings: ServeBenchSettings) -> tuple[list[list[int]], list[int]]:
    """(prompts, generation lengths): distinct corpus offsets, seeded lengths."""
    from ..sharing.corpus import load_tokens

    rng = random.Random(settings.seed)
    ids = load_tokens(tokenizer)[0].tolist()
    # apart by the longest prompt and a margin where the corpus is long enough; otherwise spread evenly over it
    # (long prompts then overlap: each request still starts at its own offset)
    stride = min(settings.prompt_max + 64, (len(ids) - settings.prompt_max) // settings.requests)
    if stride < 1:
        raise ValueError(
            f"`prompt_max` ({settings.prompt_max}) x `requests` ({settings.requests}): the corpus has {len(ids)} tokens"
        )
    prompts, lengths = [], []
    for i in range(settings.requests):
        n = rng.randint(settings.prompt_min, settings.prompt_max)
        prompts.append(ids[i * stride : i * stride + n])
        lengths.append(rng.randint(settings.new_min, settings.new_max))
    return prompts, lengths


def run_label(fmt: str, compress: str) -> str:
    """A run's name: its page format, and its prompt eviction unless "none" (e.g. "fp8_e4m3+keydiff:budget=0.25")."""
    return fmt if compress == "none" else f"{fmt}+{compress}"


def split_layout(compress: str) -> tuple[str, str]:
    """A `kv_compress` setting of the benchmark, SPEC or SPEC@LAYOUT (e.g. "kvzap:budget=0.25@head": pages of one
    layer and KV head, hf_kvcache.paged.head_pages) -> (SPEC, layout)."""
    from ..paged.page_layout import LAYOUTS, default_layout

    setting, at, layout = compress.partition("@")
    if at and layout not in LAYOUTS:
        raise ValueError(f"`kv_compress` {compress!r}: the layout after '@' must be one of {LAYOUTS}.")
    return setting, layout or default_layout()


def configurations(settings: ServeBenchSettings) -> list[tuple[str, str]]:
    """(format, kv_compress) of every run at a budget, the reference ("model", "none") first."""
    return [(fmt, compress) for fmt in settings.formats for compress in settings.kv_compress]


def continuous_batching_config(
    settings: ServeBenchSettings, budget_tokens: int, kv_dtype: str, options: dict, compress: str = "none"
):
    """transformers' ContinuousBatchingConfig of one run: `budget_tokens` model-dtype tokens of pages (the same
    bytes for every format), `kv_dtype` pages with `options` (parse_format), prompt eviction `compress`, no block
    sharing, no async batching."""
    from ..integration.continuous_batching import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(
        num_blocks=budget_tokens // settings.page_size,
        page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens,
        allow_block_sharing=False,
        use_async_batching=False,
        max_blocks_per_request=0,
    )
    cb.kv_cache_dtype = kv_dtype
    cb.kv_cache_quantization = options or None
    if compress != "none":
        cb.kv_compress, cb.kv_compress_layout = split_layout(compress)
    return cb
