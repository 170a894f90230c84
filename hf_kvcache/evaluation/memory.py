"""Bytes actually held by a cache: ours report it themselves; for any other transformers cache we walk its layers'
tensors (quantized tensor subclasses included, via their inner tensors), counting each storage once."""

from __future__ import annotations

import torch

from ..common.architecture import COMPRESSED_TYPE, attention_head_dim, kv_head_count, layer_kv_shape, layer_plan
from ..integration.cache_argument import cache_kwargs


def _tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    if depth > 6 or obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen, depth + 1) for n in names)
        if obj.device.type == "meta":
            return 0
        key = (obj.untyped_storage().data_ptr(), obj.device)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def cache_nbytes(cache) -> int:
    """Bytes held by `cache`: `cache.nbytes()` when it has one (ours), else the sum of its layers' tensor storages."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    seen: set = set()
    return sum(_tensor_bytes(layer, seen) for layer in getattr(cache, "layers", []))


# ---------------------------------------------------------------------------------------------------------------------
# The standard calculator, layer by layer: a layer holding every token costs 2 (K and V) x KV heads x head_dim x bytes
# per value per token, where a quantized value costs bits / 8 plus its share of the per-group scale (and zero point,
# when asymmetric); a sliding-window layer holds at most its window, a KV-sharing or linear-attention layer nothing
# (its recurrent / convolution state is not a KV cache), a latent-attention layer its latent and RoPE part.
# ---------------------------------------------------------------------------------------------------------------------
import dataclasses  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's keys and values: KV heads and head_dim (`value_dim`: the values' own size, when it differs:
    a latent-attention layer caches its latent as keys and the keys' RoPE part as values), the most tokens it holds
    (`window`: a sliding / chunked layer; None: every token) and whether it is a full-attention layer, the kind our
    caches compress (a token budget applies to it)."""

    kv_heads: int
    head_dim: int
    window: int | None = None
    compressed: bool = True
    value_dim: int | None = None

    @property
    def values_per_token(self) -> int:
        """Cached values (keys and values together) per token."""
        return self.kv_heads * (self.head_dim + (self.head_dim if self.value_dim is None else self.value_dim))

    def tokens(self, total: int, kept: int | None = None) -> int:
        """Tokens this layer holds after `total` tokens when a compressed layer keeps `kept` (None: every one)."""
        if self.window is not None:
            return min(total, self.window)
        return total if kept is None or not self.compressed else min(total, kept)


@dataclass(frozen=True)
class KVShape:
    """What sizes a KV cache: layers, KV heads (GQA), head dimension (those of the layers our caches compress);
    `params_b` (billions) sizes the weights. `layer_kv`, when given, is every layer holding keys, one `LayerKV`
    each (hybrid models: sliding-window layers next to full ones, layers of their own head size); None means
    `layers` full-attention layers of one shape."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_b: float | None = None
    layer_kv: tuple[LayerKV, ...] | None = None

    def kv_layers(self) -> tuple[LayerKV, ...]:
        return self.layer_kv if self.layer_kv is not None else (LayerKV(self.kv_heads, self.head_dim),) * self.layers


def _latent(name: str, layers: int, kv_lora_rank: int, rope_dim: int, params_b: float) -> KVShape:
    """A published latent-attention (MLA) model: every layer caches its latent (`kv_lora_rank`) and the keys' RoPE
    part, one "head" of each, whatever its attention heads (DeepSeek-V3 / R1, Kimi K2)."""
    return KVShape(name, layers, 1, kv_lora_rank, params_b, (LayerKV(1, kv_lora_rank, value_dim=rope_dim),) * layers)


def _hybrid(
    name: str, layers: int, kv_heads: int, head_dim: int, params_b: float, window: int, full_every: int
) -> KVShape:
    """A published sliding / full hybrid: layer i is full attention when (i + 1) % full_every == 0, else a sliding
    window (Gemma 2 and GPT-OSS: every second layer; Gemma 3: every sixth), all of one KV shape."""
    return KVShape(
        name,
        layers,
        kv_heads,
        head_dim,
        params_b,
        tuple(
            LayerKV(kv_heads, head_dim) if (i + 1) % full_every == 0 else LayerKV(kv_heads, head_dim, window, False)
            for i in range(layers)
        ),
    )


@dataclass(frozen=True)
class Precision:
    """`bits` per stored value; with `group_size`, one `scale_bits` scale (and a zero point if `zero_point`) per
    group of that many values."""

    name: str
    bits: float
    group_size: int | None = None
    scale_bits: int = 16
    zero_point: bool = False

    @property
    def bytes_per_value(self) -> float:
        extra = 0.0
        if self.group_size:
            extra = self.scale_bits * (2 if self.zero_point else 1) / self.group_size
        return (self.bits + extra) / 8


#: published model shapes (config.json of each model; the hybrids' layer pattern as their configs' layer_types; params:
#: the text model's; DeepSeek-V3's cache as transformers' holds it: the latent and RoPE part, 576 values a layer)
SHAPES: dict[str, KVShape] = {
    s.name: s
    for s in (
        KVShape("llama-2-7b", 32, 32, 128, 6.7),
        KVShape("llama-2-13b", 40, 40, 128, 13.0),
        KVShape("llama-3-8b", 32, 8, 128, 8.0),
        KVShape("llama-3-70b", 80, 8, 128, 70.6),
        KVShape("mistral-7b", 32, 8, 128, 7.2),
        KVShape("qwen2.5-7b", 28, 4, 128, 7.6),
        KVShape("qwen3-8b", 36, 8, 128, 8.2),
        KVShape("smollm2-135m", 30, 3, 64, 0.135),
        KVShape("smollm2-1.7b", 24, 32, 64, 1.7),
        _hybrid("gemma-2-9b", 42, 8, 256, 9.2, window=4096, full_every=2),
        _hybrid("gemma-3-12b", 48, 8, 256, 11.8, window=1024, full_every=6),
        _hybrid("gemma-3-27b", 62, 16, 128, 27.0, window=1024, full_every=6),
        _hybrid("gpt-oss-20b", 24, 8, 64, 20.9, window=128, full_every=2),
        _hybrid("gpt-oss-120b", 36, 8, 64, 116.8, window=128, full_every=2),
        _latent("deepseek-v3", 61, kv_lora_rank=512, rope_dim=64, params_b=671.0),
    )
}

PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 32),
        Precision("fp16", 16),
        Precision("bf16", 16),
        Precision("fp8", 8),
        Precision("int8-g64", 8, 64),
        Precision("int4-g64", 4, 64),
        Precision("int4-g32-asym", 4, 32, zero_point=True),
        Precision("int2-g32-asym", 2, 32, zero_point=True),
    )
}

#: layer types that hold no keys and values (KV-sharing consumers, linear attention / convolution states)
NO_KV_TYPES = ("dummy", "conv", "linear_attention")


def shape_from_config(config, name: str | None = None, params_b: float | None = None) -> KVShape:
    """The KV shape of any transformers decoder config, layer by layer as its caches hold keys (GQA and explicit
    `head_dim` included): a layer our caches compress (full attention) holds every token, a sliding / chunked one at
    most its window, a KV-sharing or linear-attention layer nothing, any other layer type every token; each layer at
    its own KV heads and head_dim (Gemma 4), a latent-attention layer (MLA) as the latent and RoPE part it caches.
    `kv_heads` / `head_dim` are those of the compressed layers' attention."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_kv = []
    for index, (layer_type, kwargs) in enumerate(zip(*layer_plan(config))):
        if layer_type in NO_KV_TYPES:
            continue
        heads, key_dim, value_dim = layer_kv_shape(config, index)
        window = None if layer_type == COMPRESSED_TYPE else kwargs.get("sliding_window")
        layer_kv.append(
            LayerKV(heads, key_dim, window, layer_type == COMPRESSED_TYPE, None if value_dim == key_dim else value_dim)
        )
    return KVShape(
        name or getattr(config, "model_type", "model"),
        config.num_hidden_layers,
        kv_head_count(config),
        attention_head_dim(config),
        params_b,
        tuple(layer_kv),
    )


def is_model_reference(shape: str) -> bool:
    """Whether `shape` names a model's config rather than a published shape: a Hub id (`org/name`) or a local
    directory holding a config.json."""
    import os

    return "/" in shape or os.path.isfile(os.path.join(shape, "config.json"))


def shape_from_pretrained(name_or_path: str) -> KVShape:
    """The shape of a Hub model or a local checkpoint directory, from its config.json (`AutoConfig`; the Hub id
    needs the network once, then the local Hub cache), its parameter count from the model built on the meta device
    (no weights are read)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(name_or_path)
    shape = shape_from_config(config, name_or_path)
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel"):  # a VLM's whole model
        try:
            with torch.device("meta"):
                model = getattr(transformers, auto).from_config(config)
        except ValueError:  # no class of this kind for the config
            continue
        return dataclasses.replace(shape, params_b=sum(p.numel() for p in model.parameters()) / 1e9)
    return shape


def get_shape(shape) -> KVShape:
    if isinstance(shape, KVShape):
        return shape
    if isinstance(shape, str):
        if shape in SHAPES:
            return SHAPES[shape]
        if is_model_reference(shape):
            return shape_from_pretrained(shape)
        raise ValueError(
            f"Unknown model shape {shape!r}; known shapes are {sorted(SHAPES)}, or a Hub model id "
            "(org/name) or a local directory with a config.json (or pass a config)."
        )
    return shape_from_config(shape)


def get_precision(precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; known precisions are {list(PRECISIONS)}.")
    return PRECISIONS[precision]


def bytes_per_token(shape, precision="fp16") -> float:
    """Bytes one more token costs once every window is full: 2 x KV heads x head_dim x bytes per value (scales
    included), summed over the layers that hold every token (all of them, for a model of full-attention layers:
    2 x layers x KV heads x head_dim x bytes per value)."""
    s, p = get_shape(shape), get_precision(precision)
    return sum(layer.values_per_token for layer in s.kv_layers() if layer.window is None) * p.bytes_per_value


def kv_cache_bytes(shape, precision="fp16", tokens: int = 1, batch: int = 1, kept: int | None = None) -> float:
    """Bytes of keys and values after `tokens` tokens, layer by layer (`LayerKV.tokens`): a sliding-window layer
    holds at most its window; with `kept`, the compressed layers hold at most that many (a cache's token budget).
    `shape`: a published name, a `KVShape` or a model config (`shape_from_config`)."""
    s, p = get_shape(shape), get_precision(precision)
    per_batch = sum(layer.values_per_token * layer.tokens(tokens, kept) for layer in s.kv_layers())
    return per_batch * p.bytes_per_value * batch


def max_concurrent_requests(
    memory_bytes: float,
    shape,
    precision="fp16",
    context: int = 8192,
    reserved_bytes: float = 0.0,
    budget_tokens: int | None = None,
) -> int:
    """How many requests of `context` tokens fit in `memory_bytes` after `reserved_bytes` (e.g. the weights); a
    compressed cache holding at most `budget_tokens` per request needs only that many."""
    per_request = kv_cache_bytes(shape, precision, context, kept=budget_tokens)
    if per_request <= 0:
        raise ValueError(
            f"{get_shape(shape).name} holds no keys and values (no attention layer keeps a KV cache): "
            "no KV-cache bound on its concurrent requests."
        )
    return max(0, int((memory_bytes - reserved_bytes) // per_request))


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def memory_table(
    shapes=("llama-3-8b", "llama-3-70b"), precisions=("fp16", "fp8", "int4-g64"), contexts=(8192, 32768, 131072)
) -> list[dict]:
    """Rows {model, precision, bytes_per_token, tokens, bytes} for every combination (bytes layer by layer, so a
    hybrid model's are not bytes_per_token x tokens)."""
    rows = []
    for shape in shapes:
        s = get_shape(shape)
        for precision in precisions:
            per_token = bytes_per_token(s, precision)
            for tokens in contexts:
                rows.append(
                    {
                        "model": s.name,
                        "precision": get_precision(precision).name,
                        "bytes_per_token": per_token,
                        "tokens": tokens,
                        "bytes": kv_cache_bytes(s, precision, tokens),
                    }
                )
    return rows


def concurrency_table(
    shape="llama-3-8b",
    memory_bytes: float = 80e9,
    weight_bits: int = 16,
    precisions=("fp16", "fp8", "int4-g64"),
    contexts=(8192, 32768, 131072),
    budgets=(None, 4096, 1024),
) -> list[dict]:
    """Max concurrent requests in `memory_bytes` once the weights (`params_b` x `weight_bits`) are loaded, for full
    and budgeted caches."""
    s = get_shape(shape)
    weights = (s.params_b or 0.0) * 1e9 * weight_bits / 8
    rows = []
    for precision in precisions:
        for context in contexts:
            for budget in budgets:
                if budget is not None and budget >= context:
                    continue
                rows.append(
                    {
                        "model": s.name,
                        "precision": get_precision(precision).name,
                        "context": context,
                        "budget": "full" if budget is None else budget,
                        "memory_bytes": memory_bytes,
                        "weights_bytes": weights,
                        "requests": max_concurrent_requests(memory_bytes, s, precision, context, weights, budget),
                    }
                )
    return rows


def format_rows(rows: list[dict], columns: list[tuple[str, str]] | None = None) -> str:
    """A plain-text table; byte columns (names containing "bytes") are shown in binary units."""
    if not rows:
        return "(no rows)"
    columns = columns or [(k, k) for k in rows[0]]
    cells = [[h for _, h in columns]]
    for r in rows:
        line = []
        for key, _ in columns:
            v = r.get(key, "")
            if "bytes" in key and isinstance(v, (int, float)):
                v = format_bytes(v)
            elif isinstance(v, float):
                v = f"{v:.4g}"
            line.append(str(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = ["  ".join(c.rjust(w) for c, w in zip(cells[0], widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells[1:]]
    return "\n".join(out)


def expected_tokens(config: dict, context: int) -> int:
    """Tokens a cache with this (resolved) config keeps after `context` tokens: its budget, or all of them."""
    if "budget" in config and config["budget"] is not None:
        return min(context, int(config["budget"]))
    parts = [config.get(k) for k in ("sinks", "window", "heavy", "recent") if isinstance(config.get(k), int)]
    if parts and any(config.get(k) is not None for k in ("window", "heavy", "recent")):
        return min(context, sum(parts))
    return context


def measured_vs_theory(model, specs, input_ids, decode_tokens: int = 8, prefill_chunk: int | None = None) -> list[dict]:
    """For each `(label, name, config)`: prefill `input_ids` minus `decode_tokens`, decode the rest one token per
    forward, then report the bytes the cache holds (`cache_nbytes`) next to the calculator's figure for the tokens
    it should keep at the model's dtype (buffers, trash slots and metadata make up the difference)."""
    from .cache_spec import make_cache, resolve_config
    from .divergence import prefill

    ids = input_ids.reshape(1, -1)
    n = ids.shape[1]
    dtype = next(model.parameters()).dtype
    precision = Precision(str(dtype).replace("torch.", ""), torch.finfo(dtype).bits)
    shape = shape_from_config(model.config)  # layer by layer: a hybrid model's sliding layers hold their window
    rows = []
    for label, name, config in specs:
        resolved = resolve_config(name, config, n)
        cache = make_cache(model, name, config, context_len=n, total_len=n)
        with torch.inference_mode():
            prefill(model, ids[:, : n - decode_tokens], cache, prefill_chunk)
            for t in range(n - decode_tokens, n):
                model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
        held = cache_nbytes(cache)
        tokens = expected_tokens(resolved, n)
        theory = kv_cache_bytes(shape, precision, n, kept=tokens)
        rows.append(
            {
                "cache": label,
                "tokens_seen": n,
                "tokens_kept": tokens,
                "theory_bytes": theory,
                "measured_bytes": held,
                "measured_over_theory": held / theory,
                "dense_bytes": kv_cache_bytes(shape, precision, n),
            }
        )
    return rows
