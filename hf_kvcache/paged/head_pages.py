"""Pages of one (layer, KV head): budgets per layer and per head inside continuous batching's pages.

transformers' full-attention allocator stores a token as one row holding every KV head, and a block is one page of
every layer: a request holds the same tokens in all heads and the same number in all layers. `HeadPagedAllocator`
(`kv_compress_layout` "head", as KV-Compress, arXiv 2410.00161, lays out vLLM's pages) keeps transformers'
bookkeeping (the free pool, sectors, block ids, admission through `needs_new_blocks`, CPU offloading's block copies)
and changes what a block is:

- a block is one page of ONE layer and ONE KV head: `page_size` key rows then `page_size` value rows, a row holding
  one head's `head_dim` values in the model's dtype, or their FP8 / INT codes and scales (`TokenRecord` of one head).
  Blocks are taken from one pool by every layer and head;
- each request has a page table per *stream* (a (layer, head) pair, layer-major: stream = layer x heads + head) and a
  length per stream (`lengths`): a compressed request holds the sum over streams of what each keeps, plus at most one
  partial page per stream, and `needs_new_blocks` / `allocate_cache_to_request` count exactly those pages, so
  transformers' scheduler admits by the pages really held;
- transformers' own read / write indices are not used (they name one row per token for all heads): the batch's
  requests are noted as transformers prepares it (`get_write_indices`, request by request in order), and at the
  forward's first layer `plan_forward` computes each stream's write rows and each (head, request) pair's read rows
  (vectorized, on the cache's device); attention (`HeadPagedCodes.attend`, called by hf_kvcache.paged's batch
  attention wrapper) runs the paged kernels with one KV head per pair: the native CPU kernel
  (`kernels.cpu_blockwise.paged_attention`) or the Triton one (`kernels.triton_paged`), reading the codes in place;
  a plain PyTorch loop where neither runs.

The block table transformers sees (`block_table[request]`) is the request's blocks in the order they were taken, so a
request's blocks are freed, counted and copied (CPU offloading) by transformers' code; the stream and page of each is
kept when a request is freed (`_saved`), so a request restored from CPU gets its streams back in the same order.
Fragmentation: at most one partial page per stream, i.e. up to layers x heads x (page_size - 1) rows per request
(docs/serving.md chooses the page size for it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..common.rotation import rotation_matrix
from ..integration.continuous_batching import FullAttentionCacheAllocator, find_head_dim
from ..stores.quantization import QuantSpec, check_finite
from ..stores.workspace import DequantWorkspace
from .codes_attention import native_views, page_views
from .head_attention import HeadPagedCodes
from .records import TokenRecord, decode_rows, encode_rows
from .spec import PagedKVSpec

#: requests offloaded whose stream layout is kept for a restore from CPU (the most recent ones)
_SAVED_LAYOUTS = 1024


@dataclass
class ForwardPlan:
    """One forward's rows in head pages, computed once for the batch and read by every layer."""

    requests: int  # R: the batch's requests, in order
    tokens: int  # their new tokens (padding excluded), packed in request order
    write_rows: torch.Tensor  # [tokens, streams]: where each new token of each stream is written
    read_rows: torch.Tensor  # every (stream, request) pair's rows, pairs in (stream, request) order
    read_starts: list[int]  # per layer: the offset of its pairs' rows in `read_rows` (+ the total last)
    cu_k: torch.Tensor  # [streams x R + 1]: cumulative keys per (stream, request) pair (over all layers)
    cu_q: torch.Tensor  # [heads x R + 1]: one layer's pairs' queries, packed head-major ([heads x tokens] rows)
    max_q: int  # the most new tokens of one request


class HeadPagedAllocator(FullAttentionCacheAllocator):
    """Full-attention layers in pages of one (layer, KV head); model-dtype rows, or quantized by `kv_spec`."""

    supports_block_table = False  # flash's block-table decode reads rows of every head
    supports_block_sharing = False  # a page of one head of a compacted request names no token sequence

    def __init__(
        self,
        index,
        config,
        num_key_value_heads,
        cache_dtype,
        page_size,
        layer_indices,
        allow_block_sharing,
        kv_spec: PagedKVSpec | None = None,
    ):
        self.head_dim = head_dim = find_head_dim(config)
        self.num_key_value_heads = num_key_value_heads
        self.cache_dtype = self.model_dtype = cache_dtype
        self.kv_spec = kv_spec
        if kv_spec is not None:
            kv_spec.check_head_dim(head_dim)
        quant = kv_spec.quant_spec(head_dim) if kv_spec is not None else QuantSpec("none")
        self.record = TokenRecord(quant, 1, head_dim, cache_dtype)  # one head per row
        self.key_rotation = rotation_matrix(kv_spec.key_rotation, head_dim) if kv_spec is not None else None
        self.workspace = DequantWorkspace()
        self.streams = len(layer_indices) * num_key_value_heads
        self._before_cache_tensor_init(
            index=index,
            layer_indices=layer_indices,
            tokens_per_page=page_size,
            bytes_per_page=2 * self.record.record_bytes * page_size,
            allow_block_sharing=False,
        )
        # a block is one page of one stream (transformers' is one page of every layer of the group)
        self.pages_per_block, self.tokens_per_block = 1, page_size
        self.block_physical_stride, self.bytes_per_block = 2 * page_size, self.bytes_per_page
        self.tables: dict[str, list[list[int]]] = {}  # request -> per stream: its blocks, in page order
        self.lengths: dict[str, list[int]] = {}  # request -> per stream: the tokens written
        self._saved: OrderedDict[str, tuple[list[int], list[tuple[int, int]]]] = OrderedDict()
        self.plan: ForwardPlan | None = None
        self._batch: list[tuple[str, int]] = []  # the next forward's requests, as transformers prepares them
        #: how attention reads the pages: "native" (CPU kernel), "triton" (CUDA kernel) or "torch" (a PyTorch loop
        #: where neither runs); set by the cache
        self.backend = "torch"
        #: per layer: the new tokens as the kernel reads them, set by `update` ([1, 1, heads x tokens, D] each)
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def get_bytes_per_page(cls, num_key_value_heads, head_dim, cache_dtype, page_size) -> int:
        return 2 * num_key_value_heads * head_dim * cache_dtype.itemsize * page_size  # (transformers' whole rows)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        """Rows of `record_bytes` (one head of one token) over the whole tensor; one key codec and one value codec
        over them, shared by every layer and head (a block's key rows are `block x 2 x page_size + [0, page_size)`,
        its value rows the `page_size` after)."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        total_bytes = non_trash_bytes + 2 * bytes_per_sector
        total_rows = (total_bytes // self.bytes_per_page) * 2 * self.tokens_per_page
        rows = cache_tensor[: total_rows * self.record.record_bytes].view(total_rows, -1)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, rows, pool)
        self._rows = (rows, rows[self.tokens_per_page :])
        device = cache_tensor.device
        self.codecs = []
        for kind_rows in self._rows:
            codec = self.record.new_codec(device)
            codec.slot = self.record.codec_views(kind_rows)
            codec.capacity = codec.slot["data"].shape[2]
            self.codecs.append(codec)
        self.pages = page_views(*self.codecs)
        self.flat = native_views(self.pages)
        if self.key_rotation is not None:
            self.key_rotation = self.key_rotation.to(device)

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("head pages have no block-table path (flash's paged decode reads every head's row)")

    # -- bookkeeping (transformers' scheduler calls these) ---------------------------------------------------------
    def _pages(self, length: int) -> int:
        return -(-length // self.tokens_per_page)

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        lengths = self.lengths.get(request_id)
        if lengths is None:
            saved = self._saved.get(request_id) if past_length else None
            lengths = saved[0] if saved is not None else [past_length] * self.streams
            return sum(self._pages(n + query_length) for n in lengths)
        tables = self.tables[request_id]
        return sum(max(0, self._pages(n + query_length) - len(t)) for n, t in zip(lengths, tables))

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
        if request_id not in self.lengths:
            self._open(request_id, past_length)
        tables, lengths, flat = self.tables[request_id], self.lengths[request_id], self.block_table[request_id]
        for n, table in zip(lengths, tables):
            missing = self._pages(n + query_length) - len(table)
            if missing > 0:
                blocks = self.pool.get_free_blocks(self.index, missing)
                table.extend(blocks)
                flat.extend(blocks)

    def _open(self, request_id: str, past_length: int) -> None:
        """A request's first allocation: empty streams, or (restored from CPU, `past_length` > 0) its streams as they
        were, their blocks taken in the order its old blocks were (the order transformers copies them back in)."""
        saved = self._saved.pop(request_id, None) if past_length else None
        if not past_length:
            self._saved.pop(request_id, None)
        if saved is None:
            self.tables[request_id] = [[] for _ in range(self.streams)]
            self.lengths[request_id] = [past_length] * self.streams
            self.block_table[request_id] = []
            if past_length:  # (restored without a saved layout: every stream holds the same tokens)
                self.allocate_cache_to_request(request_id, 0, past_length)
            return
        lengths, order = saved
        blocks = self.pool.get_free_blocks(self.index, len(order))
        pages = [0] * self.streams
        for stream, _ in order:
            pages[stream] += 1
        tables: list[list[int]] = [[0] * n for n in pages]
        for block, (stream, page) in zip(blocks, order):
            tables[stream][page] = block
        self.tables[request_id], self.lengths[request_id] = tables, list(lengths)
        self.block_table[request_id] = list(blocks)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """transformers' free; a request offloaded (transformers frees it with `no_cache`, then copies its blocks back
        in order on restore) keeps its stream layout for the restore (`_saved`)."""
        tables = self.tables.pop(request_id, None)
        lengths = self.lengths.pop(request_id, None)
        if tables is not None and no_cache:
            where = {block: (s, p) for s, table in enumerate(tables) for p, block in enumerate(table)}
            self._saved[request_id] = (lengths, [where[b] for b in self.block_table.get(request_id, [])])
            self._saved.move_to_end(request_id)
            while len(self._saved) > _SAVED_LAYOUTS:
                self._saved.popitem(last=False)
        super().free_blocks(request_id, no_cache)

    def free_all_requests(self) -> None:
        self.tables.clear()
        self.lengths.clear()
        self._saved.clear()
        super().free_all_requests()

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int):
        pairs = super().fork_blocks(source_request_id, dest_request_id, past_length)
        where = {b: (s, p) for s, table in enumerate(self.tables[source_request_id]) for p, b in enumerate(table)}
        tables = [list(t) for t in self.tables[source_request_id]]
        for old, new in zip(self.block_table[source_request_id], self.block_table[dest_request_id]):
            stream, page = where[old]
            tables[stream][page] = new
        self.tables[dest_request_id] = tables
        self.lengths[dest_request_id] = list(self.lengths[source_request_id])
        return pairs

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        """(transformers' batch preparation, request by request in the batch's order) Note the request for this
        forward's plan; transformers' own write rows are the trash (each layer's `update` writes every stream)."""
        self._batch.append((request_id, query_length))
        return [self.write_trash_index] * query_length

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return [self.read_trash_index] * (past_length + query_length)  # (plan_forward reads each pair's rows)

    def set_batch(self, batch: list[tuple[str, int]]) -> None:
        """The next forward's requests [(request id, new tokens)] in the packed order, from the batch itself (prompt
        eviction's step hook: authoritative where a preparation left notes of a batch that never ran)."""
        self._batch = list(batch)

    def held_blocks(self, request_id: str) -> int:
        """The blocks (pages of one stream) `request_id` holds."""
        return len(self.block_table.get(request_id, ()))

    # -- one forward -----------------------------------------------------------------------------------------------
    def plan_forward(self, batch: list[tuple[str, int]], device) -> ForwardPlan:
        """The rows of this forward for `batch` [(request id, new tokens)] in the packed order; the streams' lengths
        then count the new tokens (written by each layer's `update`)."""
        heads, streams, ps = self.num_key_value_heads, self.streams, self.tokens_per_page
        before = [self.lengths[rid] for rid, _ in batch]
        queries = [q for _, q in batch]
        requests, tokens = len(batch), sum(queries)
        widest = max(len(t) for rid, _ in batch for t in self.tables[rid])
        table = torch.tensor(
            [[t + [0] * (widest - len(t)) for t in self.tables[rid]] for rid, _ in batch], dtype=torch.long
        ).to(device)  # [R, S, P]
        held = torch.tensor(before, dtype=torch.long).to(device)  # [R, S]
        q = torch.tensor(queries, dtype=torch.long).to(device)
        cu = torch.zeros(requests + 1, dtype=torch.long, device=device)
        cu[1:] = q.cumsum(0)
        # writes: token t of request r at position held[r, s] + t of each stream s
        owner = torch.repeat_interleave(torch.arange(requests, device=device), q, output_size=tokens)
        local = torch.arange(tokens, device=device) - cu[owner]
        position = held[owner] + local[:, None]  # [T, S]
        page = table[owner[:, None], torch.arange(streams, device=device)[None, :], position // ps]
        write_rows = page * 2 * ps + position % ps
        # reads: each (stream, request) pair's positions [0, held + q)
        counts = [[n + qr for n in lengths] for lengths, qr in zip(before, queries)]  # [R][S]
        pair_counts = [counts[r][s] for s in range(streams) for r in range(requests)]
        total = sum(pair_counts)
        n = torch.tensor(pair_counts, dtype=torch.long).to(device)
        cu_k = torch.zeros(streams * requests + 1, dtype=torch.long, device=device)
        cu_k[1:] = n.cumsum(0)
        pair = torch.repeat_interleave(torch.arange(streams * requests, device=device), n, output_size=total)
        j = torch.arange(total, device=device) - cu_k[pair]
        pair_tables = table.transpose(0, 1).reshape(streams * requests, widest)
        read_rows = pair_tables[pair, j // ps] * 2 * ps + j % ps
        per_layer = heads * requests
        starts = [0]
        for layer in range(len(self.layer_indices)):
            starts.append(starts[-1] + sum(pair_counts[layer * per_layer : (layer + 1) * per_layer]))
        cu_q = torch.cat([h * tokens + cu[:-1] for h in range(heads)] + [cu.new_tensor([heads * tokens])])
        for (rid, qr), lengths in zip(batch, before):
            self.lengths[rid] = [n_ + qr for n_ in lengths]
        self.plan = ForwardPlan(requests, tokens, write_rows, read_rows, starts, cu_k, cu_q, max(queries))
        return self.plan

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Write the forward's new tokens [N, heads, D] into each stream's pages (the plan's rows), keep them as the
        kernel reads them (`fresh`), and return no rows: attention reads the pages (HeadPagedCodes)."""
        if layer_idx == self.layer_indices[0]:  # a new forward: plan it for the requests transformers prepared
            self.plan_forward(self._batch, key_states.device)
            self._batch = []
        plan, heads = self.plan, self.num_key_value_heads
        check_finite(key_states, value_states, f"head pages, layer {layer_idx}")
        layer = self.layer_indices.index(layer_idx)
        keys, values = key_states[: plan.tokens], value_states[: plan.tokens]
        if self.key_rotation is not None:
            keys = (keys.float() @ self.key_rotation).to(keys.dtype)
        rows = plan.write_rows[:, layer * heads : (layer + 1) * heads].reshape(-1)
        for codec, x in zip(self.codecs, (keys, values)):
            codec.put(encode_rows(codec, x.reshape(-1, 1, x.shape[-1])), index=rows)
        # the kernel's fresh tokens: [1, 1, heads x tokens, D], head-major, as the pairs are
        self.fresh = tuple(x.transpose(0, 1).reshape(1, 1, heads * plan.tokens, -1) for x in (keys, values))
        return key_states[:0], value_states[:0]

    def layer_codes(self, layer_idx: int, returned) -> HeadPagedCodes:
        """What the attention of layer `layer_idx` reads in this forward (after its `update`)."""
        plan, heads, layer = self.plan, self.num_key_value_heads, self.layer_indices.index(layer_idx)
        pairs = heads * plan.requests
        cu_k = plan.cu_k[layer * pairs : (layer + 1) * pairs + 1]
        start, end = plan.read_starts[layer], plan.read_starts[layer + 1]
        fresh_keys, fresh_values = self.fresh
        self.fresh = None
        return HeadPagedCodes(
            returned=returned,
            allocator=self,
            fresh_keys=fresh_keys,
            fresh_values=fresh_values,
            read_index=plan.read_rows[start:end],
            cu_seq_lens_q=plan.cu_q,
            cu_seq_lens_k=cu_k - cu_k[0],
            tokens=plan.tokens,
            max_q=plan.max_q,
        )

    # -- what prompt eviction reads and moves ----------------------------------------------------------------------
    def stream_rows(self, request_id: str, stream: int, positions: torch.Tensor) -> torch.Tensor:
        """The key rows of `positions` [n] of one of the request's streams (value rows: + page_size)."""
        table = torch.tensor(self.tables[request_id][stream], dtype=torch.long, device=positions.device)
        ps = self.tokens_per_page
        return table[positions // ps] * 2 * ps + positions % ps

    def read_keys(self, request_id: str, layer: int, length: int, device) -> torch.Tensor:
        """Layer `layer` (its index in the group)'s keys [heads, length, D] of positions [0, length) of every head,
        dequantized and unrotated (prompt eviction's scores read them)."""
        positions = torch.arange(length, device=device)
        heads = self.num_key_value_heads
        rows = torch.cat([self.stream_rows(request_id, layer * heads + h, positions) for h in range(heads)])
        keys = decode_rows(self.codecs[0], rows, self.model_dtype, self.workspace)[:, 0]  # [heads x length, D]
        if self.key_rotation is not None:
            keys = (keys.float() @ self.key_rotation.T).to(self.model_dtype)
        return keys.view(heads, length, -1)

    def read_stream_keys(self, request_id: str, stream: int, length: int, device) -> torch.Tensor:
        """One stream's keys [length, D] (its first `length` tokens), dequantized and unrotated."""
        rows = self.stream_rows(request_id, stream, torch.arange(length, device=device))
        keys = decode_rows(self.codecs[0], rows, self.model_dtype, self.workspace)[:, 0]
        if self.key_rotation is not None:
            keys = (keys.float() @ self.key_rotation.T).to(self.model_dtype)
        return keys

    def compact(self, request_id: str, kept: list[torch.Tensor]) -> int:
        """Keep the positions `kept[stream]` (ascending) of each stream, moved to its front as they are (codes and
        scales, or values), and give back the pages past them; returns the pages freed."""
        src, dest = [], []
        for stream, positions in enumerate(kept):
            src.append(self.stream_rows(request_id, stream, positions))
            dest.append(self.stream_rows(request_id, stream, torch.arange(positions.numel(), device=positions.device)))
        src, dest = torch.cat(src), torch.cat(dest)
        for rows in self._rows:
            rows.index_copy_(0, dest, rows.index_select(0, src))  # (read all before writing)
        tables, flat = self.tables[request_id], self.block_table[request_id]
        freed = []
        for stream, positions in enumerate(kept):
            keep = self._pages(positions.numel())
            freed.extend(tables[stream][keep:])
            del tables[stream][keep:]
        gone = set(freed)
        flat[:] = [b for b in flat if b not in gone]
        self.lengths[request_id] = [int(p.numel()) for p in kept]
        released = [block for block in freed if self.ledger.release(block, no_cache=True)]
        self.pool.free_blocks(self.index, released)
        return len(freed)


__all__ = ["ForwardPlan", "HeadPagedAllocator"]
