"""Triton kernel for `blockwise_attention` in the decode case (few queries): split-KV flash-decoding from codes.

Each program owns one (batch row, KV head, split of the tokens of one segment). It loads all the query rows of that
KV head (Hq / Hkv heads x q queries, padded to a power of two >= 16), walks its tokens `BLOCK_N` at a time --
loading FP8 / integer codes, unpacking and scaling them in registers -- and keeps a running max `m`, sum `l` and
float32 accumulator. The partial (m, l, acc) of every split and segment are combined in torch afterwards
(together with the sinks). Column scores use a second kernel that recomputes the logits against the final
log-sum-exp and sums the probabilities over the queries of each query head.

FP8 bits are decoded with integer ops through float16 (E4M3: sign | exponent-mantissa << 7 is the value x 2^-8;
E5M2: the upper byte of float16), which runs on any GPU generation and under the interpreter. Every layout of
`QuantizedKV` reduces to index arithmetic here: code byte (row, column, shift) and scale (row, column) of a token
and channel, with zero strides for broadcast scales, so any split can start at any token.

Supported: every `QuantizedKV` layout; query rows per KV head (Hq / Hkv x q) <= `MAX_ROWS`; head dims <= 256.
Dot products run in float32 (`input_precision="ieee"`): the decode case is bound by reading the codes, not by math.
"""

from __future__ import annotations

import math

import torch

MAX_ROWS = 128
MAX_HEAD_DIM = 256
BLOCK_N = 32
_FORMAT_IDS = {"none": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 3, "int2": 3}


try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path works without it
    triton = None


def available() -> bool:
    return triton is not None


def unsupported(query, ks, vs) -> str | None:
    """Why these inputs are outside the kernel's range (None: they are inside)."""
    _b, hq, q, dk = query.shape
    rows = hq // ks[0].heads * q
    if rows > MAX_ROWS:
        return f"{rows} query rows per KV head (Hq / Hkv x q) exceed the decode kernel's {MAX_ROWS}"
    if max(dk, vs[0].head_dim) > MAX_HEAD_DIM:
        return f"head dims {dk} / {vs[0].head_dim} exceed {MAX_HEAD_DIM}"
    devices = {t.device for s in list(ks) + list(vs) for t in (s.codes, s.scale, s.zero, s.bias) if t is not None}
    if devices != {query.device}:
        return f"keys/values on {sorted(map(str, devices))}, query on {query.device}"
    return None


if triton is not None:

    @triton.jit
    def load_tokens(
        codes,
        scale,
        zero,
        bias,
        b,
        h,
        t,
        d,
        t_ok,
        d_ok,
        c_sb,
        c_sh,
        c_sn,
        c_sd,
        s_sb,
        s_sh,
        s_sn,
        s_sd,
        z_sb,
        z_sh,
        z_sn,
        z_sd,
        bi_sb,
        bi_sh,
        bi_sd,
        FMT: tl.constexpr,
        PACK: tl.constexpr,
        PER_BYTE: tl.constexpr,
        HQQ: tl.constexpr,
        PACK_BLOCK: tl.constexpr,
        D_PACKED: tl.constexpr,
        S_TOK: tl.constexpr,
        S_CH: tl.constexpr,
        POW2: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        ZERO_CODE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """Tokens t [N] x channels d [D] of one (batch row, head) as float32 [N, D] (0 outside t_ok / d_ok)."""
        mask = t_ok[:, None] & d_ok[None, :]
        if PACK == 1:  # channel packing: byte d % D_PACKED holds channel d as value d // D_PACKED
            row = t[:, None] + 0 * d[None, :]
            col = (d % D_PACKED)[None, :] + 0 * t[:, None]
            slot = (d // D_PACKED)[None, :] + 0 * t[:, None]
        elif PACK == 2:  # token packing in blocks of PACK_BLOCK tokens: byte row r holds tokens r + i * R
            R: tl.constexpr = PACK_BLOCK // PER_BYTE
            row = ((t // PACK_BLOCK) * R + t % R)[:, None] + 0 * d[None, :]
            col = d[None, :] + 0 * t[:, None]
            slot = ((t % PACK_BLOCK) // R)[:, None] + 0 * d[None, :]
        else:
            row = t[:, None] + 0 * d[None, :]
            col = d[None, :] + 0 * t[:, None]
            slot = 0 * row
        raw = tl.load(codes + b * c_sb + h * c_sh + row * c_sn + col * c_sd, mask=mask, other=0)
        if FMT == 0:
            x = raw.to(tl.float32)
        elif FMT == 1:  # E4M3 -> float16 bits (sign << 15 | exponent-mantissa << 7) = value x 2^-8
            r = raw.to(tl.int32)
            bits = ((r & 0x80) << 8) | ((r & 0x7F) << 7)
            x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        elif FMT == 2:  # E5M2 is the upper byte of float16
            bits = raw.to(tl.int32) << 8
            x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            r = raw.to(tl.int32)
            if PER_BYTE > 1:
                BITS: tl.constexpr = 8 // PER_BYTE
                if HQQ:
                    shift = 8 - BITS * (slot + 1)
                else:
                    shift = BITS * slot
                r = (r >> shift) & ((1 << BITS) - 1)
            x = r.to(tl.float32)
        if FMT != 0:
            srow = (t // S_TOK)[:, None]
            scol = (d // S_CH)[None, :]
            sc = tl.load(scale + b * s_sb + h * s_sh + srow * s_sn + scol * s_sd, mask=mask, other=0).to(tl.float32)
            if POW2:
                sc = tl.exp2(sc)
            if HAS_ZERO:
                z = tl.load(zero + b * z_sb + h * z_sh + srow * z_sn + scol * z_sd, mask=mask, other=0).to(tl.float32)
                if ZERO_CODE:
                    x = (x - z) * sc
                else:
                    x = x * sc + z
            else:
                x = x * sc
        if HAS_BIAS:
            x += tl.load(bias + b * bi_sb + h * bi_sh + d * bi_sd, mask=d_ok, other=0).to(tl.float32)[None, :]
        return tl.where(mask, x, 0.0)

    @triton.jit
    def logits_block(
        q,
        b,
        h,
        t,
        t_ok,
        rows,
        col_offset,
        n_total,
        scaling,
        softcap,
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
        DK,
        VALID,
        va_sb,
        va_sh,
        va_sn,
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
        QLEN: tl.constexpr,
        HAS_VALID: tl.constexpr,
        CAUSAL: tl.constexpr,
        SOFTCAP: tl.constexpr,
        BLOCK_DK: tl.constexpr,
    ):
        """Masked logits [BLOCK_M, BLOCK_N] of the query rows against tokens t of the segment."""
        dk = tl.arange(0, BLOCK_DK)
        k = load_tokens(
            K,
            KS,
            KZ,
            KB,
            b,
            h,
            t,
            dk,
            t_ok,
            dk < DK,
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
            K_FMT,
            K_PACK,
            K_PER_BYTE,
            K_HQQ,
            K_PACK_BLOCK,
            K_D_PACKED,
            K_S_TOK,
            K_S_CH,
            K_POW2,
            K_HAS_ZERO,
            K_ZERO_CODE,
            K_HAS_BIAS,
        )
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # tanh, saturating at +-1
        col = col_offset + t
        visible = t_ok[None, :] & (rows >= 0)[:, None]
        if HAS_VALID:
            ok = tl.load(VALID + b * va_sb + h * va_sh + col * va_sn, mask=t_ok, other=0)
            visible = visible & (ok != 0)[None, :]
        if CAUSAL:
            k_tail = (col - (n_total - QLEN))[None, :]
            i = (rows % QLEN)[:, None]
            visible = (visible & (k_tail <= i)) | ((k_tail == i) & t_ok[None, :])
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def load_query(
        Q, b, h, rows, q_sb, q_sh, q_sq, q_sd, DK, GROUPS: tl.constexpr, QLEN: tl.constexpr, BLOCK_DK: tl.constexpr
    ):
        dk = tl.arange(0, BLOCK_DK)
        head = h * GROUPS + rows // QLEN
        ptr = Q + b * q_sb + head[:, None] * q_sh + (rows % QLEN)[:, None] * q_sq + dk[None, :] * q_sd
        ok = (rows < GROUPS * QLEN)[:, None] & (dk < DK)[None, :]
        return tl.load(ptr, mask=ok, other=0).to(tl.float32)

    @triton.jit
    def partial_kernel(
        Q,
        q_sb,
        q_sh,
        q_sq,
        q_sd,
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
        VALID,
        va_sb,
        va_sh,
        va_sn,
        M_OUT,
        L_OUT,
        ACC_OUT,
        split_base,
        total_splits,
        seg_len,
        col_offset,
        n_total,
        tokens_per_split,
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
        QLEN: tl.constexpr,
        HAS_VALID: tl.constexpr,
        CAUSAL: tl.constexpr,
        SOFTCAP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        rows = tl.arange(0, BLOCK_M)
        q = load_query(Q, b, h, rows, q_sb, q_sh, q_sq, q_sd, DK, GROUPS, QLEN, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, seg_len)
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < hi
            s = logits_block(
                q,
                b,
                h,
                t,
                t_ok,
                rows,
                col_offset,
                n_total,
                scaling,
                softcap,
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
                DK,
                VALID,
                va_sb,
                va_sh,
                va_sn,
                K_FMT,
                K_PACK,
                K_PER_BYTE,
                K_HQQ,
                K_PACK_BLOCK,
                K_D_PACKED,
                K_S_TOK,
                K_S_CH,
                K_POW2,
                K_HAS_ZERO,
                K_ZERO_CODE,
                K_HAS_BIAS,
                QLEN,
                HAS_VALID,
                CAUSAL,
                SOFTCAP,
                BLOCK_DK,
            )
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = load_tokens(
                V,
                VS,
                VZ,
                VB,
                b,
                h,
                t,
                dv,
                t_ok,
                dv < DV,
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
                V_FMT,
                V_PACK,
                V_PER_BYTE,
                V_HQQ,
                V_PACK_BLOCK,
                V_D_PACKED,
                V_S_TOK,
                V_S_CH,
                V_POW2,
                V_HAS_ZERO,
                V_ZERO_CODE,
                V_HAS_BIAS,
            )
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        out = (pid * total_splits + split_base + split) * BLOCK_M + rows
        tl.store(M_OUT + out, m)
        tl.store(L_OUT + out, l)
        tl.store(ACC_OUT + out[:, None] * BLOCK_DV + dv[None, :], acc)

    @triton.jit
    def scores_kernel(
        Q,
        q_sb,
        q_sh,
        q_sq,
        q_sd,
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
        VALID,
        va_sb,
        va_sh,
        va_sn,
        LSE,
        SCORES,
        sc_sb,
        sc_sh,
        WEIGHT,
        seg_len,
        col_offset,
        n_total,
        tokens_per_split,
        scaling,
        softcap,
        HKV,
        DK,
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
        GROUPS: tl.constexpr,
        QLEN: tl.constexpr,
        HAS_VALID: tl.constexpr,
        CAUSAL: tl.constexpr,
        SOFTCAP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        rows = tl.arange(0, BLOCK_M)
        q = load_query(Q, b, h, rows, q_sb, q_sh, q_sq, q_sd, DK, GROUPS, QLEN, BLOCK_DK)
        lse = tl.load(LSE + pid * BLOCK_M + rows)
        weight = tl.load(WEIGHT + b * QLEN + rows % QLEN)  # per query (rows beyond GROUPS * QLEN: lse = inf)
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, seg_len)
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < hi
            s = logits_block(
                q,
                b,
                h,
                t,
                t_ok,
                rows,
                col_offset,
                n_total,
                scaling,
                softcap,
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
                DK,
                VALID,
                va_sb,
                va_sh,
                va_sn,
                K_FMT,
                K_PACK,
                K_PER_BYTE,
                K_HQQ,
                K_PACK_BLOCK,
                K_D_PACKED,
                K_S_TOK,
                K_S_CH,
                K_POW2,
                K_HAS_ZERO,
                K_ZERO_CODE,
                K_HAS_BIAS,
                QLEN,
                HAS_VALID,
                CAUSAL,
                SOFTCAP,
                BLOCK_DK,
            )
            p = tl.exp(s - lse[:, None]) * weight[:, None]
            for g in tl.static_range(GROUPS):
                col_sum = tl.sum(tl.where((rows // QLEN == g)[:, None], p, 0.0), 0)
                tl.store(SCORES + b * sc_sb + (h * GROUPS + g) * sc_sh + col_offset + t, col_sum, mask=t_ok)


def _stride(t: torch.Tensor, dim: int) -> int:
    return 0 if t.shape[dim] == 1 else t.stride(dim)


def _operand(kv):
    """(pointer/stride arguments, constexpr arguments) of one QuantizedKV for the kernels."""
    codes = kv.codes
    dummy = codes
    scale, zero, bias = kv.scale, kv.zero, kv.bias
    args = [
        codes,
        scale if scale is not None else dummy,
        zero if zero is not None else dummy,
        bias if bias is not None else dummy,
    ]
    args += [codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3)]
    for t in (scale, zero):
        args += [_stride(t, i) for i in range(4)] if t is not None else [0, 0, 0, 0]
    args += [_stride(bias, 0), bias.stride(1), bias.stride(3)] if bias is not None else [0, 0, 0]
    if kv.granularity == "token":
        s_tok, s_ch = 1, kv.group_size if kv.format != "none" else 1
    elif kv.granularity == "channel":
        s_tok, s_ch = kv.group_size, 1
    else:  # fixed: zero strides along tokens and channels
        s_tok, s_ch = 1, 1
    packed = kv.per_byte > 1
    const = [
        _FORMAT_IDS[kv.format],
        (1 if kv.packing == "channel" else 2) if packed else 0,
        kv.per_byte,
        kv.pack_order == "hqq",
        kv.pack_block or 1,
        codes.shape[3] if packed else kv.head_dim,
        s_tok,
        s_ch,
        kv.scale_pow2,
        zero is not None,
        kv.zero_is_code,
        bias is not None,
    ]
    return args, const


def _pow2(x: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (x - 1).bit_length())


def triton_blockwise_attention(
    query, ks, vs, n, valid, scaling, causal_tail, softcap, sinks, column_scores, query_weight=None
):
    """The Triton path on validated inputs (see `blockwise.blockwise_attention`)."""
    b, hq, q, dk = query.shape
    hkv, dv = ks[0].heads, vs[0].head_dim
    groups = hq // hkv
    rows = groups * q
    block_m, block_dk, block_dv = _pow2(rows), _pow2(dk), _pow2(dv)
    device = query.device
    programs = b * hkv
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    plan = []  # (segment index, tokens per split, splits, first split)
    total = 0
    for i, seg in enumerate(ks):
        blocks = math.ceil(seg.length / BLOCK_N)
        splits = max(1, min(blocks, math.ceil(target / programs)))
        per_split = math.ceil(blocks / splits) * BLOCK_N or BLOCK_N
        splits = math.ceil(seg.length / per_split)
        plan.append((i, per_split, splits, total))
        total += splits
    # neutral partials (m = -inf, l = 0, acc = 0) if every segment is empty
    m = torch.full((programs, max(total, 1), block_m), float("-inf"), device=device)
    l = torch.zeros_like(m)
    acc = torch.zeros(programs, max(total, 1), block_m, block_dv, device=device)
    if valid is not None:
        valid_u8 = valid.view(torch.uint8)
        valid_args = [valid_u8, valid_u8.stride(0), _stride(valid_u8, 1), valid_u8.stride(2)]
    else:
        valid_args = [query, 0, 0, 0]
    q_args = [query, query.stride(0), query.stride(1), query.stride(2), query.stride(3)]
    shape_const = dict(
        GROUPS=groups,
        QLEN=q,
        HAS_VALID=valid is not None,
        CAUSAL=bool(causal_tail),
        SOFTCAP=softcap is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_DK=block_dk,
    )
    cap = float(softcap) if softcap is not None else 1.0
    offset = 0
    offsets = []
    for i, per_split, splits, first in plan:
        offsets.append(offset)
        offset += ks[i].length
        if not splits:
            continue
        k_args, k_const = _operand(ks[i])
        v_args, v_const = _operand(vs[i])
        partial_kernel[(programs, splits)](
            *q_args,
            *k_args,
            *v_args,
            *valid_args,
            m,
            l,
            acc,
            first,
            total,
            ks[i].length,
            offsets[-1],
            n,
            per_split,
            scaling,
            cap,
            hkv,
            dk,
            dv,
            *k_const,
            *v_const,
            BLOCK_DV=block_dv,
            **shape_const,
        )
    # combine the splits (and the sinks) in float32
    m_max = m.amax(1)
    if sinks is not None:
        sink_rows = torch.full((hkv, block_m), float("-inf"), device=device)
        sink_rows[:, :rows] = sinks.float().view(hkv, groups, 1).expand(hkv, groups, q).reshape(hkv, rows)
        sink_rows = sink_rows.repeat(b, 1)
        m_max = torch.maximum(m_max, sink_rows)
    m_safe = torch.where(m_max == float("-inf"), 0.0, m_max)
    weight = torch.exp(m - m_safe[:, None])
    l_total = (l * weight).sum(1)
    if sinks is not None:
        l_total = l_total + torch.exp(sink_rows - m_safe)
    acc_total = (acc * weight[..., None]).sum(1)
    out = acc_total / torch.where(l_total > 0, l_total, 1.0)[..., None]
    out = out[:, :rows, :dv].reshape(b, hkv, groups, q, dv).reshape(b, hq, q, dv).to(query.dtype)
    if not column_scores:
        return out
    lse = torch.where(l_total > 0, m_safe + torch.log(l_total), float("inf"))
    lse[:, rows:] = float("inf")  # padding rows contribute nothing
    if query_weight is None:
        query_weight = torch.ones(b, q, device=device)
    query_weight = query_weight.float().contiguous()
    scores = torch.empty(b, hq, n, device=device)
    for (i, per_split, splits, _), offset in zip(plan, offsets):
        if not splits:
            continue
        k_args, k_const = _operand(ks[i])
        scores_kernel[(programs, splits)](
            *q_args,
            *k_args,
            *valid_args,
            lse,
            scores,
            scores.stride(0),
            scores.stride(1),
            query_weight,
            ks[i].length,
            offset,
            n,
            per_split,
            scaling,
            cap,
            hkv,
            dk,
            *k_const,
            **shape_const,
        )
    return out, scores
