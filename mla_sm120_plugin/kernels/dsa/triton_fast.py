"""Fast Triton sparse-MLA kernel for the fp8 caches: fp8 MMAs on the cache's own e4m3 bytes.

Same contract as :func:`mla_sm120_plugin.kernels.dsa.triton.triton_sparse_mla` (``sparse_mla_forward``'s
docstring describes every argument); only the numerics differ, by design. It reads every fp8 layout
of :mod:`.layout`: ``fp8_ds_mla`` (656-byte rows with a 64-wide bf16 rope) and the rope-less rows of
GLM-5.3-Flash, ``fp8_ds_mla_nope`` (656 bytes, [528, 656) reserved, never loaded) and ``fp8_nope``
(528 bytes); the row stride is the cache tensor's, the rope width a constexpr from the layout (the
rope dot and q's rope tile are not in a rope-less variant's code). A bf16 cache (``bf16``,
``bf16_nope``) is delegated to the exact kernel.

Numerics: exact class (cos_diff <= 5e-6 and relRMS <= 0.3 % against float64 attention over the
dequantized rows, :data:`ACCURACY`) from fp8 MMAs only, by carrying q and the probabilities as
e4m3 *pairs*:

* q is split on-chip, per (head, 128-wide latent tile), into ``hi`` (q rounded to e4m3 under a
  power-of-two scale ``2 ** ceil(log2(amax / 448))``) and ``lo`` (the exact residual ``q - hi``,
  rounded to e4m3 under its own power-of-two scale). Each part keeps 4 significant bits of what it
  holds, so the pair carries about 8: bf16's precision, the q the engines pass. Powers of two apply
  exactly, so both scales ride in the MMA's own block scale (``tl.dot_scaled``, e8m0, one per 32
  elements); the two dots share the key bytes and accumulate into one fp32 tile.
* The latent dots multiply the stored e4m3 key bytes as they are. The per-(token, tile) fp32 key
  scale - arbitrary (GLM) or a power of two (DeepSeek-V3.2), the kernel need not know which -
  multiplies the fp32 partial scores of its tile.
* The 64-wide rope part, where the layout has one, stays a bf16 x bf16 dot (the cache stores it
  in bf16).
* For the value dots, each tile's fp32 value scale is folded into the probabilities, which are
  scaled by a per-(head, step) power of two chosen from an upper bound that costs no row
  reduction - ``max_j p[h, j] = exp2(rowmax(s) - m)``, known from the online softmax, times the
  step's largest value scale over the four tiles (:func:`_p_exponent`) - and split the same way:
  ``hi`` rounded to e4m3, the residual times ``2**4`` rounded again (a residual is at most half an
  e4m3 step, 1/16 of its value). Two block-scaled MMAs on the same value bytes.
* Accumulation is fp32, and so are split partials (a bf16 partial is a second rounding of the
  output: ~0.1 % relRMS more), the LSE fp32 and base 2.

A single e4m3 q and p (what FlashInfer's SM120 kernels do, and what this kernel did before) are
3-5 % relRMS off: each rounding moves a product by up to 2**-4, and an attention output is a sum
whose error does not average out against its own size. The pair costs twice the fp8 MMAs, which
decode (gather- and latency-bound) barely notices, and no dequantization.

Why ``tl.dot_scaled`` for every fp8 MMA: on GeForce SM120 plain fp8 ``mma.sync``
(``QMMA.16832.F32.E4M3.E4M3``) runs at half the 8-bit rate; the block-scaled form
(``QMMA.SF.16832.F32.E4M3.E4M3.E8``) runs at full rate and, with unit scales, returns the same
products (triton#11320). The scales that are exact powers of two (q's, p's) are given to it; the
cache's scales, which need not be, are applied in fp32 (4 multiplies of a [16, 32] tile a step).
No e8m0 code is ever 0: the interpreter decodes that byte as 0, a GPU as 2**-127.

Rounding. A GPU's fp32 -> e4m3 cast rounds to nearest even; the interpreter's truncates. So the
kernel rounds every value it quantizes itself, in fp32 arithmetic (:func:`_round_e4m3`), before
the cast, which is then exact on both. The interpreter runs this same code, ``tl.dot_scaled``
included (it multiplies the exactly-representable e4m3 values and their scales in fp32): the CPU
tests check the real fp8 numerics.

Memory. One program handles one token, 16 heads and one range of top-k candidates, 32 a step.
Each step loads the *next* step's slot ids by hand; since every row address of a step then comes
from the previous iteration, Triton's software pipeliner (``num_stages=2``) turns the row and
scale gathers into asynchronous copies (``LDGSTS``) issued one step ahead - which it cannot do for
a gather whose indices are loaded in the same iteration (triton#4721). The key tile is loaded
already transposed ([128, 32]: dims down, candidates across), the form the pipeliner accepts as an
fp8 MMA operand; the value tile is its own load of the same bytes (an L2 hit; DRAM reads them
once). A slot's page comes from a multiply-shift, not a runtime division (which alone cost
enough registers to spill), and ``topk_length`` acts only through the slot-id load.

Occupancy. 8 warps of 128 registers, no spills, under Triton's bundled ptxas and CUDA 13's
(:mod:`~mla_sm120_plugin.tools.compile_gate` gates both); 55.5 KB of shared memory (49.5 KB
rope-less): the q pair (16 KB), one step of key and value tiles in flight (32 KB), the rope.
That is one CTA per SM on sm_120a/121a (two need <= 49 KB a CTA); the single-e4m3 kernel fit two.
Each program keeps the next step's rows in flight (16 KB of cache bytes, copied as key and value
tiles), more than twice what one SM needs to cover DRAM latency at its share of the bandwidth (an
RTX 5090: 1.8 TB/s x ~600 ns / 170 SMs ~ 6 KB), and the launch plan fills the SMs with splits at one CTA each
(:data:`~mla_sm120_plugin.kernels.dsa.triton_plan.FAST`). Tried and measured on the way (sm_120a,
Triton 3.8): rebuilding q's ``lo`` every step (50.2 KB, but 174-190 registers), not pipelining the
value or key tiles (43-52 KB, 129-186 registers or spills), 4 warps (255 registers, spills),
``maxnreg=128`` on those (8-132 bytes of spills), one K=64 MMA over ``[hi | lo]`` (255 registers).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import triton as exact
from mla_sm120_plugin.kernels.dsa import triton_plan as plan
from mla_sm120_plugin.kernels.dsa.triton import _dot, _finalize, _row_offset, _slot_ids

# What the kernel promises against float64 attention over the dequantized rows
# (:mod:`mla_sm120_plugin.kernels.accuracy`): exact class. Measured under the interpreter, which
# runs these numerics exactly (tests/kernels/test_accuracy.py): cos_diff <= 3e-6, relRMS <= 0.25 %
# in the flat, peaked, outlier-channel and few-candidate regimes on every fp8 layout; the bf16
# output's own rounding is ~0.16 % of that. ``max_rel`` (the worst element against the largest) is
# bounded loosely: with few candidates one element can carry a few bf16 steps.
ACCURACY = EXACT_CLASS_BOUND
# The same bound's max_rel, as the fraction of the largest |reference| the older tests and
# dispatch.catalog's KernelSpec.tolerance read.
TOLERANCE = ACCURACY.max_rel

# The structure every fp8 layout shares (checked per call by triton.layout_constexprs).
_NOPE: tl.constexpr = tl.constexpr(layout.KV_LORA_RANK)
_TILE: tl.constexpr = tl.constexpr(layout.FP8_TILE)
_SCALE_OFF: tl.constexpr = tl.constexpr(layout.FP8_SCALE_OFFSET)
_E4M3_MAX: tl.constexpr = tl.constexpr(layout.FP8_E4M3_MAX)
_INV_E4M3_MAX: tl.constexpr = tl.constexpr(1.0 / layout.FP8_E4M3_MAX)
_MX_BLOCK: tl.constexpr = tl.constexpr(32)  # elements one e8m0 block scale covers
_E8M0_ONE: tl.constexpr = tl.constexpr(127)  # e8m0 code of 1.0
_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-126)
# The e4m3 grid: 3 fraction bits for exponents >= -6 (fp32 biased exponent 121); below that a fixed
# step of 2**-9 (subnormals).
_E4M3_MIN_NORMAL_BIASED: tl.constexpr = tl.constexpr(121)
# P's residual is scaled up by 2**4 before its own rounding: it is at most half an e4m3 step, 1/16
# of the value, so the scaled residual stays within e4m3's range.
_P_LO_SHIFT: tl.constexpr = tl.constexpr(4)
_P_LO_FACTOR: tl.constexpr = tl.constexpr(16.0)

_UNSPECIALIZED = exact._UNSPECIALIZED_MAIN


@triton.jit
def _round_e4m3(x):
    """``x`` (fp32) rounded to the nearest e4m3 value, ties to even, as fp32; saturates at +-448.

    Adding ``1.5 * 2**(k + 23)``, where ``2**k`` is the e4m3 step at ``x``'s magnitude, leaves a sum
    whose fp32 ulp is exactly that step, so the IEEE add (round to nearest even, on a GPU and in
    numpy alike) does the rounding; subtracting it back is exact.
    """
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = tl.maximum(biased, _E4M3_MIN_NORMAL_BIASED) - 3  # biased exponent of the e4m3 step
    magic = (((step + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (x + magic) - magic


@triton.jit
def _pow2_ceil_exponent(x):
    """Biased exponent ``e`` of the smallest power of two >= ``x`` (fp32, normal, > 0): the power
    is ``2 ** (e - 127)`` and ``e`` is also its e8m0 code."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _inverse_pow2(e):
    """``2 ** (127 - e)`` as fp32: the exact inverse of the power of two with biased exponent ``e``."""
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    """``2 ** (e - 127)`` as fp32, for a biased exponent ``1 <= e <= 254``."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_part(x, BLOCK_H: tl.constexpr):
    """``x`` ([BLOCK_H, 128] fp32) as e4m3 under a per-head power of two that brings its largest
    value within e4m3's range: the e4m3 values, the rounded part in fp32, and the e8m0 block scales
    ([BLOCK_H, 4] uint8). No scale code is 0 (the interpreter decodes an e8m0 byte 0 as 0, a GPU as
    2**-127)."""
    e = tl.maximum(_pow2_ceil_exponent(tl.maximum(tl.max(tl.abs(x), axis=1) * _INV_E4M3_MAX, _MIN_NORMAL)), 1)
    part = _round_e4m3(x * _inverse_pow2(e)[:, None])
    return (part.to(tl.float8e4nv), part * _pow2(e)[:, None],
            tl.broadcast_to(e[:, None], [BLOCK_H, _TILE // _MX_BLOCK]).to(tl.uint8))


@triton.jit
def _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, cols, BLOCK_H: tl.constexpr):
    """One 128-wide q tile as an e4m3 pair, once before the loop: ``hi`` (q rounded) and ``lo``
    (the residual ``q - hi``, exact in fp32 since q is bf16, rounded under its own scale), each
    [BLOCK_H, 128] e4m3 with its e8m0 block scales ([BLOCK_H, 4] uint8); a padded head is zeros.
    Each part keeps 4 significant bits of what it holds: together about 8, bf16's precision."""
    q = tl.load(q_ptr + q_row + heads[:, None].to(tl.int64) * q_stride_h + cols[None, :],
                mask=h_mask[:, None], other=0.0).to(tl.float32)
    hi, hi_value, hi_e8 = _e4m3_part(q, BLOCK_H)
    lo, _, lo_e8 = _e4m3_part(q - hi_value, BLOCK_H)
    return hi, hi_e8, lo, lo_e8


@triton.jit
def _tile_scores(q_hi, q_hi_e8, q_lo, q_lo_e8, kv_lat, row_off, valid, cols, scale, ones_k):
    """Scores of one latent tile: ``(hi + lo parts of q) @ key8^T * key_scale``, [BLOCK_H, BLOCK_K]
    fp32: two block-scaled fp8 MMAs on the same key bytes, the second accumulating onto the first.

    The key tile is gathered already transposed ([128, BLOCK_K]), the form Triton's pipeliner turns
    into an asynchronous copy issued a step ahead.
    """
    k_t = tl.load(kv_lat + row_off[None, :] + cols[:, None], mask=valid[None, :], other=0.0)
    s = tl.dot_scaled(q_hi, q_hi_e8, "e4m3", k_t, ones_k, "e4m3")
    s = tl.dot_scaled(q_lo, q_lo_e8, "e4m3", k_t, ones_k, "e4m3", acc=s)
    return s * scale[None, :]


@triton.jit
def _p_exponent(p_bound, sc0, sc1, sc2, sc3):
    """Per head, the biased exponent of the power of two that brings ``p * scale`` of every tile
    within e4m3's range: ``>= p_bound * max(scale) / 448``, one bound for the four tiles (a tile
    whose scales are k times smaller keeps its 3 fraction bits; only its subnormal floor moves by
    log2(k) binades), so one reduction a step instead of four. At least 1 + :data:`_P_LO_SHIFT`, so
    the residual's code (this minus the shift) is never the e8m0 byte 0."""
    smax = tl.max(tl.maximum(tl.maximum(sc0, sc1), tl.maximum(sc2, sc3)), axis=0)
    e = _pow2_ceil_exponent(tl.maximum(p_bound * (smax * _INV_E4M3_MAX), _MIN_NORMAL))
    return tl.maximum(e, 1 + _P_LO_SHIFT)


@triton.jit
def _tile_values(acc, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, cols, scale, ones_v):
    """``acc * alpha + (p * value_scale) @ value8`` for one 128-wide value tile, with ``p * scale``
    (times ``p_inv``, a power of two, into e4m3's range) split as an e4m3 pair: ``hi``, rounded, and
    the residual ``lo`` times ``2**_P_LO_SHIFT`` (a residual is at most 1/16 of its value: half an
    e4m3 step), rounded again. Two block-scaled MMAs on the same value bytes; their scales ``p_e8``
    and ``p_lo_e8`` undo ``p_inv`` and the shift."""
    x = (p * scale[None, :]) * p_inv[:, None]
    hi = _round_e4m3(x)
    lo = _round_e4m3((x - hi) * _P_LO_FACTOR)
    v = tl.load(kv_lat + row_off[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
    acc = tl.dot_scaled(hi.to(tl.float8e4nv), p_e8, "e4m3", v, ones_v, "e4m3", acc=acc * alpha[:, None])
    return tl.dot_scaled(lo.to(tl.float8e4nv), p_lo_e8, "e4m3", v, ones_v, "e4m3", acc=acc)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _fast_kernel(
    q_ptr, q_stride_t, q_stride_h,
    kv_ptr, page_stride, row_stride, page_magic, page_shift, page_size, num_slots,
    idx_ptr, idx_stride_t, topk,
    topk_len_ptr, topk_len_stride, has_topk_len,
    sink_ptr, sink_stride, has_sink,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h, write_lse, lse_scale,
    num_heads, qk_scale_log2, blocks_per_split,
    ROPE: tl.constexpr, ROPE_OFF: tl.constexpr,
    FINAL: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token, head block, split) program over a uint8 fp8 cache (offsets in bytes; pages found
    by :func:`~mla_sm120_plugin.kernels.dsa.triton.page_divisor`'s multiply-shift). ``ROPE`` (64, or 0
    for a rope-less layout) and ``ROPE_OFF`` (the rope's byte offset) come from the layout.

    FINAL: write the output (one split) or normalized partials and their base-2 LSE.
    """
    kv_lat = kv_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    kv_f32 = kv_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    kv_rope = kv_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tok = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, _TILE)
    q_row = tok * q_stride_t
    idx_row = tok * idx_stride_t

    length = topk
    if has_topk_len:
        length = tl.minimum(tl.load(topk_len_ptr + tok * topk_len_stride), topk)

    # q is split once; Triton keeps the eight e4m3 tiles in shared memory across the loop.
    q0, qe0, r0, re0 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col, BLOCK_H)
    q1, qe1, r1, re1 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + _TILE, BLOCK_H)
    q2, qe2, r2, re2 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + 2 * _TILE, BLOCK_H)
    q3, qe3, r3, re3 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + 3 * _TILE, BLOCK_H)
    if ROPE > 0:
        rope_col = tl.arange(0, ROPE)
        q_rope = tl.load(q_ptr + q_row + heads[:, None].to(tl.int64) * q_stride_h + (rope_col + _NOPE)[None, :],
                         mask=h_mask[:, None], other=0.0)
    ones_k = tl.full([BLOCK_K, _TILE // _MX_BLOCK], _E8M0_ONE, tl.uint8)
    ones_v = tl.full([_TILE, BLOCK_K // _MX_BLOCK], _E8M0_ONE, tl.uint8)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, _TILE], tl.float32)

    pos = split * (blocks_per_split * BLOCK_K) + tl.arange(0, BLOCK_K)
    next_slot = _slot_ids(idx_ptr, idx_row, pos, length)
    for _ in range(blocks_per_split):
        slot = next_slot
        # Positions past topk_length were loaded as -1, so the slot alone says what is valid.
        valid = (slot >= 0) & (slot < num_slots)
        row_off = _row_offset(tl.where(valid, slot, 0), page_magic, page_shift, page_size, page_stride, row_stride)
        pos += BLOCK_K
        next_slot = _slot_ids(idx_ptr, idx_row, pos, length)  # one step ahead, by hand

        sc_ptr = kv_f32 + (row_off + _SCALE_OFF) // 4
        sc0 = tl.load(sc_ptr, mask=valid, other=0.0)
        sc1 = tl.load(sc_ptr + 1, mask=valid, other=0.0)
        sc2 = tl.load(sc_ptr + 2, mask=valid, other=0.0)
        sc3 = tl.load(sc_ptr + 3, mask=valid, other=0.0)
        s = _tile_scores(q0, qe0, r0, re0, kv_lat, row_off, valid, col, sc0, ones_k)
        s += _tile_scores(q1, qe1, r1, re1, kv_lat, row_off, valid, col + _TILE, sc1, ones_k)
        s += _tile_scores(q2, qe2, r2, re2, kv_lat, row_off, valid, col + 2 * _TILE, sc2, ones_k)
        s += _tile_scores(q3, qe3, r3, re3, kv_lat, row_off, valid, col + 3 * _TILE, sc3, ones_k)
        if ROPE > 0:
            rope = tl.load(kv_rope + ((row_off + ROPE_OFF) // 2)[:, None] + rope_col[None, :],
                           mask=valid[:, None], other=0.0)
            s += _dot(q_rope, tl.trans(rope), DOT_BF16)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_K], base 2

        m_step = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, m_step)
        # A row with nothing valid yet keeps m = -inf; subtracting 0 instead keeps exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        p_bound = tl.math.exp2(m_step - m_safe)  # >= every p of the row this step
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        p_exp = _p_exponent(p_bound, sc0, sc1, sc2, sc3)
        p_inv = _inverse_pow2(p_exp)
        p_e8 = tl.broadcast_to(p_exp[:, None], [BLOCK_H, BLOCK_K // _MX_BLOCK]).to(tl.uint8)
        p_lo_e8 = tl.broadcast_to((p_exp - _P_LO_SHIFT)[:, None], [BLOCK_H, BLOCK_K // _MX_BLOCK]).to(tl.uint8)
        acc0 = _tile_values(acc0, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col, sc0, ones_v)
        acc1 = _tile_values(acc1, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + _TILE, sc1, ones_v)
        acc2 = _tile_values(acc2, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + 2 * _TILE, sc2, ones_v)
        acc3 = _tile_values(acc3, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + 3 * _TILE, sc3, ones_v)

    has_any = l_i > 0.0
    inv_l = tl.where(has_any, 1.0 / tl.where(has_any, l_i, 1.0), 0.0)[:, None]
    lse2 = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    if FINAL:
        _finalize(
            out_ptr, tok * out_stride_t, out_stride_h, lse_ptr, tok * lse_stride_t, lse_stride_h,
            sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
            heads, h_mask, lse2, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l,
        )
    else:
        _finalize(
            out_ptr, tok * out_stride_t + split * out_stride_s, out_stride_h,
            lse_ptr, tok * lse_stride_t + split * lse_stride_s, lse_stride_h,
            sink_ptr, sink_stride, 0, 1, 1.0,
            heads, h_mask, lse2, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l,
        )


def triton_sparse_mla_fast(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    kv_layout: str,
    topk_length: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_base: str = "e",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with fp8 MMAs on an fp8 cache's bytes (module docstring: numerics and layouts).

    Arguments, shapes, dtypes and return values: exactly those of
    :func:`mla_sm120_plugin.kernels.dsa.triton.triton_sparse_mla` (a bf16 cache is handed to it).
    Within :data:`ACCURACY` of float64 attention over the dequantized rows (exact class).
    """
    return _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=None)


def launch_plan(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, lse, lse_base,
                cfg: plan.LaunchConfig, interpret: bool) -> list[exact.Launch]:
    """The launches that compute ``out`` (and ``lse`` when given) over an fp8 cache.

    One launch when ``cfg.num_splits == 1``; otherwise the split kernel into fresh
    ``cfg.partial_dtype`` partials, then the exact kernel's combine into ``out``.
    """
    num_tokens, num_heads, _ = q.shape
    if not interpret and q.dtype != torch.bfloat16:
        # As in the exact kernel: q is quantized in-kernel anyway, and one q dtype halves the
        # compiled variants; out keeps the caller's dtype.
        q = q.to(torch.bfloat16)
    rope = exact.layout_constexprs(kv_layout)
    if not rope["IS_FP8"]:
        raise ValueError(f"the fast kernel reads the fp8 layouts {layout.FP8_LAYOUTS}; {kv_layout!r} goes to the "
                         "exact kernel (triton_sparse_mla_fast hands it over)")
    page_size, page_stride, row_stride = exact._cache_geometry(kv_cache)
    has_len, has_sink = topk_length is not None, sink is not None
    lse_scale = 1.0 if lse_base == "2" else math.log(2.0)
    final = cfg.num_splits == 1
    if final:
        dest, dest_strides = out, (out.stride(0), 0, out.stride(1))
        dest_lse, dest_lse_strides = (lse, (lse.stride(0), 0, lse.stride(1))) if lse is not None else (out, (0, 0, 0))
    else:
        dest = torch.empty(num_tokens, cfg.num_splits, num_heads, layout.KV_LORA_RANK,
                           dtype=exact.partial_dtype(cfg), device=q.device)  # [T, S, H, 512]
        dest_lse = torch.empty(num_tokens, cfg.num_splits, num_heads, dtype=torch.float32, device=q.device)  # [T, S, H]
        dest_strides, dest_lse_strides = dest.stride()[:3], dest_lse.stride()
    main = exact.Launch(
        kernel=_fast_kernel,
        grid=(num_tokens, -(-num_heads // cfg.block_h), cfg.num_splits),
        args=(
            q, q.stride(0), q.stride(1),
            kv_cache, page_stride, row_stride, *exact.page_divisor(page_size), page_size, exact.num_slots(kv_cache),
            indices, indices.stride(0), indices.shape[1],
            topk_length if has_len else indices, topk_length.stride(0) if has_len else 0, int(has_len),
            sink if has_sink else dest, sink.stride(0) if has_sink else 0, int(final and has_sink),
            dest, *dest_strides,
            dest_lse, *dest_lse_strides, int(not final or lse is not None), lse_scale if final else 1.0,
            num_heads, float(sm_scale) * exact._LOG2E, cfg.blocks_per_split,
        ),
        constexprs=dict(ROPE=rope["ROPE"], ROPE_OFF=rope["ROPE_OFF"], FINAL=final, DOT_BF16=not interpret,
                        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
        describe=dict(kernel="sparse_mla_fast", q=exact._DTYPE_NAMES[q.dtype], cache=kv_layout,
                      out=exact._DTYPE_NAMES[dest.dtype], final=int(final), block_h=cfg.block_h,
                      block_k=cfg.block_k, warps=cfg.num_warps, stages=cfg.num_stages,
                      **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg})),
    )
    if final:
        return [main]
    return [main, exact.combine_launch(dest, dest_lse, sink=sink, out=out, lse=lse, lse_scale=lse_scale)]


def _run(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, return_lse, lse_base,
         config: plan.LaunchConfig | None):
    """:func:`triton_sparse_mla_fast` with an optional forced :class:`~.triton_plan.LaunchConfig`;
    a bf16 cache (``bf16``, ``bf16_nope``) goes to the exact kernel."""
    if not layout.get(kv_layout).fp8:
        return exact._run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                          sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=config)
    return exact.run_plan(launch_plan, plan.FAST, q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                          topk_length=topk_length, sink=sink, out=out, return_lse=return_lse, lse_base=lse_base,
                          config=config)
