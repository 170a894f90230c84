"""Cache allocators of transformers' continuous batching whose pages hold quantized tokens.

transformers (generation/continuous_batching/cache_allocators) has one allocator per attention type: full
attention (`FullAttentionCacheAllocator`) and sliding window (`SlidingAttentionCacheAllocator`, a ring buffer of
`sliding_window` tokens). They own the bookkeeping (block tables, the free pool, prefix sharing, read / write
indices); we inherit all of it and change what a page holds and how it is written and read:
- the page size in bytes: a token row is a `TokenRecord` (codes + scales) instead of `heads x head_dim` values in
  the model's dtype, so the same memory holds ~2x (FP8) / ~1.8x (INT8 g32) / ~3.2x (INT4 g32) the tokens;
- `update` (index-based path, used on CPU and by every non-flash implementation): new tokens are quantized and
  written at their physical indices; the tokens attention reads (the `read_index` of the batch's requests) are
  gathered and dequantized, and only those (a request's pages, never the whole cache, and never a copy kept);
- with attention from the codes (hf_kvcache.paged.codes_attention, `codes_attention` set by the cache) the
  full-attention allocator's `update` only writes, and the attention function reads the pages' codes where they lie;
- the block-table path (flash_attn_with_kvcache's paged decode) is declared unsupported
  (`supports_block_table = False`): transformers then disables its decode fast path for the cache
  (`PagedAttentionCache._infer_max_decode_fast_path_length` returns 0) and every batch takes the index path.
  `get_cache_for_block_table` raises a clear error if called anyway (flash kernels cannot read our codes).

Keys may be rotated by an orthogonal matrix before they are quantized and rotated back when read
(`PagedKVSpec.key_rotation`): q . k is unchanged and outlier channels are spread before FP8 rounding.
"""

from __future__ import annotations

import torch

from ..common.rotation import rotation_matrix
from ..integration.continuous_batching import FullAttentionCacheAllocator, SlidingAttentionCacheAllocator, find_head_dim
from ..stores.quantization import check_finite
from ..stores.workspace import DequantWorkspace
from .codes_attention import page_views
from .records import TokenRecord, decode_rows, encode_rows
from .spec import PagedKVSpec


class _QuantizedPagesMixin:
    """Shared by the full and sliding quantized allocators (placed before the transformers class in the MRO)."""

    kv_spec: PagedKVSpec
    supports_block_table = False

    def __init__(
        self,
        index,
        config,
        num_key_value_heads,
        cache_dtype,
        page_size,
        layer_indices,
        allow_block_sharing,
        kv_spec: PagedKVSpec,
    ):
        """transformers' allocator arguments plus our `kv_spec`; the record geometry is set before the transformers
        __init__ runs, since it sizes pages with `get_bytes_per_page`."""
        self._init_quantized(kv_spec, config, num_key_value_heads, cache_dtype, page_size)
        super().__init__(
            index=index,
            config=config,
            num_key_value_heads=num_key_value_heads,
            cache_dtype=cache_dtype,
            page_size=page_size,
            layer_indices=layer_indices,
            allow_block_sharing=allow_block_sharing,
        )

    def _init_quantized(self, kv_spec: PagedKVSpec, config, num_key_value_heads: int, cache_dtype, page_size: int):
        head_dim = find_head_dim(config)
        kv_spec.check_head_dim(head_dim)
        self.kv_spec = kv_spec
        self.record = TokenRecord(kv_spec.quant_spec(head_dim), num_key_value_heads, head_dim, cache_dtype)
        self.key_rotation = rotation_matrix(kv_spec.key_rotation, head_dim)
        self.workspace = DequantWorkspace()  # FP8 scratch, shared by the layers of the group
        self.model_dtype = cache_dtype

    def get_bytes_per_page(self, num_key_value_heads, head_dim, cache_dtype, page_size) -> int:
        """Bytes of one page of one layer: page_size key records + page_size value records."""
        return 2 * self.record.record_bytes * page_size

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        """Same geometry as transformers' full-attention allocator (rows of keys then values per page and layer),
        rows of `record_bytes` bytes; each layer gets one codec for keys and one for values over those rows."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        total_bytes = non_trash_bytes + 2 * bytes_per_sector
        total_tokens = (total_bytes // self.bytes_per_page) * self.tokens_per_page
        rows = cache_tensor[: total_tokens * 2 * self.record.record_bytes].view(total_tokens * 2, -1)
        self._rows = rows
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, rows, pool)
        device = cache_tensor.device
        self._codecs: dict[int, tuple] = {}
        for i, layer_idx in enumerate(self.layer_indices):
            pair = []
            for kind in (0, 1):  # keys, values
                codec = self.record.new_codec(device)
                codec.slot = self.record.codec_views(rows[(2 * i + kind) * self.tokens_per_page :])
                codec.capacity = codec.slot["data"].shape[2]
                pair.append(codec)
            self._codecs[layer_idx] = tuple(pair)
        if self.key_rotation is not None:
            self.key_rotation = self.key_rotation.to(device)

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError(
            f"{type(self).__name__}: the block-table path (flash_attn_with_kvcache paged decode) needs a GPU kernel "
            f"that reads {self.kv_spec.kv_dtype} codes with per-token scales, which flash-attention does not provide. "
            "Quantized pages declare supports_block_table=False so continuous batching takes the index-based path; "
            "set continuous_batching_config.max_blocks_per_request=0 if you called this directly."
        )

    def page_views(self, layer_idx: int):
        """The attention kernels' views of a layer's key and value pages (codes_attention.page_views)."""
        return page_views(*self._codecs[layer_idx])

    def token_rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value rows (bytes: codes and scales), indexed by physical token index (prompt
        eviction moves them as they are)."""
        i = self.layer_indices.index(layer_idx)
        return self._rows[2 * i * self.tokens_per_page :], self._rows[(2 * i + 1) * self.tokens_per_page :]

    def read_keys(self, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
        """The layer's keys [n, heads, head_dim] at physical `rows`, dequantized and unrotated (prompt eviction's
        scores read them)."""
        keys = decode_rows(self._codecs[layer_idx][0], rows, self.model_dtype, self.workspace)
        if self.key_rotation is not None:
            keys = (keys.float() @ self.key_rotation.T).to(self.model_dtype)
        return keys

    # -- quantized write / read -------------------------------------------------------------------------------
    def _write(self, layer_idx: int, key_states, value_states, write_index) -> torch.Tensor:
        """Quantize the new tokens [n, heads, head_dim] into their pages; returns the keys as written (rotated by
        `key_rotation`, before rounding)."""
        check_finite(key_states, value_states, f"quantized paged cache, layer {layer_idx}")
        k_codec, v_codec = self._codecs[layer_idx]
        if self.key_rotation is not None:
            key_states = (key_states.float() @ self.key_rotation).to(key_states.dtype)
        k_codec.put(encode_rows(k_codec, key_states), index=write_index)
        v_codec.put(encode_rows(v_codec, value_states), index=write_index)
        return key_states

    def _read(self, layer_idx: int, read_index, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k_codec, v_codec = self._codecs[layer_idx]
        keys = decode_rows(k_codec, read_index, dtype, self.workspace)
        values = decode_rows(v_codec, read_index, dtype, self.workspace)
        if self.key_rotation is not None:
            keys = (keys.float() @ self.key_rotation.T).to(dtype)
        return keys, values


class QuantizedFullAttentionCacheAllocator(_QuantizedPagesMixin, FullAttentionCacheAllocator):
    """Full-attention layers, quantized pages. Built by QuantizedPagedAttentionCache with its `kv_spec`."""

    #: set by QuantizedPagedAttentionCache.update before each layer's update: (read positions, new-token
    #: positions) of the requests whose first forward this is (boolean masks), or None
    first_forward: tuple[torch.Tensor, torch.Tensor] | None = None
    #: set by QuantizedPagedAttentionCache: attention can read this allocator's codes
    codes_attention: bool = False
    #: set by QuantizedPagedAttentionCache around an update whose attention reads the codes: write only
    write_only: bool = False
    #: after a write-only update: the new tokens as the kernel reads them ([1, heads, n, D] keys as written, values)
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Write the new tokens (quantized), then read the batch's requests back (dequantized), as transformers'
        full-attention allocator does in the model's dtype. A request's first forward (a prompt, or the first chunk
        of one) attends to its own tokens unquantized, as our QuantizedFP8Cache does with its first prefill (and
        as transformers' allocator does for a batch of whole prefills). With `write_only`: write only, keep the new
        tokens in `fresh` and return no rows (the attention function reads the pages)."""
        if self.write_only:
            keys = self._write(layer_idx, key_states, value_states, write_index)
            self.fresh = tuple(x.transpose(0, 1).unsqueeze(0) for x in (keys, value_states))
            return key_states[:0], value_states[:0]
        self._write(layer_idx, key_states, value_states, write_index)
        if read_index.numel() == 0:
            return key_states, value_states
        keys, values = self._read(layer_idx, read_index, key_states.dtype)
        if self.first_forward is not None:
            read_mask, new_mask = self.first_forward
            read_mask = read_mask.view(-1, 1, 1)
            keys = keys.contiguous().masked_scatter_(read_mask, key_states[new_mask])
            values = values.contiguous().masked_scatter_(read_mask, value_states[new_mask])
        return keys, values


class QuantizedSlidingAttentionCacheAllocator(_QuantizedPagesMixin, SlidingAttentionCacheAllocator):
    """Sliding-window layers (ring buffer of `sliding_window` tokens), quantized pages."""

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Read the kept window first (the new tokens may overwrite it), put the new tokens at the sentinel slots
        unquantized, then write them (quantized): transformers' sliding allocator, with codes."""
        if read_index.numel() == 0:
            self._write(layer_idx, key_states, value_states, write_index)
            return key_states, value_states
        keys, values = self._read(layer_idx, read_index, key_states.dtype)
        mask = (read_index == self.sentinel_index).unsqueeze(-1).unsqueeze(-1)
        keys = keys.contiguous().masked_scatter_(mask, key_states)
        values = values.contiguous().masked_scatter_(mask, value_states)
        self._write(layer_idx, key_states, value_states, write_index)
        return keys, values


ALLOCATORS = {
    FullAttentionCacheAllocator.layer_type: QuantizedFullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator.layer_type: QuantizedSlidingAttentionCacheAllocator,
}
