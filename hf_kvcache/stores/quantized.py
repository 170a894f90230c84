"""A slot store holding keys and values quantized, each with its own QuantSpec (e.g. keys INT8, values FP8).

Three layouts:
- slot layout (`append_only=False`): any write pattern (eviction policies overwrite slots, H2O writes per head).
  Every token is quantized when written, with a per-token scale or a fixed (tensor/head) scale.
- append-only layout (`append_only=True`, the keep-all policy): slots are filled in order. This enables
  * a full-precision residual of the most recent `residual` tokens (older ones are quantized, `flush` at a time),
  * per-channel key blocks (KIVI): a block of `group_size` tokens is quantized once, when all its tokens are written
    and it has left the residual. Already-quantized tokens are never dequantized and quantized again, so an append
    costs O(new tokens);
  * physical buffers that grow with the content (`GrowingLayout`, hf_kvcache.stores.growing_layout, which this
    class inherits, with the appends and crops of this layout).
- fixed slots (`fixed_slots=True`, a cache's `max_length`): every buffer is allocated once for the maximum length and
  a decode step has the same shapes and ops at every position (torch.compile, no host syncs). Without a residual and
  with per-token blocks, slot i simply holds token i. With a residual or blocks of tokens (KIVI), the "ring" layout
  (`RingLayout`, hf_kvcache.stores.ring_layout, which this class inherits).

Reads dequantize into a workspace (`DequantWorkspace`, shared by the layers of a cache) and return views of it;
attention straight from the codes reads them as segments instead (`CodeSegments`, hf_kvcache.stores.code_segments).
Optional key smoothing subtracts a per-channel key mean before quantizing and adds it back after dequantizing; the
mean is calibrated (static) or taken from the first write. Non-finite keys/values raise `NonFiniteError` before any
state changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..common.compile_static import fixed_shape
from .code_segments import CodeSegments
from .dequantized_reads import DequantizedReads
from .factory import make_codec
from .growing_layout import GROWTH, GrowingLayout
from .quantization import NonFiniteError, QuantSpec, check_finite
from .ring_layout import RingLayout
from .workspace import TransientWorkspace


class QuantizedStore(DequantizedReads, GrowingLayout, RingLayout, CodeSegments):
    def __init__(
        self,
        key: QuantSpec | dict | str,
        value: QuantSpec | dict | str,
        residual: int = 0,
        append_only: bool = False,
        key_smoothing: bool = False,
        workspace=None,
        name: str = "store",
        flush: int | None = None,
        growth: float = GROWTH,
        fixed_slots: bool = False,
    ):
        self.key_spec = QuantSpec.from_value(key, f"{name}: key")
        self.value_spec = QuantSpec.from_value(value, f"{name}: value")
        self.name = name
        self.block = math.lcm(self.key_spec.block, self.value_spec.block)
        if not append_only:
            for kind, spec in (("key", self.key_spec), ("value", self.value_spec)):
                if spec.append_only:
                    raise ValueError(
                        f"{name}: {kind} granularity 'channel' quantizes blocks of tokens once they are complete, "
                        "which needs the append-only keep-all layout (no eviction); use 'token' with an evicting "
                        "policy."
                    )
            if residual:
                raise ValueError(
                    f"{name}: a full-precision residual window (residual={residual}) needs the append-only "
                    "keep-all layout."
                )
        if residual < 0:
            raise ValueError(f"{name}: `residual` must be >= 0, got {residual}")
        # All slots allocated once (a fixed `max_length`): an append-only store never grows and a read may cover
        # slots not written yet (the layer masks them), so decode shapes are constant (torch.compile).
        self.fixed_slots = fixed_slots
        self.append_only, self.residual, self.growth = append_only, residual, growth
        if flush is None:
            flush = 16 if (residual and self.block == 1) else 1
        self.flush = math.lcm(self.block, flush)
        # fixed slots with a residual or blocks of tokens: the ring layout (module docstring)
        self.ring = fixed_slots and append_only and (residual > 0 or self.flush > 1)
        self.key_smoothing = key_smoothing and self.key_spec.format != "none"
        self.workspace = workspace if workspace is not None else TransientWorkspace()
        self.static_key_scale = self.static_value_scale = None
        self.static_key_mean: torch.Tensor | None = None
        self.layer_idx: int | None = None
        self._init_state()

    def _init_state(self) -> None:
        # Same per-token spec for keys and values: one codec holds both, keys in batch rows [0, B) and values in
        # [B, 2B), so each quantize/dequantize step is one op for both (CPU decode cost is mostly per-op overhead).
        self.joint = self.key_spec == self.value_spec and self.key_spec.granularity == "token"
        self.keys_codec = make_codec(self.key_spec)
        self.values_codec = self.keys_codec if self.joint else make_codec(self.value_spec)
        if self.static_key_scale is not None:
            self.keys_codec.set_scale(self.static_key_scale)
        if self.static_value_scale is not None:
            self.values_codec.set_scale(self.static_value_scale)
        self.key_mean = self.static_key_mean
        self._key_mean_cast = None
        self.allocated = False
        self.qlen = 0  # tokens in the quantized region (append-only layout)
        self.fp_len = 0  # tokens in the full-precision region after it
        self.fp_k = self.fp_v = None
        self.slots = 0  # logical slot count asked for by the layer
        self.filled: torch.Tensor | None = None  # ring layout: tokens written, on the device ([1] long)

    @property
    def where(self) -> str:
        return self.name if self.layer_idx is None else f"{self.name} (layer {self.layer_idx})"

    # -- static (calibrated) parameters -----------------------------------------------------------------------
    def set_static(self, key_scale=None, value_scale=None, key_mean=None) -> None:
        """Calibrated FP8 scales (a float, or one per KV head) and the key channel means [heads, head_dim]."""
        if key_scale is not None:
            self.keys_codec.set_scale(key_scale)
            self.static_key_scale = key_scale
        if value_scale is not None:
            self.values_codec.set_scale(value_scale)
            self.static_value_scale = value_scale
        if key_mean is not None:
            mean = torch.as_tensor(key_mean, dtype=torch.float32)
            if mean.dim() != 2:
                raise ValueError(f"{self.where}: key_mean must be [kv_heads, head_dim], got shape {list(mean.shape)}")
            self.static_key_mean = self.key_mean = mean[None, :, None, :]

    # -- allocation -------------------------------------------------------------------------------------------
    def allocate(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        slots: int,
        dtype: torch.dtype,
        device,
        value_dim: int | None = None,
    ) -> None:
        self.batch, self.heads, self.head_dim, self.dtype, self.device = batch, heads, head_dim, dtype, device
        self.value_dim = value_dim or head_dim
        if self.joint and self.value_dim != head_dim:  # keys and values of different sizes (MLA): one codec each
            self.joint = False
            self.values_codec = make_codec(self.value_spec)
            if self.static_value_scale is not None:
                self.values_codec.set_scale(self.static_value_scale)
        self.slots = slots
        capacity = 0 if self.append_only and not self.fixed_slots else slots
        fp_slots = self.residual + self.flush - 1 if self.append_only else 0
        if self.ring:
            capacity, fp_slots = self._allocate_ring(slots, device)
        # Under tensor parallelism (set by the cache: hf_kvcache.common.tensor_parallel) this layer holds a shard of the
        # model's KV heads: calibrated per-head scales and key means, given for all heads, are sliced to it.
        tp = getattr(self, "tensor_parallel", None)
        for codec, dim in zip(self._codecs(), (head_dim, self.value_dim)):
            if tp is not None:
                codec.tensor_parallel = tp
            if self.append_only and hasattr(codec, "set_pack_block"):
                codec.set_pack_block(self.flush)  # whole blocks of `flush` tokens are quantized at once
            codec.allocate(batch * (2 if self.joint else 1), heads, dim, capacity, dtype, device)
        if fp_slots:
            self.fp_k = torch.zeros(batch, heads, fp_slots, head_dim, dtype=dtype, device=device)
            self.fp_v = torch.zeros(batch, heads, fp_slots, self.value_dim, dtype=dtype, device=device)
            fixed_shape(self.fp_k, self.fp_v)
        if self.key_mean is not None:
            if tp is not None and self.key_mean.shape[1] == tp.kv_heads != heads and tp.sharded(heads):
                offset = tp.head_offset(heads)
                self.key_mean = self.key_mean[:, offset : offset + heads]
            if self.key_mean.shape[1] != heads or self.key_mean.shape[-1] != head_dim:
                raise ValueError(
                    f"{self.where}: key_mean has shape {list(self.key_mean.shape[1::2])}, the layer has {heads} KV "
                    f"heads of size {head_dim}"
                )
            self.key_mean = self.key_mean.to(device)
            self._key_mean_cast = None
        self.allocated = True

    def reserve_reads(self) -> None:
        """With fixed slots, allocate the workspace buffers of the largest read (the ring's: every slot and a trash
        column) now, in eager code (`kv_buffers`; the layer calls it when attention or its scorer reads dequantized keys
        and values). Growing layouts size them as they grow."""
        if not self.fixed_slots:
            return
        self._read_buffers(self.slots + 1)
        self.reserve_scratch(self._read_workspace())

    def reserve_scratch(self, workspace) -> None:
        """The codecs' scratch for reading every slot, allocated now, in eager code (`Codec.reserve_scratch`)."""
        for codec in self._codecs():
            codec.reserve_scratch(workspace)

    def grow(self, slots: int) -> None:
        """The layer's slot count grew. Slot layout: grow the buffers. Append-only: physical buffers follow the
        content instead (see `_reserve`)."""
        self.slots = slots
        if not self.append_only:
            for codec in self._codecs():
                codec.resize(slots)

    @property
    def compileable(self) -> bool:
        """Buffers allocated once: fixed slots, or the slot layout (its `grow` serves only growing regions, whose
        layers have no capacity and are not compiled)."""
        return self.fixed_slots or not self.append_only

    def _codecs(self):
        return (self.keys_codec,) if self.joint else (self.keys_codec, self.values_codec)

    @property
    def length(self) -> int:
        return self.qlen + self.fp_len

    @property
    def keys(self) -> torch.Tensor:
        """Shape/dtype/device stand-in [B, H, slots, D] (zeros, no memory) for code that inspects `store.keys`; the
        data itself is quantized: use `read`."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(
            self.batch, self.heads, self.slots, self.head_dim
        )

    # -- writes -----------------------------------------------------------------------------------------------
    def _smooth(self, keys: torch.Tensor) -> torch.Tensor:
        if not self.key_smoothing:
            return keys
        if self.key_mean is None:  # dynamic: the first write's mean over batch and tokens, fixed afterwards
            self.key_mean = keys.float().mean(dim=(0, 2), keepdim=True)
            self._key_mean_cast = None
        return keys.float() - self.key_mean

    def _encode_put(
        self,
        keys,
        values,
        start: int | None = None,
        dest: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ) -> None:
        keys = self._smooth(keys)
        if self.joint:
            both = torch.cat((keys, values.to(keys.dtype)), 0)
            self.keys_codec.put(
                self.keys_codec.encode(both), start, None if dest is None else torch.cat((dest, dest), 0), block=block
            )
            return
        self.keys_codec.put(self.keys_codec.encode(keys), start, dest, block=block)
        self.values_codec.put(self.values_codec.encode(values), start, dest, block=block)

    def write(
        self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int | None = None, regions=None
    ) -> None:
        """dest [B, H or 1, n] slot indices for the n tokens in keys/values [B, H, n, D]. The append-only layout
        needs the policy's host-side `start` (dest is start, start + 1, ...): nothing is read back from the device."""
        if not self.append_only and self.joint and not self.key_smoothing:  # keys and values in one op per step
            both = self._joint_checked(keys, values)
            self.keys_codec.put(self.keys_codec.encode(both), dest=torch.cat((dest, dest), 0))
            return
        check_finite(keys, values, self.where)
        if not self.append_only:
            self._encode_put(keys, values, dest=dest)
            return
        if self.ring:
            self._append_ring(start, keys, values)
            return
        if start is None:
            raise RuntimeError(
                f"{self.where}: the append-only layout needs sequential writes from a policy that says where they "
                "start (keep-all); a policy that evicts or reorders slots needs a store with append_only=False "
                "(per-token, -head or -tensor granularity, no residual)."
            )
        self._append(start, keys, values)

    def write_slot(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """One token [B, H, 1, D] into one slot shared by all rows and heads (the layer's decode fast path)."""
        if self.ring:
            self._write_ring_token(slot, keys, values, index)
            return
        if self.joint and self.fp_k is None and (self.key_mean is not None or not self.key_smoothing):
            # decode step with keys and values quantized together right away: as few ops as possible (on CPU one
            # native call, hf_kvcache.kernels.cpu_encode, which checks and writes; when the growing layout must
            # first crop or grow, the inputs are checked before anything changes)
            native = not self.key_smoothing
            growing = (
                self.append_only
                and not self.fixed_slots
                and (slot != self.length or self.qlen >= self.keys_codec.capacity)
            )
            both = self._joint_checked(keys, values) if growing or not native else None
            if self.append_only and not self.fixed_slots:
                if slot != self.length:
                    self._truncate(slot)
                self._reserve(self.qlen + 1)
                slot = self.qlen
            # (fixed slots: the slot is the token's index: nothing grows, nothing to truncate after a crop, later
            # slots are overwritten and reads mask what is not valid; no comparison of host counters either, which
            # torch.compile would turn into guards)
            written = self.keys_codec.write_tokens(keys, values, slot) if native else None
            if written is False:  # an input is not finite: nothing was written; raise the checked path's error
                self._joint_checked(keys, values)
            if written is None:
                both = self._joint_checked(keys, values) if both is None else both
                if self.key_smoothing:
                    both = both.float()
                    both[: self.batch] -= self.key_mean
                self.keys_codec.put(self.keys_codec.encode(both), slot, index=index if self.fixed_slots else None)
            if self.append_only:
                self.qlen = slot + 1
            return
        check_finite(keys, values, self.where)
        if self.append_only:
            self._append(slot, keys, values)
        else:
            self._encode_put(keys, values, start=slot)

    def _joint_checked(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Keys and values [B, H, n, D] as one [2B, H, n, D] tensor (the joint codec's rows), checked finite in one
        pass; on a failure the message counts keys and values apart."""
        both = torch.cat((keys, values), 0)
        try:
            check_finite(both, None, self.where)
        except NonFiniteError:  # (raised on the host: count keys and values apart for the message)
            check_finite(keys, values, self.where)
            raise
        return both

    def write_keys_slice(self, start: int, keys: torch.Tensor) -> None:
        """Overwrite keys of slots [start, start + n) (re-rotated sinks); slot layout only."""
        if self.append_only:
            raise NotImplementedError(f"{self.where}: the append-only layout does not rewrite keys in place")
        check_finite(keys, None, self.where)
        rows = slice(0, self.batch) if self.joint else None
        self.keys_codec.put(self.keys_codec.encode(self._smooth(keys)), start, rows=rows)

    def check_crop(self, length: int) -> None:
        """Raise, before anything changes, when the content cannot be cut to `length` tokens: the append-only layout
        cannot split a quantized block, and the ring layout cannot bring back to full precision tokens its ring no
        longer holds. Called by the layer's crop (so a refused crop leaves the cache usable) and by the truncation
        that applies a crop."""
        if not self.append_only or length >= self.length:
            return
        if self.ring:
            self._check_ring_crop(length)
        elif length < self.qlen and length % self.flush:
            raise NotImplementedError(
                f"{self.where}: cannot crop to {length} tokens: tokens before {self.qlen} are quantized in blocks of "
                f"{self.flush} and cannot be split. Keep `residual` at least as large as the number of tokens a crop "
                "may remove."
            )

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: quantized values, scales and zero points (as allocated), the full-precision residual buffer
        and the key means. The shared dequantization workspace is counted by the cache, once."""
        if not self.allocated:
            return 0
        total = sum(codec.nbytes() for codec in self._codecs())
        if self.fp_k is not None:
            total += self.fp_k.nbytes + self.fp_v.nbytes
        if self.filled is not None:
            total += self.filled.nbytes
        if self.key_mean is not None and self.key_smoothing:
            total += self.key_mean.nbytes
        return total

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.allocated:
            return
        if self.joint:  # apply to the key rows and the value rows separately
            batch = self.batch
            self.keys_codec.map_batch(lambda t: torch.cat((fn(t[:batch]), fn(t[batch:])), 0))
            self.batch = self.keys_codec.batch // 2
        else:
            self.keys_codec.map_batch(fn)
            self.values_codec.map_batch(fn)
            self.batch = self.keys_codec.batch
        if self.fp_k is not None:
            self.fp_k, self.fp_v = fn(self.fp_k), fn(self.fp_v)

    def reset(self) -> None:
        self._init_state()
