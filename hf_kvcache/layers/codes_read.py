"""Attention straight from a layer's quantized codes (the `attention="blockwise"` option of the quantized caches and
CompositeCache): the layer's side (what an update hands attention, and when). The attention side, `attend`, is in
hf_kvcache.attention.codes.

By default a quantized layer dequantizes its whole store into the shared workspace at every read and the attention
bridge calls SDPA / eager on that copy. A layer with `attention_from_codes` set never dequantizes its store:

- `CompressedLayer.update` returns stand-ins for keys and values (`read_codes`): expanded views of a one-element
  tensor with the right shape, dtype and device, no memory. It records the store's segments (`store.segments`,
  `hf_kvcache.kernels.QuantizedKV` runs of codes, scales and the full-precision residual), and for a multi-token
  forward (prefill, chunks) the new tokens as a last full-precision segment, since they are attended to in full
  precision before (or without) being quantized, as on the dequantize path. The first prefill (nothing stored yet)
  returns the new tokens themselves and attends as usual (SDPA / eager): there is nothing to dequantize.
- The bridge (`hf_kvcache.attention`) rotates the queries as usual and, instead of SDPA, calls `attend`, which runs
  `hf_kvcache.kernels.blockwise_attention` over those segments with the layer's validity mask (padding, causal
  tail), the module's scaling, softcap and sinks, and H2O column scores when the policy asks for them.

The bridge checks that the keys / values it receives are exactly the stand-ins: a model that transforms the cached
keys before attention (DeepSeek MLA expands its latent with `expand_kv`) would otherwise attend to zeros, so it is a
clear error naming the attention class and pointing to attention="dequantize".

Choosing: "blockwise" always, "dequantize" never, "auto" = blockwise when the layer holds quantized tokens (a
composite of full-precision regions keeps SDPA) and the keys are on CUDA (the Triton kernel), or on CPU for eager
one-token decode steps when the native kernel builds (`kernels.cpu_blockwise`; prefill chunks and compiled steps
dequantize there: MKL's SDPA on a dequantized copy beats any block walk for many queries, and inductor fuses the
dequantization; docs/blockwise_attention.md); resolved per layer at its first update, from the keys' device
(`resolve_attention`), then per forward (`codes_now`). Caches without the option (the eviction caches: sinks,
windows, heavy hitters in full precision) read their keys the same way in eager CPU decode steps
(`full_precision_native`: the native kernel's full-precision register route is ~2x SDPA's CPU kernel for one query
token; float32, bfloat16 and float16, and ~20x SDPA's bfloat16 CPU kernel). Any store with `segments` attends from
codes except the quantized ring layout (`max_length` with a residual or token blocks): append-only stores
(keep-all) and slot stores, including CompositeCache's region stores (full-precision sinks, FP8 windows and heavy
hitters, each region's segments in slot order).
Decode writes the new token, then reads views of the codes; a prefill chunk attends to the past as it was
before the chunk's writes (`stable` segments: a slot store, which evictions overwrite in place, copies its codes, a
quarter of the dequantized bytes for FP8). Column scores (H2O, and SnapKV / TOVA over their last `attention_window`
queries) come from the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.validation import require_choice, require_int
from ..kernels import QuantizedKV, cpu_blockwise
from ..policies.keep_all import KeepAllPolicy

ATTENTION_MODES = ("auto", "blockwise", "dequantize")
#: full-precision store dtypes the native CPU kernel reads as they are (`full_precision_native`)
FULL_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: tokens dequantized at a time (rounded up to the segments' token alignment); the Triton kernel ignores it
DEFAULT_BLOCK = 1024


@dataclass
class CodesRead:
    """What one `update` handed attention: the segments, and the stand-ins the bridge must receive back. In an eager
    CPU decode step the segments may come already in the native kernel's form instead (`flat`: the layer's kept
    `KernelView` with this step's lengths; `segments()` then builds the segments only if attention needs them)."""

    keys: list[QuantizedKV] | None
    values: list[QuantizedKV] | None
    key: torch.Tensor
    value: torch.Tensor
    flat: tuple | None = None
    store: object = None
    used: int = 0

    def segments(self) -> tuple[list[QuantizedKV], list[QuantizedKV]]:
        if self.keys is None and self.flat is not None:
            self.keys, self.values = self.store.segments(self.used)
        return self.keys, self.values


@dataclass
class KernelView:
    """The native CPU kernel's arguments for a layer's store, kept across decode steps: its segments over whole
    buffers, flattened once (`cpu_blockwise.flatten_views`), valid while the store holds the same buffer objects;
    each step only sets how much of each segment is content. Building the segments and their kernel form at every
    step cost ~100 us a layer (views, checks, conversions that change nothing): 2.6 ms (FP8) and 5.1 ms (KIVI) of
    SmolLM2's decode step at 8K tokens, measured side by side."""

    buffers: tuple
    keys: tuple | None
    values: tuple | None
    value_dim: int
    heads: int

    @staticmethod
    def of(store, kept: KernelView | None) -> KernelView | None:
        """`kept` while `store` holds the buffers it was made of, else a new view of `store`. None where its segments
        cannot be kept (`capacity_buffers` says None); a view without `keys` where flattening them would convert a
        tensor."""
        buffers = store.capacity_buffers() if hasattr(store, "capacity_buffers") else None
        if buffers is None:
            return None
        if (
            kept is not None
            and len(buffers) == len(kept.buffers)
            and all(a is b for a, b in zip(buffers, kept.buffers))
        ):
            return kept
        keys, values = store.capacity_segments()
        flat_k, flat_v = cpu_blockwise.flatten_views(keys), cpu_blockwise.flatten_views(values)
        if flat_k is None or flat_v is None:  # remembered as such until the buffers change: not retried every step
            return KernelView(buffers, None, None, 0, 0)
        return KernelView(buffers, flat_k, flat_v, values[0].head_dim, keys[0].heads)


def attention_option(attention: str, attention_block: int | None, latent: bool) -> tuple[str, int | None]:
    """A cache's validated (`attention`, `attention_block`) options as its layers take them: "auto" is "dequantize"
    for latent attention (the model expands the cached latent before attention, so nothing can read its codes;
    "blockwise" is refused there at the first forward)."""
    attention = require_choice("attention", attention, ATTENTION_MODES)
    block = None if attention_block is None else require_int("attention_block", attention_block, 1)
    return ("dequantize" if attention == "auto" and latent else attention), block


def reads_codes(store) -> bool:
    """Whether attention can read `store` as code segments: a quantized store outside the fixed-length ring layout,
    a full-precision store, or a region store (CompositeCache) made of those."""
    regions = getattr(store, "stores", None)
    if regions is not None:
        return all(reads_codes(s) for s in regions)
    return callable(getattr(store, "segments", None)) and not getattr(store, "ring", False)


def holds_codes(store) -> bool:
    """Whether `store` holds any quantized tokens (a region store of full-precision regions holds none)."""
    regions = getattr(store, "stores", None)
    if regions is not None:
        return any(holds_codes(s) for s in regions)
    return hasattr(store, "keys_codec")


def resolve_attention(layer, device) -> bool:
    """Whether `layer`'s decode steps attend from its codes, from its `attention` mode and the device of its keys
    ("auto" also needs something quantized to read: over full-precision regions only, SDPA does better than the
    block walk; and on CPU the native kernel, built here on first use)."""
    mode = getattr(layer, "attention", None)
    if getattr(layer, "kv_shared", False):  # later layers attend to what it hands out (KV sharing)
        if mode == "blockwise":
            raise ValueError(
                f"Layer {layer.layer_idx}: attention='blockwise' hands attention stand-ins, but this model's later "
                "layers attend to this layer's keys and values (KV sharing, Gemma 3n / 4); use attention='auto' or "
                "'dequantize'."
            )
        return False
    if mode is None:  # a cache without the option (the eviction caches)
        return full_precision_native(layer, device)
    if mode == "dequantize" or (mode == "auto" and not holds_codes(layer.store)):
        return False
    if not reads_codes(layer.store):
        if mode == "blockwise":
            raise ValueError(
                f"Layer {layer.layer_idx}: attention='blockwise' cannot read {type(layer.store).__name__} as code "
                "segments (the fixed-length ring layout); use attention='dequantize' or 'auto'."
            )
        return False
    if mode == "blockwise" or torch.device(device).type == "cuda":
        return True
    return torch.device(device).type == "cpu" and cpu_blockwise.unavailable() is None


def full_precision_native(layer, device) -> bool:
    """Whether a layer of a cache without the `attention` option (the eviction caches: sinks, windows, heavy hitters
    in full precision) attends in its eager CPU decode steps through the native kernel's full-precision route, as
    "auto" does for quantized layers: one query token per KV head row against the stored keys, ~2x faster than
    SDPA's CPU kernel for SmolLM2's shape (1K-8K tokens, docs/blockwise_attention.md). Float32, bfloat16 and float16
    stores (the kernel reads them in their dtype and widens them in registers, exactly), not latent attention (the
    model expands its latent before attention), not policies that take the attention scores or the queries (their
    own pass already reads the keys), and not keep-all: a full-precision layer that keeps everything is the full
    cache, the reference the others are measured against, and stays the model's own attention bit for bit."""
    return (
        torch.device(device).type == "cpu"
        and getattr(layer, "dtype", None) in FULL_PRECISION_DTYPES
        and not isinstance(layer.policy, KeepAllPolicy)
        and not getattr(layer, "latent_attention", True)
        and not holds_codes(layer.store)
        and reads_codes(layer.store)
        and not layer.needs.attention
        and not layer.needs.queries
        and cpu_blockwise.unavailable() is None
    )


def _decode_only(layer) -> bool:
    """Whether `layer` attends from its codes in (some) decode steps only: "auto" on CPU, and layers without the
    option (`full_precision_native`; see `codes_now`)."""
    return getattr(layer, "attention", None) in ("auto", None) and layer.device.type == "cpu"


def watch_first_prefill(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """At the first prefill of a layer whose decode steps will attend from its codes but whose prefill does not
    ("auto" on CPU, the eviction caches' native route: `_decode_only`): let the bridge check that the model hands
    these keys and values to attention as they are, as it checks the stand-ins of later steps (`attention.codes`);
    a model that transforms them makes the layer `stop_reading_codes` before any step could read zeros."""
    if layer.attention_from_codes and layer.forward_info.attention_bridged:
        layer.codes_read = CodesRead(None, None, keys, values)


def stop_reading_codes(layer) -> None:
    """From now on `layer` hands attention its keys and values (dequantized, or as stored), never stand-ins: for a
    model found to transform them before attention (see `attention.codes.attend`). Eager code, at the first prefill."""
    layer.attention_from_codes = False
    if hasattr(layer.store, "reserve_reads"):
        layer.store.reserve_reads()


def dequantizes(layer) -> bool:
    """Whether some forwards of `layer` read a dequantized copy of its store (so it reserves the read buffers)."""
    return not layer.attention_from_codes or _decode_only(layer)


def codes_now(layer, tokens: int) -> bool:
    """Whether this forward of `tokens` new tokens attends from the codes. "auto" on CPU does so in eager decode
    steps only: the native kernel is 2-3x slower than dequantize-then-SDPA (MKL) for a chunk of 16-512 queries, and
    under torch.compile the dequantize path is what inductor fuses; nor while a quantized store holds every token in
    its full-precision residual (then the dequantize path is the full cache's, bit for bit), nor when the model's
    attention is not the bridge (layers driven directly, other attention implementations: "auto" never refuses)."""
    if not layer.attention_from_codes:
        return False
    if _decode_only(layer):  # (while all is in the residual: SDPA, exact)
        return (
            tokens == 1
            and not torch.compiler.is_compiling()
            and getattr(layer.store, "qlen", 1) > 0
            and layer.forward_info.attention_bridged
        )
    return True


def read_codes(layer, used: int, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None):
    """Stand-ins (keys, values) for slots [0, used) of the layer's store, followed by `new_keys` / `new_values`
    (a multi-token forward, not yet written: the store's segments are taken `stable`, so the write that follows
    does not change them). Records the segments on `layer.codes_read` for the bridge."""
    if not layer.forward_info.attention_bridged:
        raise RuntimeError(
            f"Layer {layer.layer_idx}: attention from quantized codes (attention='blockwise', or 'auto' on CUDA) runs "
            "in the hf_kvcache attention bridge, but the model's attention implementation is not the bridge. Call "
            "`hf_kvcache.enable(model)` after changing it, or use attention='dequantize'."
        )
    if not used and new_keys is not None:
        # nothing stored yet (the first prefill): the new tokens are all there is, in full precision, as on the
        # dequantize path; attention runs on them as usual (SDPA / eager), and the bridge still checks they arrive
        # untransformed (the same model would transform the stand-ins of later steps)
        layer.codes_read = CodesRead(None, None, new_keys, new_values)
        return new_keys, new_values
    batch = layer.slot_valid.shape[0]
    if new_keys is None and used and native_decode_read(layer):
        view = layer.kernel_view = KernelView.of(layer.store, getattr(layer, "kernel_view", None))
        if view is not None and view.keys is not None:
            lengths = layer.store.segment_lengths(used)
            flat = (
                (view.keys[0], cpu_blockwise.with_lengths(view.keys[1], lengths)),
                (view.values[0], cpu_blockwise.with_lengths(view.values[1], lengths)),
                view.value_dim,
                view.heads,
            )
            key, value = _stand_ins(layer, batch, used)
            layer.codes_read = CodesRead(None, None, key, value, flat, layer.store, used)
            return key, value
    keys, values = layer.store.segments(used, stable=new_keys is not None) if used else ([], [])
    n = used
    if new_keys is not None:
        keys.append(QuantizedKV(new_keys, "none"))
        values.append(QuantizedKV(new_values, "none"))
        n += new_keys.shape[-2]
    key, value = _stand_ins(layer, batch, n)
    layer.codes_read = CodesRead(keys, values, key, value)
    return key, value


def _stand_ins(layer, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the right shape, dtype and device holding no memory (expanded views of one element)."""
    anchor = torch.zeros((), dtype=layer.dtype, device=layer.device)
    return anchor.expand(batch, layer.heads, n, layer.head_dim), anchor.expand(batch, layer.heads, n, layer.value_dim)


def native_decode() -> bool:
    """Whether a CPU decode step here can go to the native kernel (eager code, and the kernel builds)."""
    return cpu_blockwise.unusable() is None


def native_decode_read(layer) -> bool:
    """Whether this decode step of `layer` attends through the native CPU kernel without scores (what
    `attention.codes.attend` checks again with the query): its keys on CPU, no scores, `native_decode()`."""
    return layer.device.type == "cpu" and not layer.needs.attention and native_decode()
