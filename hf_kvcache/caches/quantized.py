"""Quantized keep-all caches: QuantizedFP8Cache ("fp8") and KIVICache ("kivi").

    cache = QuantizedFP8Cache(model)                                        # E4M3, one scale per token and KV head
    cache = QuantizedFP8Cache(model, key={"format": "int8"})                # keys INT8 (they carry most of the error)
    cache = QuantizedFP8Cache(model, granularity="head", scales=calibrate(model, tokenizer))   # static scales
    cache = KIVICache(model, bits=4, group_size=32, residual=128)           # keys per channel, values per token
    model.generate(**inputs, cache_implementation="fp8", cache_config={"residual": 64, "key_smoothing": True})

Every token is kept (KeepAllPolicy) in a `QuantizedStore` per layer (hf_kvcache.stores.quantized): tokens are
quantized once, when they leave the optional full-precision residual of the most recent `residual` tokens, and never
re-quantized. Attention reads dequantize into one workspace shared by all layers, so the memory held is the
quantized cache plus one layer in the model's dtype (`workspace_nbytes()`), not a full-precision copy per layer.
With `attention="blockwise"` attention reads the codes block by block instead (hf_kvcache.layers.codes_read,
docs/blockwise_attention.md) and the workspace stays empty; the default "auto" does so on CUDA (the Triton kernel)
and in CPU decode steps (the native kernel), and dequantizes for CPU prefill chunks.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from ..common.architecture import attention_head_dim, is_latent_attention, kv_head_count, refuse_latent
from ..common.rotation import ROTATIONS, rotation_matrix
from ..common.validation import check_keys, require_choice, require_int
from ..layers.codes_read import ATTENTION_MODES, attention_option
from ..policies import KeepAllPolicy
from ..stores.quantization import INT_BITS, INT_GRANULARITIES, QuantSpec
from ..stores.quantized import QuantizedStore
from ..stores.workspace import DequantWorkspace
from .base import KVCache

#: keys of a calibration dict (hf_kvcache.sharing.calibration.calibrate) accepted in `scales`
CALIBRATION_KEYS = (
    "format",
    "key_scale",
    "value_scale",
    "key_mean",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "num_tokens",
    "source",
    "margin",
    "version",
    "key_smoothing",
    "key_rotation",
)


def _text_config(config_or_model) -> PretrainedConfig:
    config = config_or_model.config if isinstance(config_or_model, PreTrainedModel) else config_or_model
    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"The first argument must be a transformers model or its config, got {type(config_or_model).__name__}."
        )
    return config.get_text_config(decoder=True)


def model_dims(config) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of a decoder config (KV heads and head_dim of the layers our caches compress)."""
    return config.num_hidden_layers, kv_head_count(config), attention_head_dim(config)


class _QuantizedKeepAllCache(KVCache):
    """Keep-all cache whose layers store keys and values quantized (see the module docstring)."""

    def _build(
        self,
        config_or_model,
        key: QuantSpec,
        value: QuantSpec,
        residual: int,
        key_smoothing: bool,
        scales: dict | None,
        key_rotation: str = "none",
        layers=None,
        max_length: int | None = None,
        fixed_ring: bool = False,
    ) -> None:
        config = _text_config(config_or_model)
        num_layers, kv_heads, head_dim = model_dims(config)
        latent = is_latent_attention(config)
        if not latent:  # latent (MLA) caches: sizes are checked when the first keys arrive
            key.validate_head_dim(head_dim, "key")
            value.validate_head_dim(head_dim, "value")
        residual = require_int("residual", residual, 0)
        if max_length is not None:
            max_length = require_int("max_length", max_length, 1)
            if not fixed_ring and (residual or key.append_only or value.append_only):
                raise ValueError(
                    "`max_length` (a fixed capacity, for torch.compile) needs residual=0 and granularity 'token', "
                    f"'head' or 'tensor' (got residual={residual}, key granularity {key.granularity!r}, value "
                    f"granularity {value.granularity!r})."
                )
        if not isinstance(key_smoothing, bool):
            raise ValueError(f"`key_smoothing` must be a bool, got {key_smoothing!r}.")
        key_rotation = require_choice("key_rotation", key_rotation, ROTATIONS + ("auto",))
        if key_rotation == "auto":
            key_rotation = "none" if latent else "hadamard"
        elif key_rotation != "none":
            refuse_latent(config, "a key rotation that queries undo", "key_rotation", "key_rotation='none' or 'auto'")
        self.rotation_matrix = rotation_matrix(key_rotation, head_dim)
        static = _parse_scales(scales, key, value, key_smoothing, key_rotation, num_layers, kv_heads, head_dim)
        self.key_spec, self.value_spec = key, value
        self.fixed_ring = max_length is not None and (residual > 0 or key.append_only or value.append_only)
        self.workspace = DequantWorkspace()
        workspace = self.workspace

        def layer_parts(cfg):
            store = QuantizedStore(
                key,
                value,
                residual=residual,
                append_only=True,
                key_smoothing=key_smoothing,
                workspace=workspace,
                name=type(self).__name__,
                fixed_slots=max_length is not None,
            )
            return KeepAllPolicy(max_length), store

        super().__init__(config_or_model, layer_parts, layers)
        for i, layer in enumerate(self.layers):
            if not isinstance(getattr(layer, "store", None), QuantizedStore) or layer.store.workspace is not workspace:
                continue  # a layer of another type, or with per-layer settings of its own
            layer.store.layer_idx = i
            layer.key_rotation = self.rotation_matrix  # one matrix shared by the layers
            layer.store.set_static(**{name: values[i] for name, values in static.items()})
            layer.store.tensor_parallel = self.tensor_parallel  # per-head statics sliced to the rank's KV heads

    def nbytes(self) -> int:
        """The layers' bytes plus the shared key rotation matrix (once)."""
        extra = self.rotation_matrix.nbytes if self.rotation_matrix is not None else 0
        return super().nbytes() + (extra if any(layer.is_initialized for layer in self.compressed_layers) else 0)

    def _set_attention(self, config_or_model, attention: str, attention_block: int | None) -> None:
        """The `attention` option of the layers (hf_kvcache.layers.codes_read): "dequantize" (the whole layer into the
        workspace, then SDPA / eager), "blockwise" (block by block straight from the codes: Triton on CUDA, the
        native kernel on CPU, else torch), "auto" (blockwise for keys on CUDA and for eager one-token CPU steps
        when the native kernel builds, else dequantize; always dequantize for latent attention,
        whose model expands the cached latent before attention: "blockwise" is refused there at the first forward).
        `attention_block`: tokens dequantized at a time by the torch path (None: DEFAULT_BLOCK)."""
        self.attention = require_choice("attention", attention, ATTENTION_MODES)
        attention, self.attention_block = attention_option(
            attention, attention_block, is_latent_attention(_text_config(config_or_model))
        )
        if getattr(self, "fixed_ring", False):  # max_length with a residual / token blocks (KIVI): see the store
            if attention == "blockwise":
                raise ValueError(
                    "`attention`='blockwise' does not read the fixed-length ring layout (`max_length` with a "
                    "residual or blocks of tokens: its full-precision tokens sit in a ring); use attention='auto' or "
                    "'dequantize', or drop `max_length`."
                )
            attention = "dequantize"
        for layer in self.layers:
            if isinstance(getattr(layer, "store", None), QuantizedStore) and layer.store.workspace is self.workspace:
                layer.attention, layer.attention_block = attention, self.attention_block

    def workspace_nbytes(self) -> int:
        """Bytes of the shared dequantization workspace (one layer's keys and values in the model's dtype, grown by
        doubling, plus FP8 conversion scratch). Not part of `nbytes()`, which is what the cache stores."""
        return self.workspace.nbytes()

    def reset(self):
        super().reset()
        self.workspace.clear()


def _parse_scales(
    scales,
    key: QuantSpec,
    value: QuantSpec,
    key_smoothing: bool,
    key_rotation: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
) -> dict[str, list]:
    """Per-layer static parameters from a calibration dict: {store argument: [value per layer]}."""
    if scales is None:
        return {}
    if not isinstance(scales, dict):
        raise ValueError(
            "`scales` must be a calibration dict (hf_kvcache.sharing.calibration.calibrate), got "
            f"{type(scales).__name__}."
        )
    check_keys("`scales` (calibration dict)", scales, CALIBRATION_KEYS)
    for name, expected in (("num_layers", layers), ("num_kv_heads", kv_heads), ("head_dim", head_dim)):
        if name in scales and scales[name] != expected:
            raise ValueError(f"`scales` was calibrated for {name}={scales[name]}, this model has {expected}.")
    out: dict[str, list] = {}
    for kind, spec in (("key", key), ("value", value)):
        entry = scales.get(f"{kind}_scale")
        if entry is None or spec.granularity not in ("tensor", "head") or not spec.is_fp8:
            continue
        if scales.get("format") != spec.format:
            raise ValueError(
                f"`scales` holds {kind} scales calibrated for format {scales.get('format')!r}, but {kind}s use "
                f"{spec.format!r}; calibrate with format={spec.format!r}."
            )
        if kind == "key":
            _require_same_setting(scales, "key scales", "key_rotation", key_rotation, "none")
            _require_same_setting(scales, "key scales", "key_smoothing", key_smoothing, False)
        per_layer = _per_layer(entry, f"scales['{kind}_scale']", layers, kv_heads)
        if spec.granularity == "tensor":
            per_layer = [max(heads) for heads in per_layer]
        out[f"{kind}_scale"] = per_layer
    if key_smoothing and scales.get("key_mean") is not None:
        _require_same_setting(scales, "key means", "key_rotation", key_rotation, "none")
        means = scales["key_mean"]
        if not isinstance(means, list) or len(means) != layers:
            raise ValueError(f"scales['key_mean'] must be a list of {layers} per-layer [kv_heads][head_dim] lists.")
        for i, m in enumerate(means):
            if len(m) != kv_heads or any(len(h) != head_dim for h in m):
                raise ValueError(f"scales['key_mean'][{i}] must be [{kv_heads}][{head_dim}].")
        out["key_mean"] = means
    if not out:
        raise ValueError(
            "`scales` was given but nothing uses it: static scales apply to FP8 'tensor' or 'head' granularity, "
            "key means to key_smoothing=True."
        )
    return out


def _require_same_setting(scales: dict, what: str, setting: str, value: Any, default: Any) -> None:
    """Calibrated key statistics only fit a cache that transforms keys the same way (smoothing, rotation)."""
    recorded = scales.get(setting, default)
    if type(default) is bool:
        recorded = bool(recorded)
    if recorded != value:
        raise ValueError(
            f"`scales` holds {what} calibrated with {setting}={recorded!r}, but the cache has {setting}={value!r}: "
            "the key ranges differ; calibrate with the same setting."
        )


def _per_layer(entry: Any, where: str, layers: int, heads: int) -> list[list[float]]:
    if not isinstance(entry, list) or len(entry) != layers:
        raise ValueError(f"{where} must be a list of {layers} per-layer lists of {heads} per-head scales.")
    out = []
    for i, row in enumerate(entry):
        row = [row] if isinstance(row, (int, float)) else row
        if not isinstance(row, list) or len(row) != heads or not all(isinstance(v, (int, float)) for v in row):
            raise ValueError(f"{where}[{i}] must be a list of {heads} numbers.")
        out.append([float(v) for v in row])
    return out


class QuantizedFP8Cache(_QuantizedKeepAllCache):
    """Keys and values in FP8 (or per-kind formats), every token kept.

    Args:
        format: "fp8_e4m3" (default) or "fp8_e5m2" (any QuantSpec format, e.g. "int8", also works).
        granularity: "token" (scale per token and KV head, default), "head", "tensor" (fixed scales: calibrated via
            `scales`, else from the prompt), or "channel" (keys per channel over blocks of `group_size` tokens;
            values then per token).
        group_size: channels per scale for "token" (divides head_dim; default the whole head), tokens per block for
            "channel" (default 32).
        key, value: full QuantSpec dicts overriding the shorthand for keys or values, e.g. key={"format": "int8"}.
        residual: the most recent `residual` tokens stay in the model's precision (older ones are quantized).
        key_smoothing: subtract a per-channel key mean before quantizing (calibrated, else the prompt's) and add it
            back after: only the spread around the mean is quantized. Off by default: on SmolLM2 it more than halves
            the KL divergence of unrotated E4M3 keys, but adds nothing once keys are rotated (and costs a pass).
        key_rotation: "auto" (default: "hadamard", or "none" for latent-attention models whose cache holds no
            attention keys), "hadamard", "random" or "none": keys are rotated by an orthogonal matrix before
            they are stored, and queries alike in attention (hf_kvcache.common.rotation), which spreads outlier
            channels;
            on SmolLM2 it cuts the KL divergence of E4M3 caches 2.5-4x at no cost in bytes.
        scales: a calibration dict (hf_kvcache.sharing.calibration.calibrate): static per-head scales and key means
            (calibrated with the same key_smoothing and key_rotation).
        max_length: None (the cache grows with the stream), or a fixed capacity in tokens, allocated at the first
            update, like transformers' StaticCache: decode shapes stay constant, so the cache is compileable
            (`generate(compile_config=...)`); needs residual=0 and token/head/tensor granularity. A stream longer
            than max_length is a clear error.
        attention: "auto" (default: straight from the codes when the keys are on CUDA and in CPU decode steps,
            else dequantize), "blockwise" (attention reads the codes block by block, no full-precision copy of the
            layer; docs/blockwise_attention.md) or "dequantize" (the layer into a shared workspace, then SDPA/eager).
        attention_block: tokens per block of the torch block-wise path (default 1024, rounded to the codes' block).
    """

    cache_name = "fp8"

    def __init__(
        self,
        config_or_model,
        format: str = "fp8_e4m3",
        granularity: str = "token",
        group_size: int | None = None,
        key: dict | None = None,
        value: dict | None = None,
        residual: int = 0,
        key_smoothing: bool = False,
        key_rotation: str = "auto",
        scales: dict | None = None,
        max_length: int | None = None,
        layers: dict | list | None = None,
        attention: str = "auto",
        attention_block: int | None = None,
    ):
        self.format, self.granularity, self.group_size = format, granularity, group_size
        self.residual, self.key_smoothing, self.key_rotation = residual, key_smoothing, key_rotation
        base = {"format": format, "granularity": granularity, "group_size": group_size}
        value_base = dict(base)
        if granularity == "channel":  # KIVI layout: keys per channel, values per token
            value_base.update(granularity="token", group_size=None)
        key_spec = _spec(base, key, "key")
        value_spec = _spec(value_base, value, "value")
        self.max_length = max_length
        self._build(
            config_or_model, key_spec, value_spec, residual, key_smoothing, scales, key_rotation, layers, max_length
        )
        self._set_attention(config_or_model, attention, attention_block)


def _spec(base: dict, override: dict | None, kind: str) -> QuantSpec:
    if override is None:
        return QuantSpec.from_value(base, f"{kind} spec")
    if not isinstance(override, dict):
        raise ValueError(f"`{kind}` must be a dict of QuantSpec fields, got {type(override).__name__}.")
    check_keys(f"`{kind}` spec", override, ("format", "granularity", "group_size", "backend", "scale_dtype"))
    if (
        override.get("format") in INT_BITS
        and "granularity" not in override
        and base.get("granularity") not in INT_GRANULARITIES
    ):
        # integer keys/values under an FP8-only shorthand granularity ('tensor', 'head'): the integer default
        base = {"format": override["format"]}
    return QuantSpec.from_value({**base, **override}, f"`{kind}` spec")


class KIVICache(_QuantizedKeepAllCache):
    """KIVI (arXiv 2402.02750): integer keys per channel (blocks of `group_size` tokens), values per token (groups
    of `value_group_size` channels, default `group_size`), the most recent `residual` tokens in full precision (plus
    those of an incomplete key block). Packed by optimum-quanto or hqq (`backend`, default: quanto if installed).
    `scale_dtype` ("float16", ...) stores scales and zero points in another dtype than the model's. `key_rotation`
    ("none" by default: KIVI's per-channel key groups already isolate outlier channels), `attention` and
    `attention_block` as in QuantizedFP8Cache.

    `max_length` (None: the cache grows): a fixed capacity in tokens, allocated at the first update: codes for every
    block that can leave the residual, the residual in a ring, and each decode step quantizes "the block that just
    completed" with the same ops whether one did or not (hf_kvcache.stores.quantized, ring layout). Decode shapes are
    then constant and the cache is compileable (`generate(compile_config=...)`, `torch.compile(fullgraph=True)`);
    outputs equal the growing layout's. Needs backend "quanto" (default when installed): hqq's zero-point optimizer
    branches on the data and cannot be traced. `attention` is then "dequantize" ("blockwise" is refused)."""

    cache_name = "kivi"

    def __init__(
        self,
        config_or_model,
        bits: int = 4,
        group_size: int = 32,
        residual: int = 128,
        backend: str | None = None,
        key_smoothing: bool = False,
        scale_dtype: str | None = None,
        value_group_size: int | None = None,
        key_rotation: str = "none",
        layers: dict | list | None = None,
        attention: str = "auto",
        attention_block: int | None = None,
        max_length: int | None = None,
    ):
        if isinstance(bits, bool) or bits not in (2, 4, 8):
            raise ValueError(f"`bits` must be one of (2, 4, 8), got {bits!r}.")
        group_size = require_int("group_size", group_size, 1)
        value_group = group_size if value_group_size is None else require_int("value_group_size", value_group_size, 1)
        if backend is not None:
            backend = require_choice("backend", backend, ("quanto", "hqq", "torch"))
        self.bits, self.group_size, self.residual, self.backend = bits, group_size, residual, backend
        self.key_smoothing, self.scale_dtype, self.value_group_size = key_smoothing, scale_dtype, value_group_size
        self.key_rotation = key_rotation
        fmt = f"int{bits}"
        key = QuantSpec(fmt, "channel", group_size, backend, scale_dtype)
        value = QuantSpec(fmt, "token", value_group, backend, scale_dtype)
        if max_length is not None and "hqq" in (key.backend, value.backend):
            raise ValueError(
                "`backend` 'hqq' cannot be used with `max_length` (a fixed capacity, for torch.compile): hqq's "
                "zero-point optimizer branches on the data, which torch.compile cannot trace. Use backend='quanto' "
                "(pip install optimum-quanto), or drop `max_length` (the cache then grows and runs eagerly)."
            )
        self.max_length = max_length
        self._build(
            config_or_model,
            key,
            value,
            residual,
            key_smoothing,
            None,
            key_rotation,
            layers,
            max_length,
            fixed_ring=True,
        )
        self._set_attention(config_or_model, attention, attention_block)
