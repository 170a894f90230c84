"""What a quantized page holds: a validated, JSON-only spec read from transformers' ContinuousBatchingConfig.

    cb = ContinuousBatchingConfig(num_blocks=64)
    cb.kv_cache_dtype = "fp8_e4m3"                        # the switch (after `import hf_kvcache`)
    cb.kv_cache_quantization = {"group_size": 32}         # optional details, see PagedKVSpec
    model.generate_batch(inputs, continuous_batching_config=cb)

`kv_cache_dtype`: "model" (or None / absent: transformers' own pages, in the model's dtype), "fp8_e4m3",
"fp8_e5m2", "int8", "int4". Keys and values share the format. `kv_cache_quantization` (dict, optional):
- granularity: "token" (default: one scale per token and KV head, or per `group_size` channels of it, computed
  at every write so pages can be written in any order).
- group_size: channels per scale (divides head_dim). Default: the whole head for FP8; for integers 32 (KIVI's
  value groups) when it divides head_dim, else the whole head.
- scale_dtype: how scales (and integer zero points) are stored: "bfloat16" (default), "float16", "float32"
  (FP8 also "e8m0": a power of two in one byte).
- key_rotation: "hadamard", "random" or "none"; default (None): the format's entry in DEFAULT_KEY_ROTATION,
  "hadamard" for FP8 as QuantizedFP8Cache does by default. Keys are rotated by an orthogonal matrix before they
  are quantized and rotated back when read (hf_kvcache.common.rotation): q . k is unchanged up to float rounding and
  outlier channels are spread over the head before rounding. DEFAULT_KEY_ROTATION_MEASURED says how the
  defaults were chosen.
- attention: how attention reads the pages. "auto" (default): straight from the codes where the native kernel runs
  (CPU; hf_kvcache.paged.codes_attention), else the gather-and-dequantize path; "codes": straight from the codes,
  or an error saying why not; "dequantize": gather the batch's rows and dequantize them before transformers'
  attention (the path before the kernel; kept for comparison and for what the kernel does not cover).

Errors name the field (`kv_cache_dtype`, `kv_cache_quantization.group_size`, ...) and the allowed values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..common.rotation import ROTATIONS
from ..stores.quantization import QuantSpec

DTYPE_FIELD = "kv_cache_dtype"
OPTIONS_FIELD = "kv_cache_quantization"
KV_DTYPES = ("model", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
OPTION_KEYS = ("granularity", "group_size", "scale_dtype", "key_rotation", "attention")
ATTENTION_PATHS = ("auto", "codes", "dequantize")
GRANULARITIES = ("token",)
#: integer formats: channels per scale when no group_size is given
DEFAULT_INT_GROUP = 32
#: key rotation when `kv_cache_quantization.key_rotation` is not given, per format
DEFAULT_KEY_ROTATION = {"fp8_e4m3": "hadamard", "fp8_e5m2": "hadamard", "int8": "none", "int4": "hadamard"}
DEFAULT_KEY_ROTATION_MEASURED = (
    "SmolLM2-135M bf16, 48 requests (prompts 8-24, 4-12 new tokens), KL vs model-dtype pages (hf-kvcache serve-bench "
    "--threads 1 --formats model,int8:none,int8:hadamard,int4:none,int4:hadamard,fp8_e4m3:none,fp8_e4m3:hadamard "
    "--budget-scales 1.0 --requests 48 --prompt-lengths 8-24 --new-tokens 4-12 --budget-tokens 1536 "
    "--max-batch-tokens 256): "
    "FP8 E4M3 none 4.1e-3, hadamard 3.9e-3; INT8 g32 none 1.70e-3, hadamard 1.69e-3 (no measurable gain, so no "
    "rotation: it costs two matmuls per layer and step); INT4 g32 none 3.2e-2, hadamard 2.5e-2."
)


@dataclass(frozen=True)
class PagedKVSpec:
    """Format of the keys and values in quantized pages (see the module docstring)."""

    kv_dtype: str = "fp8_e4m3"
    granularity: str = "token"
    group_size: int | None = None
    scale_dtype: str = "bfloat16"
    key_rotation: str | None = None  # None: DEFAULT_KEY_ROTATION[kv_dtype]
    attention: str = "auto"

    def __post_init__(self):
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in KV_DTYPES[1:]:
            raise ValueError(f"`{DTYPE_FIELD}` must be one of {KV_DTYPES} (or None), got {self.kv_dtype!r}.")
        if self.key_rotation is None:
            object.__setattr__(self, "key_rotation", DEFAULT_KEY_ROTATION[self.kv_dtype])
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"`{OPTIONS_FIELD}.granularity` must be one of {GRANULARITIES} for paged caches (a page is shared "
                f"by requests written in any order, so scales are computed per token), got {self.granularity!r}."
            )
        if self.key_rotation not in ROTATIONS:
            raise ValueError(f"`{OPTIONS_FIELD}.key_rotation` must be one of {ROTATIONS}, got {self.key_rotation!r}.")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"`{OPTIONS_FIELD}.attention` must be one of {ATTENTION_PATHS}, got {self.attention!r}.")
        group = self.group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            raise ValueError(f"`{OPTIONS_FIELD}.group_size` must be a positive integer or None, got {group!r}.")
        try:
            self.quant_spec()
        except (ValueError, ImportError) as error:
            raise type(error)(f"`{OPTIONS_FIELD}`: {error}") from None

    def quant_spec(self, head_dim: int | None = None) -> QuantSpec:
        """The codec spec (hf_kvcache.stores.quantization) used for keys and values alike."""
        group = self.group_size
        if (
            group is None
            and self.kv_dtype.startswith("int")
            and (head_dim is None or head_dim % DEFAULT_INT_GROUP == 0)
        ):
            group = DEFAULT_INT_GROUP
        return QuantSpec(
            format=self.kv_dtype, granularity=self.granularity, group_size=group, scale_dtype=self.scale_dtype
        )

    def check_head_dim(self, head_dim: int) -> None:
        try:
            self.quant_spec(head_dim).validate_head_dim(head_dim)
        except ValueError as error:
            raise ValueError(f"`{OPTIONS_FIELD}`: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, kv_dtype: Any, options: Any = None) -> PagedKVSpec | None:
        """The spec for a `kv_cache_dtype` value and `kv_cache_quantization` dict; None for model-dtype pages."""
        if kv_dtype is None or kv_dtype == "model":
            if options:
                raise ValueError(
                    f"`{OPTIONS_FIELD}` ({options!r}) was given but `{DTYPE_FIELD}` is {kv_dtype!r}: set "
                    f"`{DTYPE_FIELD}` to one of {KV_DTYPES[1:]} to quantize the pages."
                )
            return None
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ValueError(f"`{OPTIONS_FIELD}` must be a dict with keys {OPTION_KEYS}, got {type(options).__name__}.")
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"`{OPTIONS_FIELD}` has unknown keys {unknown}; allowed keys are {OPTION_KEYS}.")
        return cls(kv_dtype=kv_dtype, **options)

    @classmethod
    def from_cb_config(cls, cb_config) -> PagedKVSpec | None:
        """Read the two fields from a ContinuousBatchingConfig (absent fields: model-dtype pages)."""
        return cls.from_fields(getattr(cb_config, DTYPE_FIELD, None), getattr(cb_config, OPTIONS_FIELD, None))
