"""How one tensor kind (keys or values) is quantized: a small, JSON-serialisable spec, and shared helpers.

    QuantSpec(format="fp8_e4m3", granularity="token")                 # FP8, one scale per token and KV head
    QuantSpec(format="int4", granularity="channel", group_size=32)    # KIVI keys: per channel, 32-token blocks
    QuantSpec(format="int4", granularity="token", group_size=32)      # KIVI values: per token, 32-channel groups

Granularity (what one scale covers):
- "tensor": the whole layer (one scale), "head": one KV head. Fixed once set: calibrated (static), or taken from
  the first write (warm-up). Later values beyond it saturate. FP8 only.
- "token": one token of one KV head, or `group_size` consecutive channels of it. Computed on the fly for every write,
  so slots can be overwritten in any order (evicting policies).
- "channel": one channel of one KV head over a block of `group_size` consecutive tokens (KIVI keys). A block is
  quantized once, when all its tokens are written, so it needs the append-only keep-all layout.

`scale_dtype`: how per-group scales (and zero points) are stored. Integer formats: the model's dtype by default;
"float16" halves them for float32 models (values beyond the float16 range then saturate). FP8 token/channel scales:
"bfloat16" by default (the scale is rounded up, so each group's largest value still lands within 0.4% of fmax), or
"float32", "float16", or "e8m0" (a power of two in one byte, as in the OCP microscaling formats).

Formats: "fp8_e4m3" (default; 3 mantissa bits, max 448), "fp8_e5m2" (2 mantissa bits, max 57344), "int8", "int4",
"int2" (asymmetric: a scale and a zero point per group), "none" (the model's precision).
Backends: "torch" (FP8, INT8, none: no packing needed), "quanto" and "hqq" (INT2/4/8: packing, and for hqq its
half-quadratic zero-point optimizer).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..common.compile_static import fixed_shape
from ..common.validation import check_keys, require_choice, require_int
from ..kernels import cpu_encode

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "none")
GRANULARITIES = ("tensor", "head", "token", "channel")
BACKENDS = ("torch", "quanto", "hqq")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
BACKEND_FORMATS = {
    "torch": ("fp8_e4m3", "fp8_e5m2", "int8", "none"),
    "quanto": ("int2", "int4", "int8"),
    "hqq": ("int2", "int4", "int8"),
}
BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
INT_GRANULARITIES = ("token", "channel")
#: tokens per block for "channel" granularity when no group_size is given (KIVI uses 32)
DEFAULT_CHANNEL_GROUP = 32
SPEC_KEYS = ("format", "granularity", "group_size", "backend", "scale_dtype")
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FULL_PRECISION_NAMES = ("full", "none")


class NonFiniteError(ValueError, FloatingPointError):
    """Keys or values with inf/NaN were given to a quantized store. The store is left unchanged."""


def backend_available(backend: str) -> bool:
    if backend == "torch":
        return True
    module = BACKEND_PACKAGES[backend][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_backend(backend: str, fmt: str) -> None:
    if not backend_available(backend):
        module, package = BACKEND_PACKAGES[backend]
        raise ImportError(
            f"QuantSpec(format={fmt!r}, backend={backend!r}) needs the `{package}` package ({module} is not "
            f"installed): pip install {package}"
        )


def default_backend(fmt: str) -> str:
    """torch where no packing is needed; otherwise quanto if installed, else hqq (an ImportError if neither)."""
    if fmt in BACKEND_FORMATS["torch"]:
        return "torch"
    for backend in ("quanto", "hqq"):
        if backend_available(backend):
            return backend
    raise ImportError(
        f"format {fmt!r} needs a packing backend: pip install optimum-quanto (backend 'quanto') or hqq (backend 'hqq')."
    )


@dataclass(frozen=True)
class QuantSpec:
    """How keys or values are stored. See the module docstring; `validate_head_dim` checks `group_size` once the
    head size is known. Round-trips through `to_dict()` / `from_value()` (plain JSON)."""

    format: str = "fp8_e4m3"
    granularity: str = "token"
    group_size: int | None = None
    backend: str | None = None
    scale_dtype: str | None = None  # integer formats: dtype of scales and zero points (None: the model's dtype)

    def __post_init__(self):
        fmt = require_choice("format", self.format, FORMATS)
        granularity = require_choice("granularity", self.granularity, GRANULARITIES)
        if fmt == "none":
            granularity = "token"
        backend = self.backend
        if backend is None:
            backend = default_backend(fmt)
        backend = require_choice("backend", backend, BACKENDS)
        if fmt not in BACKEND_FORMATS[backend]:
            hint = ""
            if fmt in INT_BITS and backend == "torch":
                hint = " (int4/int2 need bit packing: use backend 'quanto' or 'hqq')"
            elif fmt in FP8_DTYPES or fmt == "none":
                hint = " (FP8 and full precision use backend 'torch')"
            raise ValueError(
                f"backend {backend!r} does not support format {fmt!r}: it supports {BACKEND_FORMATS[backend]}{hint}."
            )
        if fmt in INT_BITS and granularity not in INT_GRANULARITIES:
            raise ValueError(
                f"`granularity` for integer format {fmt!r} must be one of {INT_GRANULARITIES} (asymmetric, scale "
                f"and zero point computed per group), got {granularity!r}; 'tensor' and 'head' are for FP8."
            )
        group_size = self.group_size
        if group_size is not None:
            group_size = require_int("group_size", group_size, 1)
            if granularity in ("tensor", "head") and fmt != "none":
                raise ValueError(f"`group_size` must be None for granularity {granularity!r}, got {group_size}.")
            if fmt == "none":
                group_size = None
        if granularity == "channel" and group_size is None:
            group_size = DEFAULT_CHANNEL_GROUP
        if self.scale_dtype is not None:
            if fmt in INT_BITS:
                require_choice("scale_dtype", self.scale_dtype, tuple(SCALE_DTYPES))
            elif fmt in FP8_DTYPES and granularity in ("token", "channel"):
                require_choice("scale_dtype", self.scale_dtype, tuple(SCALE_DTYPES) + ("e8m0",))
            else:
                raise ValueError(
                    f"`scale_dtype` applies to integer formats and to FP8 'token'/'channel' scales; format {fmt!r} "
                    f"with granularity {granularity!r} keeps float32 scales."
                )
        if backend != "torch":
            require_backend(backend, fmt)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "granularity", granularity)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "backend", backend)

    # -- derived properties -------------------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.format in FP8_DTYPES

    @property
    def is_int(self) -> bool:
        return self.format in INT_BITS

    @property
    def bits(self) -> int:
        if self.is_fp8:
            return 8
        if self.is_int:
            return INT_BITS[self.format]
        raise ValueError("format 'none' has no fixed number of bits (it is the model's dtype)")

    @property
    def block(self) -> int:
        """Tokens quantized together along the slot dimension (1 except for channel granularity)."""
        return self.group_size if self.granularity == "channel" else 1

    @property
    def append_only(self) -> bool:
        return self.granularity == "channel"

    def channel_group(self, head_dim: int) -> int:
        """Channels per scale for token granularity (the whole head by default)."""
        return self.group_size if (self.granularity == "token" and self.group_size is not None) else head_dim

    def validate_head_dim(self, head_dim: int, where: str = "") -> None:
        prefix = f"{where}: " if where else ""
        per_token_groups = self.granularity == "token" and self.group_size is not None and self.format != "none"
        if per_token_groups and head_dim % self.group_size:
            raise ValueError(
                f"{prefix}`group_size` ({self.group_size}) must divide the model's head_dim ({head_dim}) for "
                "per-token groups."
            )
        if self.is_int:
            per_byte = 8 // self.bits
            if head_dim % per_byte:
                raise ValueError(f"{prefix}head_dim ({head_dim}) must be a multiple of {per_byte} for {self.format}.")

    # -- (de)serialisation ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any, where: str = "spec") -> QuantSpec:
        """A spec from a QuantSpec, a dict of its fields, or a format name ("fp8_e4m3", "int4", "full" ...)."""
        if isinstance(value, QuantSpec):
            return value
        try:
            if isinstance(value, str):
                return cls(format="none" if value in FULL_PRECISION_NAMES else value)
            if isinstance(value, dict):
                check_keys(where, value, SPEC_KEYS)
                return cls(**value)
        except ValueError as error:  # name the field the spec came from (a region's keys, a cache's key spec ...)
            message = str(error)
            raise ValueError(message if where in message else f"{where}: {message}") from None
        raise ValueError(
            f"{where} must be a format name {FORMATS}, a dict with keys {SPEC_KEYS}, or a QuantSpec; got "
            f"{type(value).__name__}."
        )


# -- numeric helpers shared by the codecs -----------------------------------------------------------------------
def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32, >= 0) in `dtype`, never below x (so a scale never shrinks: the largest value is not clipped).
    Two ops: scaling by 1 + eps before rounding to nearest lands at most two units in the last place above x."""
    if dtype == torch.float32:
        return x.clone()
    return (x * (1.0 + torch.finfo(dtype).eps)).to(dtype)


def round_down_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    high = y.float() > x
    return torch.where(high, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


def check_finite(keys: torch.Tensor, values: torch.Tensor | None, where: str) -> None:
    """Refuse inf/NaN keys or values before they are quantized; raises NonFiniteError naming `where`.

    The check never makes an accelerator wait for the host (it runs in every layer of every forward): it is a
    `torch._assert_async`, which raises at once on the CPU (the store is left unchanged) and, on a GPU, fails the
    stream asynchronously (a device-side assert, reported at the next synchronisation). A decode step's few numbers
    on CPU are checked in one native call (hf_kvcache.kernels.cpu_encode.tensors_finite)."""
    if cpu_encode.tensors_finite(keys, values):
        return
    ok = torch.isfinite(keys).all()
    if values is not None:
        ok = ok & torch.isfinite(values).all()
    try:
        torch._assert_async(ok, f"{where}: non-finite keys or values among the new tokens")
    except RuntimeError:  # raised synchronously (CPU): give it our type and the whole story (counting is free now)
        parts = [("keys", keys)] + ([("values", values)] if values is not None else [])
        counts = [(int((~torch.isfinite(t)).sum()), name) for name, t in parts]
        found = ", ".join(f"{count} non-finite {name}" for count, name in counts if count)
        raise NonFiniteError(
            f"{where}: {found} among the new tokens (inf/NaN cannot be quantized). The cache was left unchanged; "
            "check the model's activations (overflow in float16?)."
        ) from None


# -- codecs: quantized storage of one tensor kind (keys or values) in slots ------------------------------------
class Codec:
    """Slot tensors `[B, H, capacity / block, ...]` (dim 2 indexes slots, or blocks of `block` slots) plus shared
    per-layer tensors (fixed scales). Subclasses define `_slot_shapes`, `encode` and `decode_into`."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        self.block = spec.block
        self.slot: dict[str, torch.Tensor] = {}
        self.shared: dict[str, torch.Tensor] = {}
        self.capacity = 0

    def _slot_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (trailing shape after [B, H, n_blocks], dtype)."""
        raise NotImplementedError

    def allocate(self, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device) -> None:
        self.spec.validate_head_dim(head_dim)
        self.batch, self.heads, self.head_dim, self.dtype, self.device = batch, heads, head_dim, dtype, device
        self.per_block = set(self._per_block())
        self.slot = {
            name: torch.zeros(batch, heads, self._rows(name, capacity), *shape, dtype=dt, device=device)
            for name, (shape, dt) in self._slot_shapes().items()
        }
        fixed_shape(*self.slot.values())
        self.capacity = capacity

    def reserve_scratch(self, workspace) -> None:
        """Allocate the workspace scratch a full-capacity `decode_into` needs, in eager code (`kv_buffers` says why)."""

    def _per_block(self) -> tuple[str, ...]:
        """Slot tensors with one row per block of `block` slots (the others have one row per slot)."""
        return ()

    def _rows(self, name: str, slots: int) -> int:
        return slots // self.block if name in self.per_block else slots

    def resize(self, capacity: int) -> None:
        """Change the physical capacity (slots, a multiple of `block`), keeping the content of the common part."""
        if capacity == self.capacity:
            return
        keep = min(capacity, self.capacity)
        for name, t in self.slot.items():
            new = t.new_empty(t.shape[0], t.shape[1], self._rows(name, capacity), *t.shape[3:])
            rows = self._rows(name, keep)
            new[:, :, :rows] = t[:, :, :rows]
            new[:, :, rows:] = 0  # (the new part only: zeroing all of it first would write the kept part twice)
            self.slot[name] = new
            fixed_shape(new)
        self.capacity = capacity

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [B, H, n, D] (n a multiple of `block`) -> slot tensors for those n slots."""
        raise NotImplementedError

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor | None, slot: int) -> bool | None:
        """A native `encode` + `put` of a decode step's tokens (keys in rows [0, B), values of a joint codec in
        [B, 2B)): True when written, False when an input is not finite (nothing written), None when this codec has
        none for these tensors (the default; FP8Codec has one on CPU)."""
        return None

    def put(
        self,
        encoded: dict[str, torch.Tensor],
        start: int | None = None,
        dest: torch.Tensor | None = None,
        rows: slice | None = None,
        index: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ):
        """Store encoded tokens at slots [start, start + n) or, for dest [B, 1 or H, n], at those slots (of the batch
        `rows` only, if given). `index`: slots [start, start + n) as a tensor, for per-slot layouts: compiled code
        then does not specialise on `start`. `block` ([1] long tensor): the encoded n tokens are block number `block`
        of n-token blocks (slots [block * n, block * n + n)), written by index: constant shapes for any block."""
        for name, t in encoded.items():
            buf = self.slot[name] if rows is None else self.slot[name][rows]
            if block is not None:
                n = t.shape[2]
                buf.index_copy_(2, block * n + torch.arange(n, device=buf.device), t)
            elif index is not None and name not in self.per_block:
                buf.index_copy_(2, index, t)
            elif dest is None:
                first = self._rows(name, start)
                buf[:, :, first : first + t.shape[2]] = t
            else:
                buf.scatter_(2, dest.reshape(dest.shape + (1,) * (t.dim() - 3)).expand(t.shape), t)

    def decode_into(self, out: torch.Tensor, n: int, workspace, bias: torch.Tensor | None = None) -> None:
        """Dequantize slots [0, n) into out [B, H, n, D] (any strides with a unit stride on the last dim), plus a
        per-channel `bias` [B, H, 1, D] if given (smoothed keys get their mean back)."""
        raise NotImplementedError

    def decode_slots(self, out: torch.Tensor, slots: torch.Tensor, workspace, bias: torch.Tensor | None = None) -> None:
        """Dequantize only the slots `slots` [B, 1 or H, n] into out [B, H, n, D]: the codes of those slots are
        gathered first, so the cost is O(n), not O(capacity) (CompositeCache moves a token between regions every
        step). Per-slot layouts only (not blocks of tokens)."""
        if self.per_block or self.block != 1 or getattr(self, "token_pairs", False):
            raise NotImplementedError("decode_slots needs a per-slot layout (token granularity or fixed scales)")
        batch, heads, n = out.shape[0], out.shape[1], slots.shape[-1]
        saved, capacity = self.slot, self.capacity
        self.capacity = n  # the gathered slots stand in for the buffers
        self.slot = {
            name: t.gather(2, slots.reshape(slots.shape + (1,) * (t.dim() - 3)).expand(batch, heads, n, *t.shape[3:]))
            for name, t in saved.items()
        }
        try:
            self.decode_into(out, n, workspace, bias)
        finally:
            self.slot, self.capacity = saved, capacity

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.slot.values()) + sum(t.nbytes for t in self.shared.values())

    def map_batch(self, fn) -> None:
        self.slot = {name: fn(t) for name, t in self.slot.items()}
        if self.slot:
            self.batch = next(iter(self.slot.values())).shape[0]

    def bytes_per_slot(self) -> float:
        """Theoretical bytes per slot (token) and KV head of the slot tensors: bits/8 per value + scales."""
        total = 0.0
        for name, (shape, dt) in self._slot_shapes().items():
            per = self.block if name in self.per_block else 1
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size() / per
        return total


class FullCodec(Codec):
    """format 'none': the model's own dtype."""

    def _slot_shapes(self):
        return {"data": ((self.head_dim,), self.dtype)}

    def encode(self, x):
        return {"data": x.to(self.dtype)}

    def decode_into(self, out, n, workspace, bias=None) -> None:
        out.copy_(self.slot["data"][:, :, :n])
        if bias is not None:
            out.add_(bias)
