"""One layer of a compressed cache: a policy (which tokens stay, in which slot) over a store (at what precision).

Contract with attention (see docs/design.md):
- `update` returns keys/values whose last `q` columns are the new tokens in order, except for one-token decode
  steps, where the new token is written in place into its slot (attention over the past is order-free).
- `seen` is the logical length (drives positions); `get_mask_sizes` describes the columns actually returned.
- With `key_rotation` (an orthogonal [D, D] matrix, keep-all quantized caches), keys are rotated on arrival, stored
  and returned rotated; the bridge rotates the queries alike, so attention logits are unchanged.
- Validity of each returned column (padding, empty or evicted slots) is kept here and applied by the attention
  bridge (`hf_kvcache.attention`), since the 2-D padding mask of transformers assumes contiguous positions.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..common.compile_static import fixed_shape
from ..common.rotation import rotate
from ..integration.cache_layers import CacheLayerMixin
from ..policies.base import Policy
from ..policies.view import Chunk, Incoming
from .codes_read import codes_now, dequantizes, read_codes, resolve_attention, watch_first_prefill
from .forward_info import ForwardInfo
from .slot_view import LayerSlotView, pooled_index


class CompressedLayer(CacheLayerMixin):
    is_sliding = False

    @property
    def needs(self):
        """What this layer's policy needs the attention bridge to hand over in this forward (`policies.base.Needs`)."""
        return self.policy.needs

    @property
    def is_compileable(self) -> bool:
        """Decode keeps constant shapes and never reads the device on the host: a fixed capacity, a policy and a
        store whose decode steps are written for it (tested with torch.compile(fullgraph=True))."""
        return (
            self.policy.capacity is not None and self.policy.compileable and getattr(self.store, "compileable", False)
        )

    def __init__(self, policy: Policy, store, forward_info: ForwardInfo, layer_idx: int):
        super().__init__()
        self.policy, self.store, self.forward_info, self.layer_idx = policy, store, forward_info, layer_idx
        self.seen = 0  # logical length: tokens of the stream so far, padding included
        self.used = 0  # slot columns attention sees
        # [B, Hm, slots + 1] position id (int32) of the token in each slot; None for policies without `needs_positions`
        self.slot_pos: torch.Tensor | None = None
        self.slot_valid: torch.Tensor | None = None  # [B, Hm, slots + 1]; the last slot is a trash slot
        self._served_forward = -1
        self._attention_columns: torch.Tensor | None = None  # validity of the columns returned by the last update
        self._attention_query_len = 0
        self._pending: Chunk | None = None  # a chunk whose placement waits for attention scores (`deferred`)
        # (keys, values, position ids) of the tokens being placed, during `policy.place` and the write (key scorers)
        self.incoming: Incoming | None = None
        self.key_rotation: torch.Tensor | None = None  # [D, D] orthogonal: keys are stored (and returned) rotated
        # "auto" / "blockwise": attention reads the store's codes (hf_kvcache.layers.codes_read), resolved at
        # allocation; None: the cache has no such option (eviction caches: `full_precision_native` decides)
        self.attention, self.attention_block, self.attention_from_codes, self.codes_read = None, None, False, None
        self.kernel_view = None  # the native CPU kernel's view of the store, kept across decode steps (codes_read)
        self.kv_shared = False  # later layers attend to what this one hands out (KV sharing): never stand-ins
        self.view = LayerSlotView(self)  # all the policy is given of this layer (hf_kvcache.policies.view)

    @property
    def is_croppable(self) -> bool:
        return not self.policy.has_evicted(self.seen)

    # -- allocation -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, prompt_length, head_dim = key_states.shape
        self.policy.configure(prompt_length)
        self.policy.size_for(heads)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.heads, self.head_dim = heads, head_dim
        meta_heads = heads if self.policy.per_head else 1
        slots = self.policy.capacity if self.policy.capacity is not None else max(key_states.shape[-2], 16)
        self.value_dim = value_states.shape[-1]  # differs from head_dim for latent attention (MLA)
        if self.policy.capacity is not None:  # a budget: refuse one larger than the device before allocating it
            self._check_budget_fits(batch, heads, meta_heads, slots + 1, key_states.dtype, key_states.device)
        self.store.allocate(batch, heads, head_dim, slots + 1, key_states.dtype, key_states.device, self.value_dim)
        if self.policy.needs_positions:  # a head-pooled store: one position per slot (each slot is one head's)
            pos_heads = 1 if getattr(self.store, "pool_heads", 0) else meta_heads
            self.slot_pos = torch.zeros(batch, pos_heads, slots + 1, dtype=torch.int32, device=self.device)
        self.slot_valid = torch.zeros(batch, meta_heads, slots + 1, dtype=torch.bool, device=self.device)
        fixed_shape(self.slot_valid, getattr(self, "slot_pos", None))
        self.policy.allocate(batch, heads, self.device)
        if self.key_rotation is not None:
            self.key_rotation = self.key_rotation.to(self.device)
        self.attention_from_codes = resolve_attention(self, self.device)
        if (dequantizes(self) or self.policy.reads_stored_keys) and hasattr(self.store, "reserve_reads"):
            self.store.reserve_reads()  # allocated eagerly, so compiled decode sees them with fixed shapes
        self.is_initialized = True

    def _check_budget_fits(self, batch: int, heads: int, meta_heads: int, slots: int, dtype, device) -> None:
        """A ValueError naming the size parameter and the bytes, when the buffers of a fixed budget certainly cannot
        be allocated: a lower bound of their bytes (slot metadata, plus keys and values at the model's dtype in a
        full-precision store, at 2 bits per value, the smallest format, otherwise) above the device's total memory
        (`psutil.virtual_memory().total` on CPU, `torch.cuda.get_device_properties(...).total_memory` on CUDA)."""
        if torch.compiler.is_compiling():  # a compiled prefill: the memory query cannot be traced (eager runs check)
            return
        device = torch.device(device)
        if device.type == "cuda":
            total, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s total memory"
        elif device.type == "cpu":
            try:
                import psutil

                total = psutil.virtual_memory().total
            except ImportError:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            where = "the machine's total memory"
        else:
            return
        from ..stores import FullPrecisionStore

        bits = dtype.itemsize * 8 if isinstance(self.store, FullPrecisionStore) else 2
        data = batch * heads * slots * (self.head_dim + self.value_dim) * bits // 8
        meta = batch * meta_heads * slots * (1 + (4 if self.policy.needs_positions else 0))
        if data + meta > total:
            names = " / ".join(f"`{name}`" for name in getattr(self, "size_parameters", ("budget",)))
            raise ValueError(
                f"Layer {self.layer_idx}: the cache's size ({names}: {slots - 1} token slots per row, batch {batch}, "
                f"{heads} KV heads of {self.head_dim}) would need at least {data + meta:,} bytes, more than "
                f"{where} ({total:,} bytes). Give a smaller {names}."
            )

    @property
    def trash_slot(self) -> int:
        return self.slot_valid.shape[-1] - 1

    def _ensure_slots(self, needed: int) -> None:
        """Growing policies grow their buffers by 1/8 at a time (amortised O(1) per token, never a per-step
        concatenation, and at most ~1/8 of the content allocated ahead)."""
        if needed <= self.trash_slot:
            return
        slots = max(needed, self.trash_slot + self.trash_slot // 8 + 16)
        pad = slots + 1 - self.slot_valid.shape[-1]
        self.store.grow(slots + 1)
        if self.slot_pos is not None:
            self.slot_pos = torch.nn.functional.pad(self.slot_pos, (0, pad))
        self.slot_valid = torch.nn.functional.pad(self.slot_valid, (0, pad))

    # -- the update ---------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.slot_valid.shape[0]:
            raise ValueError(
                f"Layer {self.layer_idx}: this cache holds a batch of {self.slot_valid.shape[0]} rows, but the forward "
                f"gave {key_states.shape[0]}: the batch size cannot change in the middle of a stream. Use "
                "`cache.reset()` to start a new one (or batch_repeat_interleave / batch_select_indices to change rows)."
            )
        if self._pending is not None:
            raise RuntimeError(
                f"Layer {self.layer_idx}: the previous forward's tokens were never placed because attention did not "
                "run through the hf_kvcache bridge; call `hf_kvcache.enable(model)`."
            )
        if torch.compiler.is_compiling() and not self.is_compileable and key_states.shape[-2] == 1:
            raise RuntimeError(
                f"Layer {self.layer_idx} ({type(self.policy).__name__} over {type(self.store).__name__}) is not "
                "compileable: its decode shapes grow with the stream. Compile a fixed-capacity cache (sink, sliding, "
                "h2o, random_eviction, composite with a budget, or fp8 / kivi with `max_length`), or run this one "
                "eagerly (generate does, by itself)."
            )
        info = self.forward_info.for_layer(self.layer_idx, self._served_forward, key_states.shape[-2])
        self._served_forward = info.serial
        self.forward_info.updated = self.layer_idx  # the next attention call reads this layer (bridge.attended_layer)
        if self.key_rotation is not None:
            if not info.attention_bridged:
                raise RuntimeError(
                    f"Layer {self.layer_idx}: this cache stores keys rotated (key_rotation), so queries must be "
                    "rotated too, which only the hf_kvcache attention bridge does; the model's attention "
                    "implementation is not the bridge. Call `hf_kvcache.enable(model)` after changing it."
                )
            key_states = rotate(key_states, self.key_rotation)
        q = key_states.shape[-2]
        real, positions = info.on(key_states.device)
        self.policy.begin(self.view, q)
        if self.policy.capacity is None:
            self._ensure_slots(self.policy.used_after(self.seen + q))

        if q == 1 and self.seen > 0 and not self.forward_info.has_padding:
            slot = self.policy.decode_slot(self.view, self.seen)
            if slot is not None:
                return self._decode_in_slot(slot, key_states, value_states, positions, real)
        if q == 1 and self.seen > 0:
            self._place_and_write(key_states, value_states, real, positions)
            self.seen += 1
            self.used = self.policy.used_after(self.seen)
            return self._decode_read()

        # Prefill or a multi-token chunk: attend to the stored past plus every new token, then keep the survivors.
        self.kernel_view = None  # (not kept through it: its writes may replace the buffers the view holds)
        self.policy.before_read(self.view)
        past_valid = self.slot_valid[..., : self.used]
        if codes_now(self, q):  # stand-ins: the bridge attends from the codes, new tokens in full precision
            keys, values = read_codes(self, self.used, key_states, value_states)
        elif self.used > 0:
            past_k, past_v = self.store.read(self.used)
            keys, values = torch.cat((past_k, key_states), -2), torch.cat((past_v, value_states), -2)
        else:
            keys, values = key_states, value_states
            watch_first_prefill(self, keys, values)
        new_valid = real[:, None, :].expand(-1, past_valid.shape[1], -1)
        self._attention_columns = torch.cat((past_valid, new_valid), -1)
        self._attention_query_len = q
        if self.policy.deferred:
            # The policy needs this forward's attention scores to choose survivors: it calls `commit` from the bridge.
            self._pending = Chunk(key_states, value_states, real, positions, self.seen)
        else:
            self._place_and_write(key_states, value_states, real, positions)
            self.used = self.policy.used_after(self.seen + q)
        self.seen += q
        return keys, values

    def _place_and_write(self, key_states, value_states, real, positions) -> None:
        """Let the policy place the new tokens and write them; during both, `incoming` holds (keys, values, position
        ids) of those tokens for policies that score them (key scorers), cleared afterwards even if either raises."""
        self.incoming = Incoming(key_states, value_states, positions)
        try:
            placement = self.policy.place(self.view, real, self.seen)
            self._write(placement, key_states, value_states, positions, self.seen)
        finally:
            self.incoming = None

    def _decode_in_slot(self, slot: int, key_states, value_states, positions, real):
        """Fast path for a one-token step (no padding so far) whose slot the policy knows without looking at data.
        The slot is used as a one-element index tensor (`index_copy_`), never to index in Python: under
        torch.compile a Python index specialises the graph on its value (a recompilation per step). The token's
        validity comes from the mask, on the device (a padding token here is masked, never read back)."""
        index = torch.full((1,), slot, dtype=torch.long, device=self.device)
        self.store.write_slot(slot, key_states, value_states, index=index)
        batch, meta_heads = self.slot_valid.shape[:2]
        self.slot_valid.index_copy_(2, index, real[:, None, :1].expand(batch, meta_heads, 1))
        if self.slot_pos is not None:
            pos_heads = self.slot_pos.shape[1]
            self.slot_pos.index_copy_(2, index, positions[:, None, :1].to(torch.int32).expand(batch, pos_heads, 1))
        self.policy.after_decode_write(self.view, slot, key_states, positions)
        self.seen += 1
        self.used = self.policy.used_after(self.seen)
        return self._decode_read()

    def _decode_read(self):
        """What attention reads in a decode step. Fixed-capacity policies always return all `capacity` slots (the
        empty ones masked invalid), so every decode step has the same shapes (compilable, like StaticCache)."""
        self.policy.before_read(self.view)
        width = self.policy.capacity if self.policy.capacity is not None else self.used
        self._attention_columns = self.slot_valid[..., :width]
        self._attention_query_len = 1
        return read_codes(self, width) if codes_now(self, 1) else self.store.read(width)

    def commit(self, placement) -> None:
        """Write the pending chunk's survivors (called by a deferred policy once it has the chunk's scores)."""
        chunk, self._pending = self._pending, None
        key_states, value_states, positions, seen_before = chunk.keys, chunk.values, chunk.positions, chunk.seen_before
        self._write(placement, key_states, value_states, positions, seen_before)
        self.used = self.policy.used_after(self.seen)

    def _write(self, placement, key_states, value_states, positions, seen_before: int) -> None:
        dest = torch.where(placement.dest >= 0, placement.dest, self.trash_slot)
        src = placement.src
        if src.shape[-1] == 1 and key_states.shape[-2] == 1:  # one token, one entry (decode): its source is token 0
            keys, values, token_pos = key_states, value_states, positions
        else:
            heads = key_states.shape[1]
            gather_index = src[..., None].expand(src.shape[0], heads, src.shape[-1], key_states.shape[-1])
            keys = key_states.gather(2, gather_index)
            values = value_states.gather(2, gather_index[..., :1].expand(-1, -1, -1, value_states.shape[-1]))
            token_pos = positions.gather(1, src[:, 0])
        self.store.write(dest, keys, values, start=placement.start, regions=placement.regions)
        self.slot_valid.scatter_(2, dest, placement.valid)
        if self.slot_pos is not None:
            pos = token_pos.to(torch.int32).unsqueeze(1).expand_as(dest)
            self.slot_pos.scatter_(2, *pooled_index(self.slot_pos, dest, pos))
        self.policy.after_write(self.view, placement, keys, dest, positions, seen_before)

    # -- what attention needs -----------------------------------------------------------------------------------
    def attention_validity(self) -> tuple[torch.Tensor, int] | None:
        """(validity [B, Hm, kv] of the columns of the last update, number of trailing causal columns), or None when
        transformers' own mask is already right (no padding ever seen and a policy without holes). Decode steps with a
        padding mask always get the layer's validity: deciding otherwise would mean reading the mask on the host."""
        # (fixed-capacity layers read all their slots in decode, empty ones included: always their own mask, decided
        # by a constant rather than by comparing counters, which torch.compile would guard on)
        decode_with_mask = self._attention_query_len == 1 and (
            self.forward_info.mask_given or self.policy.capacity is not None
        )
        if not (self.forward_info.has_padding or self.policy.may_have_holes or decode_with_mask):
            return None
        causal = self._attention_query_len if self._attention_query_len > 1 else 0
        return self._attention_columns, causal

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1 and self.seen > 0:
            kv_length = self.policy.capacity or self.policy.used_after(self.seen + 1)
        else:
            kv_length = self.used + query_length
        # A decode step of a cache still filling returns more columns than tokens seen (all `capacity` slots, the
        # empty ones masked by the layer's own validity): offset 0 then, as transformers' StaticLayer does.
        return kv_length, max(0, self.seen + query_length - kv_length)

    def get_seq_length(self) -> int:
        return self.seen

    def head_positions(self) -> torch.Tensor | None:
        """Each slot's position id per head [B, Hm, slots + 1]: `slot_pos` itself, or, for a head-pooled store
        (one position per slot, [B, 1, slots + 1]), a stride-0 view of it per head (no copy)."""
        if self.slot_pos is None or self.slot_pos.shape[1] == self.slot_valid.shape[1]:
            return self.slot_pos
        return self.slot_pos.expand_as(self.slot_valid)

    def get_max_length(self) -> int:
        return -1 if self.policy.capacity is None else self.policy.capacity

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes actually held: slot buffers (allocated, not just used), slot metadata and policy state."""
        if not self.is_initialized:
            return 0
        positions = self.slot_pos.nbytes if self.slot_pos is not None else 0
        return self.store.nbytes() + positions + self.slot_valid.nbytes + self.policy.nbytes()

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self.store.map_batch(fn)
        self.kernel_view = None
        self.slot_valid = fn(self.slot_valid)
        if self.slot_pos is not None:
            self.slot_pos = fn(self.slot_pos)
        self.policy.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def reset(self) -> None:
        self.store.reset()
        self.policy.reset()
        self.slot_pos = self.slot_valid = self._attention_columns = self.codes_read = self.kernel_view = None
        self.seen = self.used = 0
        self._pending = None
        self._served_forward = -1
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens (assisted decoding). Only possible while nothing was evicted: evicted tokens
        cannot come back, so cropping after an eviction raises."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove (got {tokens_to_remove}); "
                "positive values are not supported."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if not self.is_croppable:
            raise ValueError(
                f"Cannot crop {type(self.policy).__name__} after it evicted tokens ({self.seen} seen, capacity "
                f"{self.policy.capacity}): evicted tokens cannot come back."
            )
        new_seen = max(self.seen + tokens_to_remove, 0)
        self.policy.crop(self.view, new_seen)
        self.seen = new_seen
        self.used = self.policy.used_after(new_seen)
