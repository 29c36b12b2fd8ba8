"""A portable Triton kernel for DeepSeek-V4 attention: a window cache and a compressed cache in one call.

Contract: :func:`dsv4_attention` computes :mod:`.reference`'s math (one softmax over both caches'
candidates, the sink logit in the denominator only, V = K = the whole 512-wide row, zeros for a
token with no candidate) over either record of :mod:`.layout` (the 584-byte fp8 one, the
384-byte NVFP4 one). Masked, never read: a slot < 0, a slot >= the cache's capacity (pages x page
size), a position at or past the row's length. Each cache has its own page size and page stride
(runtime arguments).

Structure: one program takes one query token, ``BLOCK_H`` heads and one split: a range of the
window's index row (in whole steps) followed by the compressed cache's, ``BLOCK_N`` candidates a
step, walked as one loop (:func:`_fp8_walk`, :func:`_fp4_walk`) with an online softmax in base 2; a
step loads the next step's ids while its rows load. The split count is :mod:`.plan`'s (shapes only);
several splits write fp32 partials that :mod:`..shared.combine` merges, applying the sink once. A
row is read in pieces (the 448 NoPE values are not a power of two): fp8, seven 64-value groups, one
UE8M0 scale each; NVFP4, seven 32-byte pieces, each as its even and its odd values; the bf16 rope.
Each piece is loaded transposed for the score dot and plain for the weighted sum, and dequantized
exactly on its way to the MMA: fp8 keys as f16 (each group's power-of-two scale on its fp32 partial
scores, q scaled per head into f16's range), fp8 values as bf16 (the scale folded into p), NVFP4
keys and values as f16 (the e4m3 scale in the operand, p rounded to f16), the rope in bf16; every
dot accumulates in fp32 (:func:`~mla_sm120_plugin.kernels.shared.triton.dot`, ``dot_f16``).

Design notes: docs/kernels.md, section ``kernels/dsv4/triton.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsv4 import layout
from mla_sm120_plugin.kernels.dsv4 import plan
from mla_sm120_plugin.kernels.shared.combine import OUT_DIM, combine_launch
from mla_sm120_plugin.kernels.shared.host import LOG2E, cdiv, interpreting, page_divisor
from mla_sm120_plugin.kernels.shared.launch_plan import gpu_family
from mla_sm120_plugin.kernels.shared.triton import LOG2E_K, Launch, dot, dot_f16, e8m0_value, store_rounded

REC = layout.FP8_RECORD

_ROPE: tl.constexpr = tl.constexpr(layout.ROPE_DIM)
_NOPE: tl.constexpr = tl.constexpr(layout.NOPE_DIM)
_GROUP: tl.constexpr = tl.constexpr(layout.SCALE_GROUP)  # NoPE values one UE8M0 exponent covers (64)
_DATA: tl.constexpr = tl.constexpr(layout.DATA_ROW_BYTES)
_SCALES: tl.constexpr = tl.constexpr(layout.SCALE_ROW_BYTES)
_FP4_DATA: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.data_bytes)
_FP4_SCALES: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.scale_bytes)
_FP4_NOPE_BYTES: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.nope_bytes)
# NVFP4 bytes one e4m3 scale covers (16 values, two a byte)
_FP4_SCALE_BYTES: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.scale_group // 2)
_FP4_PIECE: tl.constexpr = tl.constexpr(32)  # NoPE bytes a piece of the walk: 64 values, 7 pieces


Dsv4Config = plan.Dsv4Config


def default_config(record: layout.Dsv4Record) -> Dsv4Config:
    """The record's block shape, unsplit."""
    return plan.shape_of(record).config


# ------------------------------------------------------------------ the rows a step reads

@triton.jit
def _ids(swa_idx_row, extra_idx_row, start, hi, swa_span, n_swa, n_extra, BLOCK_N: tl.constexpr,
         HAS_EXTRA: tl.constexpr):
    """The slot ids of the step at position ``start`` of the call's list ([BLOCK_N] int32): the window
    row's, in whole steps (``swa_span`` positions), then the compressed row's; -1 past a row's live
    length and at or past ``hi`` (the split's end). A step reads one row, so it is one load."""
    pos = start + tl.arange(0, BLOCK_N)
    row, end = swa_idx_row, tl.minimum(n_swa, hi)
    if HAS_EXTRA:
        if start >= swa_span:
            row, end = extra_idx_row - swa_span, tl.minimum(swa_span + n_extra, hi)
    return tl.load(row + pos, mask=pos < end, other=-1)


@triton.jit
def _rows(ids, cache, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Which ids name a row of ``cache`` (``0 <= id < capacity``), and pointers to their data and
    scale rows ([BLOCK_N] each); ``cache``: (origin, capacity, magic, shift, page size, page stride),
    the page of a slot being ``slot * magic >> shift`` (:func:`page_divisor`)."""
    origin, cap, magic, shift, page, stride = cache
    valid = (ids >= 0) & (ids < cap)
    slot = tl.where(valid, ids, 0).to(tl.int64)
    pg = (slot * magic) >> shift
    row = slot - pg * page
    base = origin + pg * stride
    return valid, base + row * DATA_BYTES, base + page * DATA_BYTES + row * SCALE_BYTES


@triton.jit
def _gather(rows, valid, COL0: tl.constexpr, WIDTH: tl.constexpr, KEYS: tl.constexpr):
    """Elements ``[COL0, COL0 + WIDTH)`` of each row (``rows``: [BLOCK_N] pointers), 0 where invalid:
    transposed for the scores' keys (``KEYS``: [WIDTH, BLOCK_N], candidates across), else the
    weighted sum's values ([BLOCK_N, WIDTH]). Keys and values are two loads of the same bytes (L1 /
    L2 serves the second): each is then a tile whose dequantization Triton moves after the shared
    memory it passes through on its way to the MMA, and loads a step ahead."""
    cols = COL0 + tl.arange(0, WIDTH)
    if KEYS:
        t = tl.load(rows[None, :] + cols[:, None], mask=valid[None, :], other=0)
    else:
        t = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None], other=0)
    return t


@triton.jit
def _rope(data, valid, ROPE_AT: tl.constexpr, KEYS: tl.constexpr):
    """The bf16 rope of each row ([64, BLOCK_N] for ``KEYS``, else [BLOCK_N, 64])."""
    return _gather((data + ROPE_AT).to(tl.pointer_type(tl.bfloat16), bitcast=True), valid, 0, _ROPE, KEYS)


# ------------------------------------------------------------------ q in f16

@triton.jit
def _q_exponent(q_rows, h_mask):
    """Per head, the biased exponent ``e`` of the largest |q| over the NoPE columns (15 <= e <= 254):
    ``q * 2**(141 - e)`` puts that largest value in [2**14, 2**15), inside f16's range, and every q
    value down to 2**-31 of it keeps all of bf16's 8 bits there (:func:`_q_half`); the scores are
    then scaled back by ``2**(e - 141)`` (:func:`~..shared.triton.e8m0_value`), exactly."""
    cols = tl.arange(0, 512)
    q = tl.load(q_rows + cols[None, :], mask=h_mask[:, None] & (cols[None, :] < _NOPE), other=0.0).to(tl.float32)
    top = tl.max(tl.abs(q), 1)
    return tl.minimum(tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)



@triton.jit
def _q_half(q_rows, h_mask, q_exp, COL0: tl.constexpr, WIDTH: tl.constexpr, STRIDE: tl.constexpr):
    """q's NoPE columns ``COL0 + STRIDE * j`` (``j < WIDTH``) times ``2**(141 - q_exp)`` per head, as
    f16 ([BLOCK_H, WIDTH]; exact, :func:`_q_exponent`)."""
    q = _q(q_rows, h_mask, COL0, WIDTH, STRIDE).to(tl.float32) * e8m0_value(268 - q_exp)[:, None]
    return q.to(tl.float16)


# ------------------------------------------------------------------ the 584-byte fp8 record

@triton.jit
def _fp8_scale(scales, valid, G: tl.constexpr):
    """Group ``G``'s scale of each row, ``2 ** (byte - 127)`` as fp32 ([BLOCK_N]; 0 where invalid;
    :func:`~..shared.triton.e8m0_value`'s bits, here inline: the interpreter pays for every call)."""
    return (tl.load(scales + G, mask=valid, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scores(s, q, data, scale, valid, G: tl.constexpr, DOT_BF16: tl.constexpr):
    """``s`` plus group ``G``'s scores ``(q_G . e4m3_G) * scale`` ([BLOCK_H, BLOCK_N] fp32, q in f16;
    ``scale``: the group's, :func:`_fp8_scale`): the 64 e4m3 values convert to f16 exactly (one
    packed conversion for two), the power-of-two scale multiplies the fp32 partial, exactly."""
    cols = G * _GROUP + tl.arange(0, _GROUP)
    keys = tl.load(data[None, :] + cols[:, None], mask=valid[None, :], other=0)  # [64, BLOCK_N], as _gather
    return s + dot_f16(q, keys.to(tl.float8e4nv, bitcast=True).to(tl.float16), DOT_BF16) * scale[None, :]


@triton.jit
def _fp8_sum(acc, alpha, p, data, scale, valid, G: tl.constexpr, DOT_BF16: tl.constexpr):
    """Group ``G``'s weighted sum ``acc * alpha + (p * scale) @ e4m3_G`` ([BLOCK_H, 64]), in bf16:
    the scale (a power of two, which bf16's range always holds, f16's not) folded into p, whose
    bf16 rounding it leaves as it is."""
    cols = G * _GROUP + tl.arange(0, _GROUP)
    values = tl.load(data[:, None] + cols[None, :], mask=valid[:, None], other=0)  # [BLOCK_N, 64], as _gather
    return acc * alpha + dot(p * scale[None, :], values.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), DOT_BF16)


# ------------------------------------------------------------------ the 384-byte NVFP4 record

# e2m1 codes as e4m3 bytes, four a 32-bit word (see _fp4_piece): the low nibbles' bits 2-0 to bits
# 4-2 and bit 3 to bit 7; the high nibbles' bits 6-4 to bits 4-2, bit 7 stays. Then two packed
# e4m3 -> f16 conversions (the byte at bits 7-0 to the low half).
_FP4_LO_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t, u; .reg .b16 l, h; shl.b32 t, $2, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, $2, 4; "
    "and.b32 u, u, 0x80808080; or.b32 t, t, u; mov.b32 {l, h}, t; "
    "cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }")
_FP4_HI_ASM: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t, u; .reg .b16 l, h; shr.b32 t, $2, 2; and.b32 t, t, 0x1C1C1C1C; "
    "and.b32 u, $2, 0x80808080; or.b32 t, t, u; mov.b32 {l, h}, t; "
    "cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }")


@triton.jit
def _fp4_piece(data, scales, valid, G: tl.constexpr, KEYS: tl.constexpr, DOT_BF16: tl.constexpr):
    """NoPE piece ``G`` (bytes ``[32 G, 32 G + 32)``) of each row as its even values (the low nibbles)
    and its odd ones (the high nibbles), two f16 tiles ([32, BLOCK_N] for ``KEYS``, else
    [BLOCK_N, 32], as :func:`_gather` would load them; inline, as the interpreter pays for every
    call): each e2m1 value times its e4m3 scale, exact in f16 (at most 6 significant bits, between
    2**-10 and 2688). Each scale byte is loaded once and broadcast over its 8 bytes.

    A code's bits placed as an e4m3 byte (sign to bit 7, exponent and mantissa to bits 4-2) read
    ``e2m1 * 2**-6`` for every code (exponent 0: an e4m3 subnormal, ``m * 2**-7``), which the
    hardware's e4m3 -> f16 conversion decodes; the scale is taken times 2**6. On a GPU four bytes a
    32-bit word in inline PTX (the same bits); under the interpreter, which runs no PTX, in Triton."""
    cols = G * _FP4_PIECE + tl.arange(0, _FP4_PIECE)
    groups = G * _FP4_PIECE // _FP4_SCALE_BYTES + tl.arange(0, _FP4_PIECE // _FP4_SCALE_BYTES)
    if KEYS:
        byte = tl.load(data[None, :] + cols[:, None], mask=valid[None, :], other=0)
        sf = tl.load(scales[None, :] + groups[:, None], mask=valid[None, :], other=0)
        sf = tl.reshape(tl.broadcast_to(sf[:, None, :], [groups.shape[0], _FP4_SCALE_BYTES, sf.shape[1]]),
                        [_FP4_PIECE, sf.shape[1]])
    else:
        byte = tl.load(data[:, None] + cols[None, :], mask=valid[:, None], other=0)
        sf = tl.load(scales[:, None] + groups[None, :], mask=valid[:, None], other=0)
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], [sf.shape[0], groups.shape[0], _FP4_SCALE_BYTES]),
                        [sf.shape[0], _FP4_PIECE])
    scale = sf.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
    if DOT_BF16:
        even = tl.inline_asm_elementwise(_FP4_LO_ASM, "=r,=r,r", [byte], dtype=tl.float16, is_pure=True, pack=4)
        odd = tl.inline_asm_elementwise(_FP4_HI_ASM, "=r,=r,r", [byte], dtype=tl.float16, is_pure=True, pack=4)
    else:
        even = (((byte & 7) << 2) | ((byte & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even * scale, odd * scale


@triton.jit
def _fp4_scores(s, q_even, q_odd, data, scales, valid, G: tl.constexpr, DOT_BF16: tl.constexpr):
    """``s`` plus the scores of NoPE piece ``G``: its even and its odd values (f16)."""
    even, odd = _fp4_piece(data, scales, valid, G, True, DOT_BF16)
    return s + dot_f16(q_even, even, DOT_BF16) + dot_f16(q_odd, odd, DOT_BF16)


@triton.jit
def _fp4_sums(acc_even, acc_odd, alpha, p, data, scales, valid, G: tl.constexpr, DOT_BF16: tl.constexpr):
    """The weighted sums of NoPE piece ``G``'s even and odd values (f16 p)."""
    even, odd = _fp4_piece(data, scales, valid, G, False, DOT_BF16)
    return acc_even * alpha + dot_f16(p, even, DOT_BF16), acc_odd * alpha + dot_f16(p, odd, DOT_BF16)


# ------------------------------------------------------------------ q, the softmax, the output

@triton.jit
def _q(q_rows, h_mask, COL0: tl.constexpr, WIDTH: tl.constexpr, STRIDE: tl.constexpr):
    """q's columns ``COL0 + STRIDE * j`` for ``j < WIDTH`` ([BLOCK_H, WIDTH], q's dtype)."""
    return tl.load(q_rows + COL0 + STRIDE * tl.arange(0, WIDTH)[None, :], mask=h_mask[:, None], other=0.0)


@triton.jit
def _softmax(s, valid, m_i, l_i):
    """One step of the online softmax (base 2) over the step's scores ``s`` ([BLOCK_H, BLOCK_N],
    already times log2(e) * scale): ``(p, alpha, m_i, l_i)``, ``alpha`` the accumulators' rescale."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing valid yet keeps m = -inf; subtracting 0 instead keeps exp2 finite
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    return p, alpha[:, None], m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store(out_rows, x, mask, COL0: tl.constexpr, WIDTH: tl.constexpr, STRIDE: tl.constexpr, ROUND: tl.constexpr):
    """Store ``x`` ([BLOCK_H, WIDTH] fp32) at columns ``COL0 + STRIDE * j`` of the heads' rows: rounded
    to the pointer's dtype with ``ROUND`` (:func:`store_rounded`), as fp32 otherwise."""
    ptrs = out_rows + COL0 + STRIDE * tl.arange(0, WIDTH)[None, :]
    if ROUND:
        store_rounded(ptrs, x, mask)
    else:
        tl.store(ptrs, x, mask=mask)


# ------------------------------------------------------------------ the walk over a split's steps

@triton.jit
def _step_rows(next_ids, swa_idx_row, extra_idx_row, start, hi, swa_span, n_swa, n_extra, swa, extra,
               DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """The step at ``start``: its rows (``valid``, data and scale pointers, from the ids loaded a step
    earlier) and the next step's ids, loaded now: a step's row addresses then depend only on the
    previous iteration, the ids' round trip is off the step's chain."""
    ids = _ids(swa_idx_row, extra_idx_row, start + BLOCK_N, hi, swa_span, n_swa, n_extra, BLOCK_N, HAS_EXTRA)
    cache = swa
    if HAS_EXTRA:
        if start >= swa_span:
            cache = extra
    valid, data, scales = _rows(next_ids, cache, DATA_BYTES, SCALE_BYTES)
    return valid, data, scales, ids


@triton.jit
def _fp8_walk(q_rows, h_mask, swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, swa, extra,
              qk_scale_log2, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr,
              DOT_BF16: tl.constexpr):
    """The 584-byte record's walk: per step, seven 64-wide e4m3 groups and the bf16 rope, each a score
    dot (f16 for the groups, q scaled into f16's range) and a weighted-sum dot (bf16; each group's
    scale on its fp32 partial scores and on p); returns the softmax state and the eight
    [BLOCK_H, 64] accumulators."""
    q_exp = _q_exponent(q_rows, h_mask)
    q_up = e8m0_value(q_exp - 14)[:, None]  # the NoPE scores' scale back (2 ** (e - 141))
    q0 = _q_half(q_rows, h_mask, q_exp, 0, _GROUP, 1)
    q1 = _q_half(q_rows, h_mask, q_exp, _GROUP, _GROUP, 1)
    q2 = _q_half(q_rows, h_mask, q_exp, 2 * _GROUP, _GROUP, 1)
    q3 = _q_half(q_rows, h_mask, q_exp, 3 * _GROUP, _GROUP, 1)
    q4 = _q_half(q_rows, h_mask, q_exp, 4 * _GROUP, _GROUP, 1)
    q5 = _q_half(q_rows, h_mask, q_exp, 5 * _GROUP, _GROUP, 1)
    q6 = _q_half(q_rows, h_mask, q_exp, 6 * _GROUP, _GROUP, 1)
    qr = _q(q_rows, h_mask, _NOPE, _ROPE, 1)
    a0 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a1 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a2 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a3 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a4 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a5 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    a6 = tl.zeros([BLOCK_H, _GROUP], tl.float32)
    ar = tl.zeros([BLOCK_H, _ROPE], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    ids = _ids(swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, BLOCK_N, HAS_EXTRA)
    for start in range(lo, hi, BLOCK_N):
        valid, data, scales, ids = _step_rows(ids, swa_idx_row, extra_idx_row, start, hi, swa_span, n_swa, n_extra,
                                              swa, extra, _DATA, _SCALES, BLOCK_N, HAS_EXTRA)
        sc0 = _fp8_scale(scales, valid, 0)
        sc1 = _fp8_scale(scales, valid, 1)
        sc2 = _fp8_scale(scales, valid, 2)
        sc3 = _fp8_scale(scales, valid, 3)
        sc4 = _fp8_scale(scales, valid, 4)
        sc5 = _fp8_scale(scales, valid, 5)
        sc6 = _fp8_scale(scales, valid, 6)
        s = _fp8_scores(tl.zeros([BLOCK_H, BLOCK_N], tl.float32), q0, data, sc0, valid, 0, DOT_BF16)
        s = _fp8_scores(s, q1, data, sc1, valid, 1, DOT_BF16)
        s = _fp8_scores(s, q2, data, sc2, valid, 2, DOT_BF16)
        s = _fp8_scores(s, q3, data, sc3, valid, 3, DOT_BF16)
        s = _fp8_scores(s, q4, data, sc4, valid, 4, DOT_BF16)
        s = _fp8_scores(s, q5, data, sc5, valid, 5, DOT_BF16)
        rope = _rope(data, valid, _NOPE, False)
        s = _fp8_scores(s, q6, data, sc6, valid, 6, DOT_BF16) * q_up + dot(qr, tl.trans(rope), DOT_BF16)
        p, alpha, m_i, l_i = _softmax(s * qk_scale_log2, valid, m_i, l_i)
        a0 = _fp8_sum(a0, alpha, p, data, sc0, valid, 0, DOT_BF16)
        a1 = _fp8_sum(a1, alpha, p, data, sc1, valid, 1, DOT_BF16)
        a2 = _fp8_sum(a2, alpha, p, data, sc2, valid, 2, DOT_BF16)
        a3 = _fp8_sum(a3, alpha, p, data, sc3, valid, 3, DOT_BF16)
        a4 = _fp8_sum(a4, alpha, p, data, sc4, valid, 4, DOT_BF16)
        a5 = _fp8_sum(a5, alpha, p, data, sc5, valid, 5, DOT_BF16)
        a6 = _fp8_sum(a6, alpha, p, data, sc6, valid, 6, DOT_BF16)
        ar = ar * alpha + dot(p, rope, DOT_BF16)
    return m_i, l_i, a0, a1, a2, a3, a4, a5, a6, ar


@triton.jit
def _fp4_walk(q_rows, h_mask, swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, swa, extra,
              qk_scale_log2, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr,
              DOT_BF16: tl.constexpr):
    """The 384-byte NVFP4 record's walk: per step, the NoPE's seven 32-byte pieces (64 values each),
    each split into its even and odd values (the low and high nibbles), and the bf16 rope, each a
    score dot and a weighted-sum dot (f16 for the NoPE, q scaled into f16's range and p rounded to
    f16; the e4m3 scales inside the operand); returns the softmax state and fifteen accumulators
    (even / odd values of each piece, [BLOCK_H, 32], then the rope's [BLOCK_H, 64])."""
    q_exp = _q_exponent(q_rows, h_mask)
    q_up = e8m0_value(q_exp - 14)[:, None]  # the NoPE scores' scale back (2 ** (e - 141))
    q0e = _q_half(q_rows, h_mask, q_exp, 0, _FP4_PIECE, 2)
    q0o = _q_half(q_rows, h_mask, q_exp, 1, _FP4_PIECE, 2)
    q1e = _q_half(q_rows, h_mask, q_exp, 64, _FP4_PIECE, 2)
    q1o = _q_half(q_rows, h_mask, q_exp, 65, _FP4_PIECE, 2)
    q2e = _q_half(q_rows, h_mask, q_exp, 128, _FP4_PIECE, 2)
    q2o = _q_half(q_rows, h_mask, q_exp, 129, _FP4_PIECE, 2)
    q3e = _q_half(q_rows, h_mask, q_exp, 192, _FP4_PIECE, 2)
    q3o = _q_half(q_rows, h_mask, q_exp, 193, _FP4_PIECE, 2)
    q4e = _q_half(q_rows, h_mask, q_exp, 256, _FP4_PIECE, 2)
    q4o = _q_half(q_rows, h_mask, q_exp, 257, _FP4_PIECE, 2)
    q5e = _q_half(q_rows, h_mask, q_exp, 320, _FP4_PIECE, 2)
    q5o = _q_half(q_rows, h_mask, q_exp, 321, _FP4_PIECE, 2)
    q6e = _q_half(q_rows, h_mask, q_exp, 384, _FP4_PIECE, 2)
    q6o = _q_half(q_rows, h_mask, q_exp, 385, _FP4_PIECE, 2)
    qr = _q(q_rows, h_mask, _NOPE, _ROPE, 1)
    a0e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a0o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a1e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a1o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a2e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a2o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a3e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a3o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a4e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a4o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a5e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a5o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a6e = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    a6o = tl.zeros([BLOCK_H, _FP4_PIECE], tl.float32)
    ar = tl.zeros([BLOCK_H, _ROPE], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    ids = _ids(swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, BLOCK_N, HAS_EXTRA)
    for start in range(lo, hi, BLOCK_N):
        valid, data, scales, ids = _step_rows(ids, swa_idx_row, extra_idx_row, start, hi, swa_span, n_swa, n_extra,
                                              swa, extra, _FP4_DATA, _FP4_SCALES, BLOCK_N, HAS_EXTRA)
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s = _fp4_scores(s, q0e, q0o, data, scales, valid, 0, DOT_BF16)
        s = _fp4_scores(s, q1e, q1o, data, scales, valid, 1, DOT_BF16)
        s = _fp4_scores(s, q2e, q2o, data, scales, valid, 2, DOT_BF16)
        s = _fp4_scores(s, q3e, q3o, data, scales, valid, 3, DOT_BF16)
        s = _fp4_scores(s, q4e, q4o, data, scales, valid, 4, DOT_BF16)
        s = _fp4_scores(s, q5e, q5o, data, scales, valid, 5, DOT_BF16)
        s = _fp4_scores(s, q6e, q6o, data, scales, valid, 6, DOT_BF16)
        s = s * q_up + dot(qr, _rope(data, valid, _FP4_NOPE_BYTES, True), DOT_BF16)
        p, alpha, m_i, l_i = _softmax(s * qk_scale_log2, valid, m_i, l_i)
        p16 = p.to(tl.float16)
        a0e, a0o = _fp4_sums(a0e, a0o, alpha, p16, data, scales, valid, 0, DOT_BF16)
        a1e, a1o = _fp4_sums(a1e, a1o, alpha, p16, data, scales, valid, 1, DOT_BF16)
        a2e, a2o = _fp4_sums(a2e, a2o, alpha, p16, data, scales, valid, 2, DOT_BF16)
        a3e, a3o = _fp4_sums(a3e, a3o, alpha, p16, data, scales, valid, 3, DOT_BF16)
        a4e, a4o = _fp4_sums(a4e, a4o, alpha, p16, data, scales, valid, 4, DOT_BF16)
        a5e, a5o = _fp4_sums(a5e, a5o, alpha, p16, data, scales, valid, 5, DOT_BF16)
        a6e, a6o = _fp4_sums(a6e, a6o, alpha, p16, data, scales, valid, 6, DOT_BF16)
        ar = ar * alpha + dot(p, _rope(data, valid, _FP4_NOPE_BYTES, False), DOT_BF16)
    return m_i, l_i, a0e, a0o, a1e, a1o, a2e, a2o, a3e, a3o, a4e, a4o, a5e, a5o, a6e, a6o, ar


@triton.jit(do_not_specialize=("head_blocks", "steps", "num_splits", "swa_magic", "swa_shift", "swa_page",
                               "swa_capacity", "extra_magic", "extra_shift", "extra_page", "extra_capacity"))
def _dsv4_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    swa_ptr, swa_idx_ptr, swa_len_ptr, extra_ptr, extra_idx_ptr, extra_len_ptr,
    num_heads, q_stride_t, q_stride_h, out_stride_t, out_stride_s, out_stride_h, lse_stride_t, lse_stride_s,
    swa_idx_stride, swa_width, swa_capacity, swa_magic, swa_shift, swa_page, swa_page_stride,
    extra_idx_stride, extra_width, extra_capacity, extra_magic, extra_shift, extra_page, extra_page_stride,
    qk_scale_log2, head_blocks, steps, num_splits,
    FINAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, HAS_SWA_LEN: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr,
    NVFP4: tl.constexpr,
):
    """One (token, head block, split): the split's share of the call's ``steps`` steps of ``BLOCK_N``
    candidates (steps ``[split * steps // num_splits, (split + 1) * steps // num_splits)``: ranges
    differ by at most one step) of the call's list, the window's index row in whole steps followed by
    the compressed one's (positions by the rows' widths, so the cut depends on shapes only), walked
    as one loop whose steps each read one cache, ending at the live end of the compressed row.
    ``FINAL`` (one split): the sink applied and ``out`` written; otherwise the range's normalized fp32
    partial and base-2 LSE, which :mod:`..shared.combine` merges. A token's head blocks are
    neighbours in the grid's first axis, so they run side by side and read the same rows at about the
    same time (L2 serves all but the first)."""
    pid = tl.program_id(0)
    tok = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    h_mask = heads < num_heads
    lo = (split * steps // num_splits) * BLOCK_N
    hi = ((split + 1) * steps // num_splits) * BLOCK_N
    swa_span = (swa_width + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # the window row in whole steps
    n_swa = swa_width
    if HAS_SWA_LEN:
        n_swa = tl.minimum(tl.maximum(tl.load(swa_len_ptr + tok), 0), swa_width)
    n_extra = extra_width
    if HAS_EXTRA:
        if HAS_EXTRA_LEN:
            n_extra = tl.minimum(tl.maximum(tl.load(extra_len_ptr + tok), 0), extra_width)
        hi = tl.minimum(hi, swa_span + n_extra)  # no step past the compressed row's live end
    else:
        hi = tl.minimum(hi, n_swa)
    swa_idx_row = swa_idx_ptr + tok * swa_idx_stride
    extra_idx_row = extra_idx_ptr + tok * extra_idx_stride
    swa = (swa_ptr, swa_capacity, swa_magic, swa_shift, swa_page, swa_page_stride)
    extra = (extra_ptr, extra_capacity, extra_magic, extra_shift, extra_page, extra_page_stride)
    q_rows = q_ptr + tok * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h
    if NVFP4:
        m_i, l_i, a0e, a0o, a1e, a1o, a2e, a2o, a3e, a3o, a4e, a4o, a5e, a5o, a6e, a6o, ar = _fp4_walk(
            q_rows, h_mask, swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, swa, extra, qk_scale_log2,
            BLOCK_H, BLOCK_N, HAS_EXTRA, DOT_BF16)
    else:
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, ar = _fp8_walk(
            q_rows, h_mask, swa_idx_row, extra_idx_row, lo, hi, swa_span, n_swa, n_extra, swa, extra, qk_scale_log2,
            BLOCK_H, BLOCK_N, HAS_EXTRA, DOT_BF16)
    rows = out_ptr + tok * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h
    if FINAL:
        if HAS_SINK:
            # the sink is a natural-log logit; the scores are base 2
            sink = tl.load(sink_ptr + heads, mask=h_mask, other=float("-inf")) * LOG2E_K
            l_i += tl.math.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        inv_l = tl.where(m_i > float("-inf"), 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    else:
        # an empty range stores zeros and an LSE of -inf: the combine gives it no weight
        has_any = l_i > 0.0
        inv_l = tl.where(has_any, 1.0 / tl.where(has_any, l_i, 1.0), 0.0)
        lse2 = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * lse_stride_t + split * lse_stride_s + heads, lse2, mask=h_mask)
        rows += split * out_stride_s
    inv_l = inv_l[:, None]
    mask = h_mask[:, None]
    if NVFP4:
        _store(rows, a0e * inv_l, mask, 0, _FP4_PIECE, 2, FINAL)
        _store(rows, a0o * inv_l, mask, 1, _FP4_PIECE, 2, FINAL)
        _store(rows, a1e * inv_l, mask, 64, _FP4_PIECE, 2, FINAL)
        _store(rows, a1o * inv_l, mask, 65, _FP4_PIECE, 2, FINAL)
        _store(rows, a2e * inv_l, mask, 128, _FP4_PIECE, 2, FINAL)
        _store(rows, a2o * inv_l, mask, 129, _FP4_PIECE, 2, FINAL)
        _store(rows, a3e * inv_l, mask, 192, _FP4_PIECE, 2, FINAL)
        _store(rows, a3o * inv_l, mask, 193, _FP4_PIECE, 2, FINAL)
        _store(rows, a4e * inv_l, mask, 256, _FP4_PIECE, 2, FINAL)
        _store(rows, a4o * inv_l, mask, 257, _FP4_PIECE, 2, FINAL)
        _store(rows, a5e * inv_l, mask, 320, _FP4_PIECE, 2, FINAL)
        _store(rows, a5o * inv_l, mask, 321, _FP4_PIECE, 2, FINAL)
        _store(rows, a6e * inv_l, mask, 384, _FP4_PIECE, 2, FINAL)
        _store(rows, a6o * inv_l, mask, 385, _FP4_PIECE, 2, FINAL)
    else:
        _store(rows, a0 * inv_l, mask, 0, _GROUP, 1, FINAL)
        _store(rows, a1 * inv_l, mask, _GROUP, _GROUP, 1, FINAL)
        _store(rows, a2 * inv_l, mask, 2 * _GROUP, _GROUP, 1, FINAL)
        _store(rows, a3 * inv_l, mask, 3 * _GROUP, _GROUP, 1, FINAL)
        _store(rows, a4 * inv_l, mask, 4 * _GROUP, _GROUP, 1, FINAL)
        _store(rows, a5 * inv_l, mask, 5 * _GROUP, _GROUP, 1, FINAL)
        _store(rows, a6 * inv_l, mask, 6 * _GROUP, _GROUP, 1, FINAL)
    _store(rows, ar * inv_l, mask, _NOPE, _ROPE, 1, FINAL)


def _int32_lengths(lengths: torch.Tensor | None) -> torch.Tensor | None:
    if lengths is None or (lengths.dtype == torch.int32 and lengths.is_contiguous()):
        return lengths
    return lengths.clamp(max=2**31 - 1).to(torch.int32).contiguous()


def _bad(given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(given, supported, fix))


def _check_cache(name: str, cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None,
                 page_size: int, q: torch.Tensor, record: layout.Dsv4Record = REC) -> None:
    if cache.dim() != 2 or cache.dtype != torch.uint8 or cache.stride(1) != 1 or cache.device != q.device:
        raise _bad(f"{name}_cache of shape {tuple(cache.shape)}, dtype {cache.dtype}, device {cache.device}",
                   f"[pages, page_stride] uint8 with contiguous pages on q's device ({q.device})",
                   "pass the engine's cache as a 2-D byte view: cache.view(num_pages, -1)")
    if not isinstance(page_size, int) or page_size < 1 or cache.shape[1] < page_size * record.token_bytes:
        raise _bad(f"{name}_page_size={page_size!r} for pages of {cache.shape[1]} bytes",
                   f"a positive page size with page_size x {record.token_bytes} <= the page's bytes",
                   "pass the cache's own page size (entries a page)")
    if cache.stride(0) % 2 or cache.data_ptr() % 2:
        raise _bad(f"{name}_cache page stride {cache.stride(0)} bytes at address {cache.data_ptr():#x}",
                   "an even page stride and origin (the rope is read as bfloat16)",
                   "pass the engine's cache as allocated (its pages are multiples of 576 bytes)")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0] or indices.dtype != torch.int32 or indices.stride(1) != 1:
        raise _bad(f"{name}_indices of shape {tuple(indices.shape)}, dtype {indices.dtype}",
                   f"[{q.shape[0]}, K] int32 with unit stride along K: global slots (page * page_size + row), -1 pads",
                   "pass indices.to(torch.int32).contiguous()")
    if lengths is not None and (lengths.shape != (q.shape[0],) or lengths.device != q.device):
        raise _bad(f"{name}_lengths of shape {tuple(lengths.shape)}", f"[{q.shape[0]}] integers on q's device",
                   "pass one length a token, or None")


def _scratch(q: torch.Tensor, num_splits: int, workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split partials, carved from the front of ``workspace`` where it holds them (an engine's
    preallocated bytes: nothing is allocated in the call), else allocated."""
    tokens, heads, _ = q.shape
    shape = (tokens, num_splits, heads)
    partial_bytes = tokens * num_splits * heads * OUT_DIM * 4
    if (workspace is not None and workspace.dtype == torch.uint8 and workspace.device == q.device
            and workspace.is_contiguous() and workspace.data_ptr() % 16 == 0
            and workspace.numel() >= plan.scratch_bytes(tokens, heads, num_splits)):
        flat = workspace.view(-1)
        partials = flat[:partial_bytes].view(torch.float32).view(*shape, OUT_DIM)
        lse = flat[partial_bytes:partial_bytes + tokens * num_splits * heads * 4].view(torch.float32).view(shape)
        return partials, lse
    return (torch.empty(*shape, OUT_DIM, dtype=torch.float32, device=q.device),
            torch.empty(shape, dtype=torch.float32, device=q.device))



def _geometry(cache: torch.Tensor, page_size: int) -> tuple:
    """A cache's kernel arguments after its index row: capacity, page divisor, page size, page stride."""
    return (cache.shape[0] * page_size, *page_divisor(page_size), page_size, cache.stride(0))


def launch_plan(q, out, swa_cache, swa_indices, swa_page_size, *, sm_scale, swa_lengths=None, extra_cache=None,
                extra_indices=None, extra_lengths=None, extra_page_size=None, sinks=None,
                cfg: Dsv4Config | None = None, interpret: bool = False,
                record: layout.Dsv4Record = REC, workspace: torch.Tensor | None = None) -> list[Launch]:
    """The launches of one call (what :func:`dsv4_attention` runs and the compile gate compiles):
    one when ``cfg.num_splits == 1``; otherwise the split kernel into fp32 partials (from
    ``workspace`` where it is large enough, :func:`.plan.scratch_bytes`), then the shared combine into ``out``."""
    cfg = cfg or default_config(record)
    tokens, heads, _ = q.shape
    extra = extra_cache is not None
    final = cfg.num_splits <= 1
    dummy = swa_indices
    head_blocks = cdiv(heads, cfg.block_h)
    if final:
        dest, dest_lse = out, out
        dest_strides, lse_strides = (out.stride(0), 0, out.stride(1)), (0, 0)
    else:
        dest, dest_lse = _scratch(q, cfg.num_splits, workspace)
        dest_strides, lse_strides = dest.stride()[:3], dest_lse.stride()[:2]
    main = Launch(
        kernel=_dsv4_kernel,
        grid=(tokens * head_blocks, cfg.num_splits),
        args=(q, dest, dest_lse, sinks if sinks is not None else q,
              swa_cache, swa_indices, swa_lengths if swa_lengths is not None else dummy,
              extra_cache if extra else swa_cache, extra_indices if extra else dummy,
              extra_lengths if extra_lengths is not None else dummy,
              heads, q.stride(0), q.stride(1), *dest_strides, *lse_strides,
              swa_indices.stride(0), swa_indices.shape[1], *_geometry(swa_cache, swa_page_size),
              extra_indices.stride(0) if extra else 0, extra_indices.shape[1] if extra else 0,
              *(_geometry(extra_cache, extra_page_size) if extra else (0, 1, 31, 1, 0)),
              sm_scale * LOG2E, head_blocks, cfg.steps(swa_indices.shape[1], extra_indices.shape[1] if extra else 0),
              cfg.num_splits),
        constexprs=dict(FINAL=final, NVFP4=record.nope_bits == 4, HAS_EXTRA=extra,
                        HAS_SINK=final and sinks is not None, HAS_SWA_LEN=swa_lengths is not None,
                        HAS_EXTRA_LEN=extra and extra_lengths is not None, BLOCK_H=cfg.block_h,
                        BLOCK_N=cfg.block_n, DOT_BF16=not interpret),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
        describe=dict(kernel="dsv4", record=record.name, extra=extra, sink=sinks is not None,
                      out=str(dest.dtype).replace("torch.", ""), final=int(final), block_h=cfg.block_h,
                      block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages,
                      **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg})),
    )
    if final:
        return [main]
    return [main, combine_launch(dest, dest_lse, sink=sinks, out=out, lse=None, lse_scale=1.0)]


def _family(device: torch.device) -> str:
    if device.type != "cuda":
        return plan.DEFAULT_FAMILY
    return _cuda_family(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_family(device_index: int) -> str:
    # asked once a device: the call path runs every forward
    return gpu_family(*torch.cuda.get_device_capability(device_index))


def dsv4_attention(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_page_size: int,
    *,
    sm_scale: float,
    swa_lengths: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    extra_page_size: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Dsv4Config | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    record: layout.Dsv4Record = REC,
) -> torch.Tensor:
    """DeepSeek-V4 attention over a window cache and (optionally) a compressed cache (Triton).

    The arguments, their shapes and the masking are
    :func:`~mla_sm120_plugin.kernels.dsv4.reference.dsv4_attention_reference`'s (the contract lives
    there), with stricter forms a GPU needs: int32 index rows with unit stride, caches as 2-D byte
    views of even page stride; int64 lengths and float64 sinks are converted here.

    :param out: [T, H, 512] output to write (q's dtype by default).
    :param config: launch shape and split; by default the plan's (:func:`.plan.launch_config`: a pure
        function of the shapes and this GPU's family).
    :param num_splits: force the plan's block shape into this many candidate ranges (tests, the
        self-check; ``config`` wins where both are given).
    :param workspace: uint8 bytes the split partials are carved from where they fit
        (:func:`.plan.scratch_bytes`; 16-byte aligned, contiguous, on q's device), else they are allocated.
    :param record: the caches' record: :data:`.layout.FP8_RECORD` (584 bytes) or
        :data:`.layout.NVFP4_RECORD` (384 bytes: e2m1 x e4m3 NoPE, exact in bf16 too).
    :returns: ``out``: [T, H, 512] in q's dtype (no LSE).
    :raises KernelInputError: a tensor of the wrong shape, dtype, device or alignment.
    """
    if q.dim() != 3 or q.shape[2] != REC.head_dim or q.dtype not in (torch.bfloat16, torch.float32):
        raise _bad(f"q of shape {tuple(q.shape)}, dtype {q.dtype}", f"[T, H, {REC.head_dim}] bf16",
                   "pass the layer's queries (after its norm and rope)")
    _check_cache("swa", swa_cache, swa_indices, swa_lengths, swa_page_size, q, record)
    if (extra_cache is None) != (extra_indices is None) or (extra_cache is not None and extra_page_size is None):
        raise _bad("a compressed cache without its indices or page size (or indices without a cache)",
                   "extra_cache, extra_indices and extra_page_size together, or none of them",
                   "pass all three for a compressed layer")
    if extra_cache is not None:
        _check_cache("extra", extra_cache, extra_indices, extra_lengths, extra_page_size, q, record)
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.dtype.is_floating_point):
        raise _bad(f"sinks of shape {tuple(sinks.shape)}, dtype {sinks.dtype}", f"[{q.shape[1]}] float32",
                   "one logit a head (padded heads: -inf)")
    # The kernel reads lengths as int32 and sinks as fp32 (a GPU would misread other widths); the
    # engines' int32 lengths and fp32 sinks pass as they are (no copy in a captured call).
    swa_lengths = _int32_lengths(swa_lengths)
    extra_lengths = _int32_lengths(extra_lengths)
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise _bad(f"out of shape {tuple(out.shape)}", f"{tuple(q.shape)} with unit stride along the last dim",
                   "pass a contiguous [T, H, 512] tensor, or None")
    if q.shape[0] == 0:
        return out
    interpret = interpreting() or q.device.type == "cpu"
    window, compressed = swa_indices.shape[1], extra_indices.shape[1] if extra_cache is not None else 0
    if config is None and num_splits is not None:
        config = plan.forced(record, num_splits, window, compressed)
    elif config is None:
        config = plan.launch_config(record, q.shape[0], q.shape[1], window, compressed, _family(q.device))
    for launch in launch_plan(q, out, swa_cache, swa_indices, swa_page_size, sm_scale=sm_scale,
                              swa_lengths=swa_lengths, extra_cache=extra_cache, extra_indices=extra_indices,
                              extra_lengths=extra_lengths, extra_page_size=extra_page_size, sinks=sinks,
                              cfg=config, interpret=interpret, record=record, workspace=workspace):
        launch.run()
    return out
