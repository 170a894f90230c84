"""Attention over head pages (hf_kvcache.paged.head_pages): every (KV head, request) pair of a layer is one sequence of
the paged kernels, with one KV head, its queries the head's group of query heads laid out head-major; the native CPU
kernel (`kernels.cpu_blockwise.paged_attention`), the Triton one (`kernels.triton_paged`), or a PyTorch loop where
neither runs. Called by hf_kvcache.paged's batch attention wrapper (codes_attention) with the layer's queries."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import cpu_blockwise, triton_paged
from .codes_attention import fresh_views
from .records import decode_rows


@dataclass
class HeadPagedCodes:
    """One layer's forward in head pages, as the attention function needs it: every (KV head, request) pair is one
    sequence of the paged kernels, with one KV head, its queries the head's group of query heads."""

    returned: tuple  # the (empty) keys and values the cache's update returned
    allocator: object  # the HeadPagedAllocator
    fresh_keys: torch.Tensor  # [1, 1, heads x tokens, Dk], head-major, rotated as the pages' keys
    fresh_values: torch.Tensor
    read_index: torch.Tensor  # the pairs' rows, pairs in (head, request) order
    cu_seq_lens_q: torch.Tensor  # [heads x R + 1]
    cu_seq_lens_k: torch.Tensor  # [heads x R + 1]
    tokens: int  # the batch's new tokens (padding excluded)
    max_q: int

    def attend(self, query, scaling, softcap=None, sinks=None, backend: str = "auto") -> torch.Tensor:
        """query [1, Hq, N, Dk] -> [1, N, Hq, Dv] (zero for padding queries), in the query's dtype. `backend`:
        "native", "triton", "torch" or "auto" (the allocator's)."""
        if sinks is not None:
            raise ValueError("`kv_compress_layout` 'head' does not run attention sinks (per query head) yet")
        allocator = self.allocator
        heads, hq, n = allocator.num_key_value_heads, query.shape[1], query.shape[2]
        groups, t = hq // heads, self.tokens
        scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        # [Hq, T, D] -> [groups, heads x T, D]: query head h x groups + g of token i is row h x T + i of group g
        q = query[0, :, :t].unflatten(0, (heads, groups)).transpose(0, 1).reshape(groups, heads * t, -1)
        backend = allocator.backend if backend == "auto" else backend
        if backend == "native":
            out = self._native(q, scaling, softcap)
        elif backend == "triton":
            qr = q.float() if allocator.key_rotation is None else q.float() @ allocator.key_rotation.float()
            out = triton_paged.triton_paged_attention(
                qr, *allocator.pages, self.fresh_keys, self.fresh_values, self.cu_seq_lens_q, self.cu_seq_lens_k,
                self.read_index, scaling, self.max_q, softcap=softcap,
            )  # fmt: skip
        else:
            out = self._torch(q, scaling, softcap)
        dv = out.shape[-1]
        out = out.view(groups, heads, t, dv).transpose(0, 1).reshape(hq, t, dv)
        if t < n:
            out = torch.cat([out, out.new_zeros(hq, n - t, dv)], 1)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)

    def _native(self, q, scaling, softcap):
        allocator = self.allocator
        fresh = fresh_views(self.fresh_keys, self.fresh_values)
        return cpu_blockwise.paged_attention(
            q, allocator.flat, fresh, self.fresh_values.shape[-1], 1, self.cu_seq_lens_q, self.cu_seq_lens_k,
            self.read_index, scaling, softcap=softcap, query_rotation=allocator.key_rotation,
        )  # fmt: skip

    def _torch(self, q, scaling, softcap):
        """Pair by pair in PyTorch (where no kernel runs): the stored rows dequantized, a pair in its first forward
        attending to its own new tokens unquantized, as the kernels do."""
        allocator = self.allocator
        keys = decode_rows(allocator.codecs[0], self.read_index, torch.float32, allocator.workspace)[:, 0]
        values = decode_rows(allocator.codecs[1], self.read_index, torch.float32, allocator.workspace)[:, 0]
        if allocator.key_rotation is not None:
            keys = keys @ allocator.key_rotation.float().T
        fresh_k, fresh_v = (x[0, 0].float() for x in (self.fresh_keys, self.fresh_values))
        if allocator.key_rotation is not None:
            fresh_k = fresh_k @ allocator.key_rotation.float().T
        out = q.new_zeros(q.shape[0], q.shape[1], values.shape[-1], dtype=torch.float32)
        cu_q, cu_k = self.cu_seq_lens_q.tolist(), self.cu_seq_lens_k.tolist()
        for p in range(len(cu_q) - 1):
            qs, qe, ks, ke = cu_q[p], cu_q[p + 1], cu_k[p], cu_k[p + 1]
            if qe == qs:
                continue
            nq, nk = qe - qs, ke - ks
            k, v = (fresh_k[qs:qe], fresh_v[qs:qe]) if nq == nk else (keys[ks:ke], values[ks:ke])
            s = (q[:, qs:qe].float() @ k.T) * scaling
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            causal = (
                torch.arange(nk, device=q.device)[None, :] <= (nk - nq + torch.arange(nq, device=q.device))[:, None]
            )
            s = s.masked_fill(~causal, float("-inf"))
            out[:, qs:qe] = s.softmax(-1) @ v
        return out


__all__ = ["HeadPagedCodes"]
