"""Triton kernel: continuous batching's packed batch attended straight from paged codes (the CUDA counterpart of
`cpu_blockwise.paged_attention`).

One program per (request, KV head, tile of BLOCK_M query rows of that head; row = query x GROUPS + group, so a
tile holds consecutive queries of a prefill chunk or the query heads of one decode row). It walks the request's keys
BLOCK_N at a time: their physical rows come from `read_index[cu_k[r] + t]` (the block table, flattened), and
`triton_blockwise.load_tokens` reads and dequantizes those rows of the pages in registers (FP8 bits through float16,
integer codes unpacked and scaled; any QuantizedKV layout with per-token scales): no dequantized copy. A request
whose query is its whole key range (its first forward) reads its new tokens unquantized from `fresh` instead, as the
dequantize path attends to them. Running max / sum / accumulator in float32 (flash attention), sinks added to the
denominator, optional logit softcap, causal among each request's new tokens (the last q of its n columns).

Programs past a request's query rows exit at once: the grid is (requests x KV heads, tiles of the longest request),
with the longest query length passed from the host (continuous batching knows it: `max_length_q`). No split over
columns yet (a long request's decode row is one program per KV head).
"""

from __future__ import annotations

import torch

from .triton_blockwise import BLOCK_N, _operand, _pow2, triton

if triton is not None:
    import triton.language as tl

    from .triton_blockwise import load_tokens

    @triton.jit
    def paged_kernel(
        Q,
        q_sh,
        q_sn,
        O,
        o_sh,
        o_sn,
        CU_Q,
        CU_K,
        READ,
        SINKS,
        K,
        KS,
        KZ,
        KB,
        k_sb,
        k_sh,
        k_sn,
        k_sd,
        ks_sb,
        ks_sh,
        ks_sn,
        ks_sd,
        kz_sb,
        kz_sh,
        kz_sn,
        kz_sd,
        kb_sb,
        kb_sh,
        kb_sd,
        V,
        VS,
        VZ,
        VB,
        v_sb,
        v_sh,
        v_sn,
        v_sd,
        vs_sb,
        vs_sh,
        vs_sn,
        vs_sd,
        vz_sb,
        vz_sh,
        vz_sn,
        vz_sd,
        vb_sb,
        vb_sh,
        vb_sd,
        FK,
        fk_sh,
        fk_sn,
        FV,
        fv_sh,
        fv_sn,
        scaling,
        softcap,
        HKV,
        DK,
        DV,
        K_FMT: tl.constexpr,
        K_PACK: tl.constexpr,
        K_PER_BYTE: tl.constexpr,
        K_HQQ: tl.constexpr,
        K_PACK_BLOCK: tl.constexpr,
        K_D_PACKED: tl.constexpr,
        K_S_TOK: tl.constexpr,
        K_S_CH: tl.constexpr,
        K_POW2: tl.constexpr,
        K_HAS_ZERO: tl.constexpr,
        K_ZERO_CODE: tl.constexpr,
        K_HAS_BIAS: tl.constexpr,
        V_FMT: tl.constexpr,
        V_PACK: tl.constexpr,
        V_PER_BYTE: tl.constexpr,
        V_HQQ: tl.constexpr,
        V_PACK_BLOCK: tl.constexpr,
        V_D_PACKED: tl.constexpr,
        V_S_TOK: tl.constexpr,
        V_S_CH: tl.constexpr,
        V_POW2: tl.constexpr,
        V_HAS_ZERO: tl.constexpr,
        V_ZERO_CODE: tl.constexpr,
        V_HAS_BIAS: tl.constexpr,
        GROUPS: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tile = tl.program_id(1)
        r = pid // HKV
        h = pid % HKV
        q0 = tl.load(CU_Q + r).to(tl.int64)
        qlen = tl.load(CU_Q + r + 1).to(tl.int64) - q0
        k0 = tl.load(CU_K + r).to(tl.int64)
        n = tl.load(CU_K + r + 1).to(tl.int64) - k0
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < qlen * GROUPS
        if tile * BLOCK_M < qlen * GROUPS:
            qi = rows // GROUPS
            head = h * GROUPS + rows % GROUPS
            dk = tl.arange(0, BLOCK_DK)
            dv = tl.arange(0, BLOCK_DV)
            q = tl.load(
                Q + head[:, None] * q_sh + (q0 + qi)[:, None] * q_sn + dk[None, :],
                mask=row_ok[:, None] & (dk < DK)[None, :],
                other=0,
            ).to(tl.float32)
            if HAS_SINKS:
                m = tl.load(SINKS + head, mask=row_ok, other=float("-inf")).to(tl.float32)
            else:
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            m_start = m
            l = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            first = qlen == n
            last_col = n - qlen + qi  # the last column query qi sees (its own)
            for start in range(0, n, BLOCK_N):
                t = start + tl.arange(0, BLOCK_N)
                t_ok = t < n
                if first:  # its own new tokens, unquantized
                    src = q0 + t
                    kf = tl.load(
                        FK + h * fk_sh + src[:, None] * fk_sn + dk[None, :],
                        mask=t_ok[:, None] & (dk < DK)[None, :],
                        other=0,
                    ).to(tl.float32)
                    vf = tl.load(
                        FV + h * fv_sh + src[:, None] * fv_sn + dv[None, :],
                        mask=t_ok[:, None] & (dv < DV)[None, :],
                        other=0,
                    ).to(tl.float32)
                else:
                    phys = tl.load(READ + k0 + t, mask=t_ok, other=0).to(tl.int64)
                    kf = load_tokens(
                        K, KS, KZ, KB, 0, h, phys, dk, t_ok, dk < DK,
                        k_sb, k_sh, k_sn, k_sd, ks_sb, ks_sh, ks_sn, ks_sd, kz_sb, kz_sh, kz_sn, kz_sd,
                        kb_sb, kb_sh, kb_sd,
                        K_FMT, K_PACK, K_PER_BYTE, K_HQQ, K_PACK_BLOCK, K_D_PACKED, K_S_TOK, K_S_CH, K_POW2,
                        K_HAS_ZERO, K_ZERO_CODE, K_HAS_BIAS,
                    )  # fmt: skip
                    vf = load_tokens(
                        V, VS, VZ, VB, 0, h, phys, dv, t_ok, dv < DV,
                        v_sb, v_sh, v_sn, v_sd, vs_sb, vs_sh, vs_sn, vs_sd, vz_sb, vz_sh, vz_sn, vz_sd,
                        vb_sb, vb_sh, vb_sd,
                        V_FMT, V_PACK, V_PER_BYTE, V_HQQ, V_PACK_BLOCK, V_D_PACKED, V_S_TOK, V_S_CH, V_POW2,
                        V_HAS_ZERO, V_ZERO_CODE, V_HAS_BIAS,
                    )  # fmt: skip
                s = tl.dot(q, tl.trans(kf), input_precision="ieee") * scaling
                if SOFTCAP:
                    s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # tanh, saturating at +-1
                visible = row_ok[:, None] & t_ok[None, :] & (t[None, :] <= last_col[:, None])
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                l = l * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p, vf, input_precision="ieee")
                m = m_new
            if HAS_SINKS:  # the sink's own term in the denominator (its logit started the running max)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                l += tl.exp(m_start - m_safe)
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(
                O + head[:, None] * o_sh + (q0 + qi)[:, None] * o_sn + dv[None, :],
                out,
                mask=row_ok[:, None] & (dv < DV)[None, :],
            )


def triton_paged_attention(
    query,
    keys,
    values,
    fresh_keys,
    fresh_values,
    cu_seq_lens_q,
    cu_seq_lens_k,
    read_index,
    scaling,
    max_query_length: int,
    softcap=None,
    sinks=None,
):
    """query [Hq, N, Dk] (rotated as the pages' keys are); `keys` / `values`: QuantizedKV views of all the pages'
    rows ([1, Hkv, rows, ...], per-token scales); `fresh_keys` / `fresh_values` [1, Hkv, N, D]: the batch's new
    tokens in full precision; `cu_seq_lens_q` / `cu_seq_lens_k` [R + 1] and `read_index` as continuous batching
    passes them; `max_query_length`: the most queries of one request (a host int). Returns [Hq, N, Dv] float32
    (zero for padding queries)."""
    hq, n_tokens, dk = query.shape
    hkv, dv = keys.heads, values.head_dim
    groups = hq // hkv
    requests = cu_seq_lens_q.shape[0] - 1
    query = query.contiguous()
    out = torch.zeros(hq, n_tokens, dv, dtype=torch.float32, device=query.device)
    if requests == 0 or max_query_length == 0:
        return out
    block_m = _pow2(min(groups * max_query_length, 64))
    tiles = -(-groups * max_query_length // block_m)
    k_args, k_const = _operand(keys)
    v_args, v_const = _operand(values)
    fk, fv = fresh_keys[0], fresh_values[0]
    for name, t in (("fresh_keys", fk), ("fresh_values", fv)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton_paged_attention: `{name}` must be contiguous along the channels")
    paged_kernel[(requests * hkv, tiles)](
        query,
        query.stride(0),
        query.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        cu_seq_lens_q,
        cu_seq_lens_k,
        read_index,
        sinks.float().contiguous() if sinks is not None else query,
        *k_args,
        *v_args,
        fk,
        fk.stride(0),
        fk.stride(1),
        fv,
        fv.stride(0),
        fv.stride(1),
        float(scaling),
        float(softcap) if softcap is not None else 1.0,
        hkv,
        dk,
        dv,
        *k_const,
        *v_const,
        GROUPS=groups,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_DK=_pow2(dk),
        BLOCK_DV=_pow2(dv),
    )
    return out
