"""Fast Triton sparse-MLA kernel for the fp8 caches: fp8 MMAs on the cache's own e4m3 bytes.

Contract: :func:`mla_sm120_plugin.kernels.dsa.triton.triton_sparse_mla`'s (``sparse_mla_forward``
states every argument); only the numerics differ, within :data:`ACCURACY` (exact class). It reads
every fp8 layout of :mod:`.layout` (``fp8_ds_mla``, and GLM-5.3-Flash's rope-less ``fp8_ds_mla_nope``
and ``fp8_nope``); a bf16 cache is handed to the exact kernel's entry.

Numerics: q and the probabilities are each carried as an e4m3 pair, ``hi`` (rounded under a
power-of-two scale) plus ``lo`` (the residual, rounded under its own), so the pair keeps about 8
significant bits; every latent dot is two block-scaled fp8 MMAs (``tl.dot_scaled``: the full-rate
``QMMA.SF`` on SM120) on the stored key and value bytes, the power-of-two scales riding in the
MMA's e8m0 block scales and the cache's fp32 tile scales applied to the fp32 partial scores and
to p. The rope dot stays bf16. The kernel rounds every value it quantizes itself
(:func:`_round_e4m3`), so the interpreter runs the GPU's numerics. Structure, slot prefetch, the
epilogue and the combine are the exact kernel's, from :mod:`.triton_parts`.

Design notes, what was tried and the measurements: docs/kernels.md, section ``kernels/dsa/triton_fast.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.dsa.triton_parts import (
    FP8_SCALE_OFF,
    NOPE,
    TILE,
    UNSPECIALIZED_MAIN,
    epilogue,
    kv_tile,
    launches,
    layout_constexprs,
    q_tile,
    run_plan,
    slot_ids,
    walk_step,
)
from mla_sm120_plugin.kernels.shared.triton import dot, e8m0_value

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

# e4m3 and e8m0 facts the kernel computes with (the layout's structure, NOPE / TILE /
# FP8_SCALE_OFF, is triton_parts', checked per call by its layout_constexprs).
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
def _e4m3_part(x, BLOCK_H: tl.constexpr):
    """``x`` ([BLOCK_H, 128] fp32) as e4m3 under a per-head power of two that brings its largest
    value within e4m3's range: the e4m3 values, the rounded part in fp32, and the e8m0 block scales
    ([BLOCK_H, 4] uint8). No scale code is 0 (the interpreter decodes an e8m0 byte 0 as 0, a GPU as
    2**-127)."""
    e = tl.maximum(_pow2_ceil_exponent(tl.maximum(tl.max(tl.abs(x), axis=1) * _INV_E4M3_MAX, _MIN_NORMAL)), 1)
    part = _round_e4m3(x * _inverse_pow2(e)[:, None])
    return (part.to(tl.float8e4nv), part * e8m0_value(e)[:, None],
            tl.broadcast_to(e[:, None], [BLOCK_H, TILE // _MX_BLOCK]).to(tl.uint8))


@triton.jit
def _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, cols, BLOCK_H: tl.constexpr):
    """One 128-wide q tile as an e4m3 pair, once before the loop: ``hi`` (q rounded) and ``lo``
    (the residual ``q - hi``, exact in fp32 since q is bf16, rounded under its own scale), each
    [BLOCK_H, 128] e4m3 with its e8m0 block scales ([BLOCK_H, 4] uint8); a padded head is zeros.
    Each part keeps 4 significant bits of what it holds: together about 8, bf16's precision."""
    q = q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, cols).to(tl.float32)
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
    k_t = kv_tile(kv_lat, row_off, valid, cols, True)
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
    v = kv_tile(kv_lat, row_off, valid, cols, False)
    acc = tl.dot_scaled(hi.to(tl.float8e4nv), p_e8, "e4m3", v, ones_v, "e4m3", acc=acc * alpha[:, None])
    return tl.dot_scaled(lo.to(tl.float8e4nv), p_lo_e8, "e4m3", v, ones_v, "e4m3", acc=acc)


@triton.jit(do_not_specialize=UNSPECIALIZED_MAIN)
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
    by :func:`..shared.host.page_divisor`'s multiply-shift; the row stride is the cache tensor's).

    Constexprs: ``ROPE`` (64, or 0 for a rope-less layout: no rope dot, no q rope tile) and
    ``ROPE_OFF`` (the rope's byte offset), from the layout; ``FINAL`` (write the output, one split,
    or a split's normalized partial and base-2 LSE); ``DOT_BF16`` (the rope dot's, False under the
    interpreter); ``BLOCK_H`` and ``BLOCK_K``. ``topk_length`` acts only through the slot-id load.
    """
    kv_lat = kv_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    kv_f32 = kv_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    kv_rope = kv_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tok = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, TILE)
    q_row = tok * q_stride_t
    idx_row = tok * idx_stride_t

    length = topk
    if has_topk_len:
        length = tl.minimum(tl.load(topk_len_ptr + tok * topk_len_stride), topk)

    # q is split once; Triton keeps the eight e4m3 tiles in shared memory across the loop.
    q0, qe0, r0, re0 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col, BLOCK_H)
    q1, qe1, r1, re1 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + TILE, BLOCK_H)
    q2, qe2, r2, re2 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + 2 * TILE, BLOCK_H)
    q3, qe3, r3, re3 = _split_q(q_ptr, q_row, heads, h_mask, q_stride_h, col + 3 * TILE, BLOCK_H)
    if ROPE > 0:
        rope_col = tl.arange(0, ROPE)
        q_rope = q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, rope_col + NOPE)
    ones_k = tl.full([BLOCK_K, TILE // _MX_BLOCK], _E8M0_ONE, tl.uint8)
    ones_v = tl.full([TILE, BLOCK_K // _MX_BLOCK], _E8M0_ONE, tl.uint8)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, TILE], tl.float32)

    pos = split * (blocks_per_split * BLOCK_K) + tl.arange(0, BLOCK_K)
    next_slot = slot_ids(idx_ptr, idx_row, pos, length)
    for _ in range(blocks_per_split):
        valid, row_off, pos, next_slot = walk_step(next_slot, pos, length, idx_ptr, tok, idx_stride_t, num_slots,
                                                   page_magic, page_shift, page_size, page_stride, row_stride, BLOCK_K)

        sc_ptr = kv_f32 + (row_off + FP8_SCALE_OFF) // 4
        sc0 = tl.load(sc_ptr, mask=valid, other=0.0)
        sc1 = tl.load(sc_ptr + 1, mask=valid, other=0.0)
        sc2 = tl.load(sc_ptr + 2, mask=valid, other=0.0)
        sc3 = tl.load(sc_ptr + 3, mask=valid, other=0.0)
        s = _tile_scores(q0, qe0, r0, re0, kv_lat, row_off, valid, col, sc0, ones_k)
        s += _tile_scores(q1, qe1, r1, re1, kv_lat, row_off, valid, col + TILE, sc1, ones_k)
        s += _tile_scores(q2, qe2, r2, re2, kv_lat, row_off, valid, col + 2 * TILE, sc2, ones_k)
        s += _tile_scores(q3, qe3, r3, re3, kv_lat, row_off, valid, col + 3 * TILE, sc3, ones_k)
        if ROPE > 0:
            rope = kv_tile(kv_rope, (row_off + ROPE_OFF) // 2, valid, rope_col, False)
            s += dot(q_rope, tl.trans(rope), DOT_BF16)
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
        acc1 = _tile_values(acc1, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + TILE, sc1, ones_v)
        acc2 = _tile_values(acc2, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + 2 * TILE, sc2, ones_v)
        acc3 = _tile_values(acc3, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, col + 3 * TILE, sc3, ones_v)

    epilogue(out_ptr, out_stride_t, out_stride_s, out_stride_h, lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h,
             sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
             tok, split, heads, h_mask, m_i, l_i, acc0, acc1, acc2, acc3, FINAL)


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
    lse_with_sink: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with fp8 MMAs on an fp8 cache's bytes (module docstring: numerics and layouts).

    Arguments, shapes, dtypes and return values: exactly those of
    :func:`mla_sm120_plugin.kernels.dsa.triton.triton_sparse_mla` (a bf16 cache is handed to it).
    Within :data:`ACCURACY` of float64 attention over the dequantized rows (exact class).
    """
    return _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=None, lse_with_sink=lse_with_sink)


def launch_plan(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, lse, lse_base,
                cfg: plan.LaunchConfig, interpret: bool, lse_with_sink: bool = False) -> list:
    """The launches that compute ``out`` (and ``lse`` when given) over an fp8 cache
    (:func:`.triton_parts.launches`: one launch when ``cfg.num_splits == 1``; otherwise the split
    kernel into fresh ``cfg.partial_dtype`` partials, then the shared combine into ``out``).

    :raises ValueError: a layout that is not fp8 (a bf16 cache goes to the exact kernel).
    """
    constexprs = layout_constexprs(kv_layout)
    if not constexprs["IS_FP8"]:
        raise ValueError(f"the fast kernel reads the fp8 layouts {layout.FP8_LAYOUTS}; {kv_layout!r} goes to the "
                         "exact kernel (triton_sparse_mla_fast hands it over)")
    return launches(_fast_kernel, "sparse_mla_fast", dict(ROPE=constexprs["ROPE"], ROPE_OFF=constexprs["ROPE_OFF"]),
                    q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length, sink=sink,
                    out=out, lse=lse, lse_base=lse_base, cfg=cfg, interpret=interpret, lse_with_sink=lse_with_sink)


def _run(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, return_lse, lse_base,
         config: plan.LaunchConfig | None, lse_with_sink: bool = False):
    """:func:`triton_sparse_mla_fast` with an optional forced :class:`~.plan.LaunchConfig`;
    a bf16 cache (``bf16``, ``bf16_nope``) goes to the exact kernel."""
    if not layout.get(kv_layout).fp8:
        # The one use of the exact kernel's module: a bf16 cache is its job, not this kernel's.
        from mla_sm120_plugin.kernels.dsa import triton as exact

        return exact._run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                          sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=config,
                          lse_with_sink=lse_with_sink)
    return run_plan(launch_plan, plan.FAST, q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                    topk_length=topk_length, sink=sink, out=out, return_lse=return_lse, lse_base=lse_base,
                    config=config, lse_with_sink=lse_with_sink)
