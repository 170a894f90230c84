"""Attention straight from quantized keys and values, block by block (flash-decoding with a running max and sum).

    out = blockwise_attention(query, keys, values, valid, scaling)      # [B, Hq, q, Dv] in query.dtype
    out, scores = blockwise_attention(..., return_column_scores=True)   # scores [B, Hq, n] float32

`keys` / `values`: a `QuantizedKV` or a sequence of them (segments concatenated along the tokens, e.g. a store's
quantized part then its full-precision residual; key and value segments pairwise of equal length). Keys and values
may differ in format and head size (Dk != Dv). GQA: query head h reads KV head h // (Hq // Hkv).

Contract (the same as "dequantize everything, then softmax attention" in float32):
- logits = (query . key) * scaling, then `softcap * tanh(logits / softcap)` if `softcap` (Gemma 2);
- `valid` bool [B, Hkv or 1, n]: False columns are not attended;
- `causal_tail` (0 or q): the last q columns are the new tokens in order, causal among themselves, and each query
  always sees its own column (as `hf_kvcache.attention.build_validity_mask`, so such rows are never empty);
- `sinks` [Hq]: one extra logit per query head in the softmax denominator, attached to no value (GPT-OSS);
- a row with no visible column (and no sink) has a zero output and zero column scores (never NaN);
- column scores: the probability each column received summed over the queries, weighted by `query_weight` [B, q].

Memory: the torch path dequantizes `block` tokens of keys and values at a time (float32), so besides the output
(and the scores, if asked) it holds O(B x Hq x q x block) extra, whatever n is. Column scores need the final
normaliser: with one query per row (decode) each block's unnormalised probabilities are written into the score
buffer with their block maximum and rescaled once at the end (single pass); with q > 1 a second pass recomputes
the logits block by block against the final log-sum-exp (keys are dequantized twice).

Backends: "torch" (any device; no host-device sync: blocks come from Python ints; compiles with
`torch.compile(fullgraph=True)`), "triton" (`triton_blockwise`, decode: Hq / Hkv x q <= 128 query rows per KV
head; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), "native" (`cpu_blockwise`, a C++ kernel built on
first use: CPU tensors, eager code), "auto" (in eager code: triton for CUDA tensors when it can run, native for CPU
tensors when it builds; else, and under torch.compile, torch; never the interpreter).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from . import cpu_blockwise
from .codes import QuantizedKV, dequantize_block

BACKENDS = ("auto", "torch", "triton", "native")


def _segments(kv, name: str) -> list[QuantizedKV]:
    segs = [kv] if isinstance(kv, QuantizedKV) else list(kv)
    if not segs or not all(isinstance(s, QuantizedKV) for s in segs):
        raise TypeError(f"blockwise_attention: `{name}` must be a QuantizedKV or a non-empty sequence of them")
    first = segs[0]
    for s in segs[1:]:
        if (s.batch, s.heads, s.head_dim) != (first.batch, first.heads, first.head_dim):
            raise ValueError(
                f"blockwise_attention: the segments of `{name}` differ in [B, H, D]: "
                f"{[[t.batch, t.heads, t.head_dim] for t in segs]}"
            )
    return segs


def check_inputs(query, keys, values, valid, scaling, block, causal_tail, softcap, sinks):
    """Validated (key segments, value segments, total tokens); raises ValueError naming the bad parameter."""
    if query.dim() != 4 or not query.is_floating_point():
        raise ValueError(
            f"blockwise_attention: `query` must be a float [B, Hq, q, Dk] tensor, got {query.dtype} {list(query.shape)}"
        )
    ks, vs = _segments(keys, "keys"), _segments(values, "values")
    if [s.length for s in ks] != [s.length for s in vs]:
        raise ValueError(
            f"blockwise_attention: key and value segments must have equal lengths, got "
            f"{[s.length for s in ks]} and {[s.length for s in vs]}"
        )
    b, hq, q, dk = query.shape
    k0, v0 = ks[0], vs[0]
    if (k0.batch, v0.batch) != (b, b) or k0.heads != v0.heads:
        raise ValueError(
            f"blockwise_attention: keys [B={k0.batch}, H={k0.heads}] and values [B={v0.batch}, "
            f"H={v0.heads}] must match the query's batch {b} and each other's heads"
        )
    if hq % k0.heads:
        raise ValueError(f"blockwise_attention: query heads ({hq}) must be a multiple of KV heads ({k0.heads})")
    if k0.head_dim != dk:
        raise ValueError(f"blockwise_attention: key head dim ({k0.head_dim}) != query head dim ({dk})")
    n = sum(s.length for s in ks)
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"blockwise_attention: `block` must be an int >= 1, got {block!r}")
    for name, segs in (("keys", ks), ("values", vs)):
        for s in segs:
            if block % s.token_alignment:
                raise ValueError(
                    f"blockwise_attention: `block` ({block}) must be a multiple of {s.token_alignment} "
                    f"for these {name} (channel scales / token packing cover that many tokens)"
                )
    if causal_tail not in (0, q):
        raise ValueError(f"blockwise_attention: `causal_tail` must be 0 or the query length {q}, got {causal_tail}")
    if causal_tail > n:
        raise ValueError(f"blockwise_attention: `causal_tail` ({causal_tail}) exceeds the {n} key columns")
    if valid is not None and (
        valid.dtype != torch.bool
        or valid.dim() != 3
        or valid.shape[0] != b
        or valid.shape[2] != n
        or valid.shape[1] not in (1, k0.heads)
    ):
        raise ValueError(
            f"blockwise_attention: `valid` must be bool [B={b}, Hkv={k0.heads} or 1, n={n}], got "
            f"{valid.dtype} {list(valid.shape)}"
        )
    if not isinstance(scaling, (int, float)):
        raise ValueError(f"blockwise_attention: `scaling` must be a Python float, got {type(scaling).__name__}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"blockwise_attention: `softcap` must be None or > 0, got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"blockwise_attention: `sinks` must be [Hq={hq}] logits, got {list(sinks.shape)}")
    return ks, vs, n


def block_mask(valid, causal_tail: int, c0: int, c1: int, n: int, q: int, rows: int, device):
    """Visibility [B or 1, Hkv or 1, rows, c1 - c0] of columns [c0, c1) for query rows r (query index r % q), or
    None when every column is visible."""
    mask = None if valid is None else valid[:, :, None, c0:c1]
    tail = n - causal_tail
    if causal_tail and c1 > tail:
        k = torch.arange(c0 - tail, c1 - tail, device=device)  # position in the tail (< 0: older columns)
        i = torch.arange(rows, device=device)[:, None] % q
        causal = k <= i
        mask = causal if mask is None else (mask & causal) | (k == i)
    return mask


def _logits(qf, k, scaling, softcap, mask):
    s = torch.matmul(qf, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def torch_blockwise_attention(
    query, ks, vs, n, valid, scaling, block, causal_tail, softcap, sinks, column_scores, query_weight=None
):
    """The torch reference on validated inputs (see `blockwise_attention`)."""
    b, hq, q, dk = query.shape
    hkv, dv = ks[0].heads, vs[0].head_dim
    groups = hq // hkv
    rows = groups * q  # row r of KV head h: query head h * groups + r // q, query r % q
    qf = query.float().reshape(b, hkv, rows, dk)
    device = query.device
    if sinks is None:
        m = torch.full((b, hkv, rows), float("-inf"), device=device)
        l = torch.zeros(b, hkv, rows, device=device)
    else:
        m = sinks.float().view(1, hkv, groups, 1).expand(b, hkv, groups, q).reshape(b, hkv, rows)
        l = torch.ones(b, hkv, rows, device=device)
    acc = torch.zeros(b, hkv, rows, dv, device=device)
    one_pass = column_scores and q == 1
    scores = torch.empty(b, hq, n, device=device) if column_scores else None
    maxima = []
    offset = 0
    for kseg, vseg in zip(ks, vs):
        for s in range(0, kseg.length, block):
            e = min(s + block, kseg.length)
            mask = block_mask(valid, causal_tail, offset + s, offset + e, n, q, rows, device)
            logits = _logits(qf, dequantize_block(kseg, s, e), scaling, softcap, mask)
            m_new = torch.maximum(m, logits.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = torch.exp(logits - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, dequantize_block(vseg, s, e))
            m = m_new
            if one_pass:
                scores[:, :, offset + s : offset + e] = p.reshape(b, hq, e - s)
                maxima.append((offset + s, offset + e, m_safe))
        offset += kseg.length
    out = acc / torch.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(b, hq, q, dv).to(query.dtype)
    if not column_scores:
        return out
    lse = torch.where(l > 0, m + torch.log(l), float("inf"))  # empty rows: every probability is 0
    if one_pass:
        for c0, c1, m_block in maxima:
            factor = torch.exp(m_block - lse).reshape(b, hq, 1)
            if query_weight is not None:
                factor = factor * query_weight.float().view(b, 1, 1)
            scores[:, :, c0:c1] *= factor
        return out, scores
    weight = None if query_weight is None else query_weight.float().view(b, 1, 1, q, 1)
    offset = 0
    for kseg in ks:
        for s in range(0, kseg.length, block):
            e = min(s + block, kseg.length)
            mask = block_mask(valid, causal_tail, offset + s, offset + e, n, q, rows, device)
            p = torch.exp(_logits(qf, dequantize_block(kseg, s, e), scaling, softcap, mask) - lse[..., None])
            p = p.view(b, hkv, groups, q, e - s)
            if weight is not None:
                p = p * weight
            scores[:, :, offset + s : offset + e] = p.sum(3).reshape(b, hq, e - s)
        offset += kseg.length
    return out, scores


def _triton_reason(query, ks, vs) -> str | None:
    """Why the Triton kernel cannot run these inputs here (None: it can). Cheap checks first: on CPU without the
    interpreter triton is never imported."""
    if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {query.device.type!r}: the kernel needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    from . import triton_blockwise

    return triton_blockwise.unsupported(query, ks, vs)


def blockwise_attention(
    query: torch.Tensor,
    keys: QuantizedKV | Sequence[QuantizedKV],
    values: QuantizedKV | Sequence[QuantizedKV],
    valid: torch.Tensor | None,
    scaling: float,
    block: int = 256,
    causal_tail: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_column_scores: bool = False,
    query_weight: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Softmax attention of `query` [B, Hq, q, Dk] over quantized keys/values without dequantizing them whole.
    Returns the output [B, Hq, q, Dv] (query dtype), and with `return_column_scores` also the probability each
    key column received summed over the queries (each weighted by `query_weight` [B, q] if given, e.g. 0 for
    padding queries), [B, Hq, n] float32. See the module docstring."""
    if backend not in BACKENDS:
        raise ValueError(f"blockwise_attention: `backend` must be one of {BACKENDS}, got {backend!r}")
    ks, vs, n = check_inputs(query, keys, values, valid, scaling, block, causal_tail, softcap, sinks)
    if query_weight is not None and tuple(query_weight.shape) != (query.shape[0], query.shape[2]):
        raise ValueError(
            f"blockwise_attention: `query_weight` must be [B, q] = {[query.shape[0], query.shape[2]]}, "
            f"got {list(query_weight.shape)}"
        )
    # "auto": Triton for CUDA tensors in eager code only; under torch.compile the torch path is traced whole and
    # inductor writes its kernels (our Triton launcher is not written for dynamo); the interpreter: asked only
    if backend == "triton" or (backend == "auto" and query.device.type == "cuda" and not torch.compiler.is_compiling()):
        reason = _triton_reason(query, ks, vs)
        if reason is None:
            from .triton_blockwise import triton_blockwise_attention

            return triton_blockwise_attention(
                query, ks, vs, n, valid, float(scaling), causal_tail, softcap, sinks, return_column_scores, query_weight
            )
        if backend == "triton":
            raise RuntimeError(f"blockwise_attention(backend='triton') cannot run here: {reason}")
    if backend == "native" or (backend == "auto" and query.device.type == "cpu" and not torch.compiler.is_compiling()):
        reason = cpu_blockwise.unsupported(query, ks, vs)
        if reason is None:
            return cpu_blockwise.cpu_blockwise_attention(
                query, ks, vs, n, valid, float(scaling), causal_tail, softcap, sinks, return_column_scores, query_weight
            )
        if backend == "native":
            raise RuntimeError(f"blockwise_attention(backend='native') cannot run here: {reason}")
    return torch_blockwise_attention(
        query, ks, vs, n, valid, float(scaling), block, causal_tail, softcap, sinks, return_column_scores, query_weight
    )
