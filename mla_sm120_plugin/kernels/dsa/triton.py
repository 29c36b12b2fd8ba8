"""Portable (exact) Triton sparse-MLA kernel: reads every cache layout of :mod:`.layout` (fp8 rows
with or without a rope part, 656 or 528 bytes; bf16 rows of 576 or 512) directly, dequantizes
in-kernel. Its fp8-MMA sibling, :mod:`.triton_fast`, shares the launch machinery below.

Same semantics as :func:`mla_sm120_plugin.kernels.dsa.reference.torch_sparse_mla` (FACTS.md section 4).

Structure. One program handles one query token, a block of ``BLOCK_H`` heads and one range of
top-k candidates (a *split*). It walks its range ``BLOCK_K`` candidates at a time with an online
softmax in fp32 (scores pre-multiplied by ``log2(e)`` so it can use ``exp2``). Every candidate a
program loads serves all heads of its block.

* Prefill (many tokens): one split, so the program writes the final output directly.
* Decode (few tokens): top-k is cut into splits so that enough programs exist to fill the GPU; each
  writes a normalized fp32 partial output and its base-2 LSE, and :func:`_combine_kernel` merges them.
  The split count comes from the configuration table in :mod:`.triton_plan` (its rule and the
  traffic model it is chosen by are there).

Latency. Each step loads the next step's slot ids by hand, so the row gathers of a step depend only
on the previous iteration and Triton's pipeliner issues them as asynchronous copies a step ahead
(it cannot pipeline a gather whose indices load in the same iteration: triton#4721). A slot's page
comes from a host-computed multiply-shift (:func:`page_divisor`), not a runtime division.

Registers. The 576-wide head is never held whole: the scores are summed over the four 128-wide
latent tiles plus the 64-wide rope tile (none for a rope-less layout), and the output is four
``[BLOCK_H, 128]`` fp32 accumulators. q is *not* kept in registers across the loop: a 16-row slab
of a 576-wide bf16 q is 144 registers per thread in every warp that multiplies with it, which is
what made the first version spill. Each step reloads its q tile (from L1; the cache bytes dominate the traffic), and
the value tiles are loaded apart from the (transposed) key tiles (the same bytes, an L2 hit)
instead of keeping a ``BLOCK_K`` x 512 key block live through the softmax.

Numerics. Dot operands are bfloat16 on a GPU (fp8 keys and bf16 rope/cache/q convert exactly;
the probabilities round to 8 bits) with fp32 accumulation; each 128-wide tile's fp8 scale is
applied to the fp32 scores and to the probabilities, never folded into a rounded key. An fp32 q
is converted to bfloat16 before the launch (the dot would round it anyway); out keeps q's dtype.

CPU. Under ``TRITON_INTERPRET=1`` the kernel runs on numpy. Loads, stores and casts of bfloat16
work there, but a ``tl.dot`` on bfloat16 operands does not (it multiplies raw bits), so the
interpreter path (``DOT_BF16=False``) widens the operands to fp32 instead; and the interpreter's
fp32 -> bfloat16 cast truncates where a GPU rounds to nearest even (one bf16 ulp at most).

Layouts. What a kernel needs of a layout is data (:func:`layout_constexprs`): whether the latent
is fp8 (``IS_FP8``), the rope width (``ROPE``: 64, or 0 for GLM-5.3-Flash's rope-less rows, which
drops the rope tile from the code) and where the rope starts (``ROPE_OFF``); the row stride is the
cache tensor's own (656- and 528-byte fp8 rows, and any page-strided view, run the same code), and
reserved bytes (``fp8_ds_mla_nope``'s [528, 656)) are never loaded.

Variants. The constexpr parameters are the layout's (``IS_FP8``, ``ROPE``, ``ROPE_OFF``),
final/split, ``BLOCK_H``, ``BLOCK_K`` and ``DOT_BF16``; the output's dtype is its pointer type (q
is bf16 on a GPU). Whether ``topk_length``, ``sink`` and the LSE are used is decided by runtime scalars (never specialized), so they do not
multiply the compiled variants. :mod:`mla_sm120_plugin.tools.compile_gate` compiles every variant
:func:`launch_config` can pick, for sm_120a, sm_121a and sm_90a, without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import triton_plan as plan

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_LOG2E_K: tl.constexpr = tl.constexpr(_LOG2E)  # the same constant, visible inside kernels

# What the kernels' structure assumes of every layout (checked per call by layout_constexprs):
# a 512-wide latent in four 128-wide tiles (four accumulators), and fp8 tile scales right after it.
_NOPE: tl.constexpr = tl.constexpr(layout.KV_LORA_RANK)
_TILE: tl.constexpr = tl.constexpr(layout.FP8_TILE)
_SCALE_OFF: tl.constexpr = tl.constexpr(layout.FP8_SCALE_OFFSET)

# Arguments Triton must not specialize on (it compiles a separate variant for every int equal to 1
# or divisible by 16): the runtime flags and their strides, and sizes that are only compared,
# never used to align an address (a flat cache's page_size and a one-step split are 1).
_UNSPECIALIZED_MAIN = ("topk_len_stride", "has_topk_len", "sink_stride", "has_sink", "write_lse",
                       "page_magic", "page_shift", "page_size", "num_slots", "topk", "num_heads",
                       "blocks_per_split")
_UNSPECIALIZED_COMBINE = ("sink_stride", "has_sink", "write_lse", "num_heads", "num_splits")


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a jit-callable: ~5 us a call on the host, in a path that runs every forward.
    return -(-a // b)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# One block shape for every head count, chosen from the compile gate's numbers (Triton 3.8,
# sm_120a, fp8_ds_mla): 16 heads x 32 candidates in 8 warps uses 134 registers and 57 KB of shared
# memory (the double-buffered row gathers), no spills, one CTA per SM; 4 warps, 64 candidates or
# 32 heads a block all spill, even with 16 warps. More than 16 heads means several head blocks reading the same candidates (the repeat
# comes from L2, and from 64 heads per rank on the call is compute bound). The split count comes
# from the configuration table in :mod:`.triton_plan` (its rule and traffic model are there).
BLOCK_H = plan.EXACT.block_h
BLOCK_K = plan.EXACT.block_k
NUM_WARPS = plan.EXACT.num_warps
NUM_STAGES = plan.EXACT.num_stages
MAX_SPLITS = plan.MAX_SPLITS
LaunchConfig = plan.LaunchConfig


def launch_config(num_tokens: int, num_heads: int, topk: int, family: str = plan.DEFAULT_FAMILY) -> LaunchConfig:
    """The exact kernel's config for one call, from :func:`.triton_plan.launch_config`'s table
    (deterministic: no autotuning at serve time). Few tokens get several splits, many get one."""
    return plan.launch_config(plan.EXACT.name, num_tokens, num_heads, topk, family)


def layout_constexprs(kv_layout: str) -> dict:
    """The constexpr arguments a kernel takes from the layout ``kv_layout`` (its data, never a
    per-layout branch): ``IS_FP8`` (fp8 latent, fp32 tile scales, bf16 rope), ``IS_FP4`` (e2m1 latent,
    e4m3 block scales at ``SCALE_OFF``, e4m3 rope), ``ROPE`` (rope width, 0 for a rope-less layout)
    and ``ROPE_OFF`` (where the rope starts: a byte offset in uint8 rows, an element offset in bf16
    rows). Only the exact kernel takes ``IS_FP4`` and ``SCALE_OFF``.

    :raises ValueError: a layout the kernels' structure cannot read (a latent other than four
        128-wide tiles with fp8 scales right after it or nvfp4 scales in 16-value blocks, or a rope
        width that is not a power of two).
    """
    lay = layout.get(kv_layout)
    if (lay.latent != layout.KV_LORA_RANK or (lay.fp8 and lay.scale_offset != layout.FP8_SCALE_OFFSET)
            or (lay.nvfp4 and lay.num_scales != layout.KV_LORA_RANK // layout.NVFP4_BLOCK)
            or (lay.rope and lay.rope & (lay.rope - 1))):
        raise ValueError(f"the Triton kernels read a {layout.KV_LORA_RANK}-wide latent in {layout.FP8_TILE}-wide tiles, "
                         f"fp8 scales at byte {layout.FP8_SCALE_OFFSET} or nvfp4 scales per {layout.NVFP4_BLOCK} values, "
                         f"and a power-of-two rope; {lay} is not that")
    return dict(IS_FP8=lay.fp8, IS_FP4=lay.nvfp4, ROPE=lay.rope, ROPE_OFF=lay.rope_offset if lay.rope else 0,
                SCALE_OFF=lay.scale_offset if lay.nvfp4 else 0)


def launch_variants() -> list[LaunchConfig]:
    """One config per compiled shape :func:`launch_config` can pick: the final and the split path.

    ``num_splits`` and ``blocks_per_split`` are runtime values (not specialized), so these two
    stand for every config it returns.
    """
    return [plan.EXACT.config(splits, 2) for splits in (1, 2)]


@triton.jit
def _round_bf16(x):
    """``x`` (fp32) rounded to the nearest bfloat16, ties to even, as fp32 (finite inputs; an
    overflow rounds to inf as a cast would). A GPU's fp32 -> bf16 cast rounds so, the interpreter's
    truncates (up to one bf16 ulp, ~0.2 % of the output's RMS): rounding here first makes the cast
    exact on both, so the CPU tests measure the numerics a GPU has."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    """fp32-accumulated a @ b with bf16 operands: on a GPU the operands are cast (round to nearest
    even) and multiplied by the tensor cores; under the interpreter, whose bf16 dot multiplies raw
    bits, they are rounded the same way (:func:`_round_bf16`) and multiplied in fp32, so the CPU
    runs the GPU's numerics (bf16 x bf16 products are exact in fp32)."""
    if DOT_BF16:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        c = tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), out_dtype=tl.float32)
    return c


@triton.jit
def _q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, cols):
    """q[tok, heads, cols] ([BLOCK_H, width], q's dtype); padded heads read as 0."""
    return tl.load(q_ptr + q_row + heads[:, None].to(tl.int64) * q_stride_h + cols[None, :],
                   mask=h_mask[:, None], other=0.0)


@triton.jit
def _kv_tile(kv_ptr, row_off, valid, cols):
    """Cache elements ``cols`` of each candidate: [BLOCK_K, width] in the cache's dtype, 0 when invalid."""
    return tl.load(kv_ptr + row_off[:, None] + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _kv_tile_t(kv_ptr, row_off, valid, cols):
    """The same elements transposed: [width, BLOCK_K], candidates along the columns."""
    return tl.load(kv_ptr + row_off[None, :] + cols[:, None], mask=valid[None, :], other=0.0)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32 0..15) as fp32, by their bit fields: sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent 0 is 0 or 0.5. Exact, no table."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_tile(kv_u8, kv_e4m3, row_off, valid, cols, SCALE_OFF: tl.constexpr, TRANS: tl.constexpr):
    """Latent elements ``cols`` of each candidate of an nvfp4 row, dequantized (e2m1 x its 16-value
    block's e4m3 scale, exact in fp32 and in bf16): [BLOCK_K, width] fp32, or [width, BLOCK_K] with
    ``TRANS``; 0 when invalid. Element c is nibble c % 2 of byte c // 2; block b's scale is byte
    ``SCALE_OFF + 8 * (b % 4) + b // 4``."""
    blk = cols // 16
    if TRANS:
        byte = tl.load(kv_u8 + row_off[None, :] + (cols // 2)[:, None], mask=valid[None, :], other=0)
        shift = ((cols % 2) * 4)[:, None]
        sf = tl.load(kv_e4m3 + row_off[None, :] + (SCALE_OFF + 8 * (blk % 4) + blk // 4)[:, None],
                     mask=valid[None, :], other=0.0)
    else:
        byte = tl.load(kv_u8 + row_off[:, None] + (cols // 2)[None, :], mask=valid[:, None], other=0)
        shift = ((cols % 2) * 4)[None, :]
        sf = tl.load(kv_e4m3 + row_off[:, None] + (SCALE_OFF + 8 * (blk % 4) + blk // 4)[None, :],
                     mask=valid[:, None], other=0.0)
    return _e2m1((byte.to(tl.int32) >> shift) & 0xF) * sf.to(tl.float32)


@triton.jit
def _lat_tile(kv_lat, kv_e4m3, row_off, valid, cols, IS_FP4: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Value tile: latent elements ``cols`` of each candidate, [BLOCK_K, width] (cache dtype, or fp32 for nvfp4)."""
    if IS_FP4:
        t = _fp4_tile(kv_lat, kv_e4m3, row_off, valid, cols, SCALE_OFF, False)
    else:
        t = _kv_tile(kv_lat, row_off, valid, cols)
    return t


@triton.jit
def _lat_tile_t(kv_lat, kv_e4m3, row_off, valid, cols, IS_FP4: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Key tile: the same elements transposed, [width, BLOCK_K]."""
    if IS_FP4:
        t = _fp4_tile(kv_lat, kv_e4m3, row_off, valid, cols, SCALE_OFF, True)
    else:
        t = _kv_tile_t(kv_lat, row_off, valid, cols)
    return t


@triton.jit
def _slot_ids(idx_ptr, idx_row, pos, length):
    """A step's raw slot ids ([BLOCK_K] int32); -1 at positions past ``length``."""
    return tl.load(idx_ptr + idx_row + pos, mask=pos < length, other=-1)


@triton.jit
def _row_offset(slot, page_magic, page_shift, page_size, page_stride, row_stride):
    """Cache offset of each (valid, >= 0) slot's row: page by a multiply-shift (the host computes
    the magic number, :func:`page_divisor`), where a runtime integer division costs registers
    enough to spill; int64 offsets for caches over 2 GiB."""
    page = (slot.to(tl.int64) * page_magic) >> page_shift
    return page * page_stride + (slot.to(tl.int64) - page * page_size) * row_stride


@triton.jit
def _tile_scales(kv_f32_ptr, row_off, valid, IS_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 scales of the four latent tiles for each candidate (four [BLOCK_K]); 1 for bf16 caches.

    One 16-byte gather a row ([BLOCK_K, 4]) split into columns, not four 4-byte gathers: fewer
    loads, and fewer live addresses (the rope-less variant spilled 20 bytes on sm_120a with four).
    """
    if IS_FP8:
        sc = tl.load(kv_f32_ptr + ((row_off + _SCALE_OFF) // 4)[:, None] + tl.arange(0, 4)[None, :],
                     mask=valid[:, None], other=0.0)  # [BLOCK_K, 4]
        even, odd = tl.split(tl.reshape(sc, [BLOCK_K, 2, 2]))  # tiles (0, 2) and (1, 3)
        sc0, sc2 = tl.split(even)
        sc1, sc3 = tl.split(odd)
    else:
        sc0 = tl.where(valid, 1.0, 0.0)
        sc1 = sc0
        sc2 = sc0
        sc3 = sc0
    return sc0, sc1, sc2, sc3


@triton.jit
def _store_rounded(ptrs, x, mask):
    """Store fp32 ``x`` in the pointer's dtype, a bfloat16 destination rounded to nearest even."""
    out_ty = ptrs.dtype.element_ty
    if out_ty == tl.bfloat16:
        x = _round_bf16(x)
    tl.store(ptrs, x.to(out_ty), mask=mask)


@triton.jit
def _finalize(
    out_ptr, out_row, out_stride_h, lse_ptr, lse_row, lse_stride_h,
    sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
    heads, h_mask, lse2, acc0, acc1, acc2, acc3,
):
    """Apply the sink, store the normalized output tiles (in out's dtype) and the LSE.

    ``acc*`` are already normalized (0 for a row with no valid candidate); ``lse2`` is base 2 and
    is stored times ``lse_scale`` (1 for base 2, ln 2 for natural log).
    """
    if has_sink:
        sink = tl.load(sink_ptr + heads * sink_stride, mask=h_mask, other=0.0)
        # 1 / (1 + exp(sink - lse)) in base 2; lse2 = -inf gives exp2(inf) = inf and a factor 0.
        factor = (1.0 / (1.0 + tl.math.exp2(sink * _LOG2E_K - lse2)))[:, None]
        acc0 = acc0 * factor
        acc1 = acc1 * factor
        acc2 = acc2 * factor
        acc3 = acc3 * factor
    col = tl.arange(0, _TILE)
    ptrs = out_ptr + out_row + heads[:, None].to(tl.int64) * out_stride_h + col[None, :]
    mask = h_mask[:, None]
    _store_rounded(ptrs, acc0, mask)
    _store_rounded(ptrs + _TILE, acc1, mask)
    _store_rounded(ptrs + 2 * _TILE, acc2, mask)
    _store_rounded(ptrs + 3 * _TILE, acc3, mask)
    if write_lse:
        tl.store(lse_ptr + lse_row + heads * lse_stride_h, lse2 * lse_scale, mask=h_mask)


@triton.jit(do_not_specialize=_UNSPECIALIZED_MAIN)
def _sparse_mla_kernel(
    q_ptr, q_stride_t, q_stride_h,
    kv_ptr, page_stride, row_stride, page_magic, page_shift, page_size, num_slots,
    idx_ptr, idx_stride_t, topk,
    topk_len_ptr, topk_len_stride, has_topk_len,
    sink_ptr, sink_stride, has_sink,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h, write_lse, lse_scale,
    num_heads, qk_scale_log2, blocks_per_split,
    IS_FP8: tl.constexpr, IS_FP4: tl.constexpr, ROPE: tl.constexpr, ROPE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, FINAL: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token, head block, split) program. FINAL: write the output (one split) or partials.

    Cache offsets (``page_stride``, ``row_stride``, the per-candidate ``row_off``) are in elements
    of ``kv_ptr``: bytes of a uint8 fp8 cache, read through three typed views of the same pointer
    (fp8 latent, fp32 scales, bf16 rope), or elements of a bfloat16 cache. ``ROPE`` (0 or the rope
    width) and ``ROPE_OFF`` come from the layout (:func:`layout_constexprs`); with ``ROPE == 0`` the
    scores are the latent tiles' alone and no rope byte is loaded. A slot's page is
    ``slot * page_magic >> page_shift`` (:func:`page_divisor`).

    Each step loads the next step's slot ids, so every row address of a step is known one
    iteration ahead and Triton's pipeliner turns the row gathers into asynchronous copies issued a
    step early; the key tiles of the scores are loaded already transposed ([width, BLOCK_K]), the
    form it accepts for an fp8 tile that is widened before the dot.
    """
    if IS_FP8:
        kv_lat = kv_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
        kv_f32 = kv_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        kv_rope = kv_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    elif IS_FP4:
        kv_lat = kv_ptr  # uint8: two e2m1 nibbles a byte
        kv_f32 = kv_ptr  # never read: the block scales are e4m3, read with the latent
        kv_rope = kv_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)  # the rope and the scales
    else:
        kv_lat = kv_ptr
        kv_f32 = kv_ptr  # never read: bf16 caches have no scales
        kv_rope = kv_ptr
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, _TILE)
    q_row = tok * q_stride_t

    length = topk
    if has_topk_len:
        length = tl.minimum(tl.load(topk_len_ptr + tok * topk_len_stride), topk)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, _TILE], tl.float32)

    pos = split * (blocks_per_split * BLOCK_K) + tl.arange(0, BLOCK_K)
    next_slot = _slot_ids(idx_ptr, tok * idx_stride_t, pos, length)
    for _ in range(blocks_per_split):
        slot = next_slot
        # Positions past topk_length were loaded as -1, so the slot alone says what is valid.
        valid = (slot >= 0) & (slot < num_slots)
        row_off = _row_offset(tl.where(valid, slot, 0), page_magic, page_shift, page_size, page_stride, row_stride)
        pos += BLOCK_K
        next_slot = _slot_ids(idx_ptr, tok * idx_stride_t, pos, length)  # one step ahead, by hand

        sc0, sc1, sc2, sc3 = _tile_scales(kv_f32, row_off, valid, IS_FP8, BLOCK_K)
        s = _dot(_q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col),
                 _lat_tile_t(kv_lat, kv_rope, row_off, valid, col, IS_FP4, SCALE_OFF), DOT_BF16) * sc0[None, :]
        s += _dot(_q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + _TILE),
                  _lat_tile_t(kv_lat, kv_rope, row_off, valid, col + _TILE, IS_FP4, SCALE_OFF), DOT_BF16) * sc1[None, :]
        s += _dot(_q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + 2 * _TILE),
                  _lat_tile_t(kv_lat, kv_rope, row_off, valid, col + 2 * _TILE, IS_FP4, SCALE_OFF), DOT_BF16) * sc2[None, :]
        s += _dot(_q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + 3 * _TILE),
                  _lat_tile_t(kv_lat, kv_rope, row_off, valid, col + 3 * _TILE, IS_FP4, SCALE_OFF), DOT_BF16) * sc3[None, :]
        if ROPE > 0:  # a rope-less layout (GLM-5.3-Flash) has no rope tile: not even its code
            rope_col = tl.arange(0, ROPE)
            if IS_FP8:
                rope = _kv_tile(kv_rope, (row_off + ROPE_OFF) // 2, valid, rope_col)
            elif IS_FP4:
                rope = _kv_tile(kv_rope, row_off + ROPE_OFF, valid, rope_col)  # e4m3, unscaled
            else:
                rope = _kv_tile(kv_rope, row_off + ROPE_OFF, valid, rope_col)
            s += _dot(_q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, rope_col + _NOPE), tl.trans(rope), DOT_BF16)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_K], base 2

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing valid yet keeps m = -inf; subtracting 0 instead keeps exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # The fp8 scale goes on p's columns, so the value tiles stay exact in bf16.
        acc0 = acc0 * alpha[:, None] + _dot(p * sc0[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col, IS_FP4, SCALE_OFF), DOT_BF16)
        acc1 = acc1 * alpha[:, None] + _dot(p * sc1[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + _TILE, IS_FP4, SCALE_OFF), DOT_BF16)
        acc2 = acc2 * alpha[:, None] + _dot(p * sc2[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + 2 * _TILE, IS_FP4, SCALE_OFF), DOT_BF16)
        acc3 = acc3 * alpha[:, None] + _dot(p * sc3[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + 3 * _TILE, IS_FP4, SCALE_OFF), DOT_BF16)

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
        # Partials stay fp32 and base 2 whatever the caller asked; the combine applies the rest.
        _finalize(
            out_ptr, tok * out_stride_t + split * out_stride_s, out_stride_h,
            lse_ptr, tok * lse_stride_t + split * lse_stride_s, lse_stride_h,
            sink_ptr, sink_stride, 0, 1, 1.0,
            heads, h_mask, lse2, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l,
        )


@triton.jit(do_not_specialize=_UNSPECIALIZED_COMBINE)
def _combine_kernel(
    part_ptr, part_stride_t, part_stride_s, part_stride_h,
    plse_ptr, plse_stride_t, plse_stride_s, plse_stride_h,
    sink_ptr, sink_stride, has_sink,
    out_ptr, out_stride_t, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_h, write_lse, lse_scale,
    num_heads, num_splits,
    BLOCK_H: tl.constexpr,
):
    """Merge the splits of one (token, head block): weights exp2(lse_s - max), renormalized."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, _TILE)
    plse_row = plse_ptr + tok * plse_stride_t + heads * plse_stride_h

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(plse_row + s * plse_stride_s, mask=h_mask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    part_rows = part_ptr + tok * part_stride_t + heads[:, None].to(tl.int64) * part_stride_h + col[None, :]
    for s in range(num_splits):
        w = tl.math.exp2(tl.load(plse_row + s * plse_stride_s, mask=h_mask, other=float("-inf")) - m_safe)
        total += w  # w is 0 for an empty split
        ptrs = part_rows + s * part_stride_s
        acc0 += w[:, None] * tl.load(ptrs, mask=h_mask[:, None], other=0.0)
        acc1 += w[:, None] * tl.load(ptrs + _TILE, mask=h_mask[:, None], other=0.0)
        acc2 += w[:, None] * tl.load(ptrs + 2 * _TILE, mask=h_mask[:, None], other=0.0)
        acc3 += w[:, None] * tl.load(ptrs + 3 * _TILE, mask=h_mask[:, None], other=0.0)

    has_any = total > 0.0
    inv = tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)[:, None]
    lse2 = tl.where(has_any, m_safe + tl.math.log2(tl.where(has_any, total, 1.0)), float("-inf"))
    _finalize(
        out_ptr, tok * out_stride_t, out_stride_h, lse_ptr, tok * lse_stride_t, lse_stride_h,
        sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
        heads, h_mask, lse2, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv,
    )


def triton_sparse_mla(
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
    """Sparse MLA over a paged KV cache with Triton (same contract as ``torch_sparse_mla``).

    Trusts its inputs: :func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward` validates them.

    The contract (every argument's shape and dtype, per layout) is
    :func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward`'s; in short:

    q: [T, H, layout.head_dim] (576, or 512 for a rope-less layout), bfloat16 or float32, last dim
        contiguous
    kv_cache: [P, page_size, layout.row] in the layout's dtype (uint8 for fp8 layouts: 656- or
        528-byte rows); [num_slots, row] flat and page-strided views work too (last dim contiguous;
        for fp8 layouts the byte offset and strides are multiples of 4, for the fp32 scales)
    indices: [T, topk], int32, global slots (page * page_size + row), -1 padded
    topk_length: [T], int32, any stride, optional; positions >= topk_length[t] are invalid
    sink: [H], float32, any stride, optional; out *= 1 / (1 + exp(sink - lse))
    out: [T, H, 512], q's dtype, any non-overlapping strides, optional; written and returned
    returns: out [T, H, 512] in q's dtype, and lse [T, H] float32 when ``return_lse`` (natural
        log when ``lse_base == "e"``, base 2 when ``"2"``)
    """
    return _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=None)


def num_slots(kv_cache: torch.Tensor) -> int:
    """Global slots a paged ([P, page, W]) or flat ([S, W]) cache holds."""
    return kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)


def page_divisor(page_size: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``slot * magic >> shift == slot // page_size`` for every slot in
    ``[0, 2**31)``: ``shift = 31 + ceil(log2 page_size)``, ``magic = ceil(2**shift / page_size)``.

    Exact: with ``magic * page_size = 2**shift + e``, ``0 <= e < page_size <= 2**(shift - 31)``,
    the product overshoots ``slot / page_size`` by ``slot * e / (page_size * 2**shift) < 1 /
    page_size``, less than the distance to the next integer; and ``slot * magic < 2**63``.
    """
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, page stride, row stride) in the cache's elements; a flat cache is 1-row pages."""
    if kv_cache.dim() == 3:
        return kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1)
    return 1, kv_cache.stride(0), kv_cache.stride(0)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: what ``_run`` executes and what the compile gate compiles.

    kernel: the ``@triton.jit`` function
    grid: programs along (tokens, head blocks[, splits])
    args: the positional (runtime) arguments
    constexprs: the constexpr keyword arguments
    num_warps: warps a program runs
    num_stages: software-pipelining depth
    describe: the variant as the compile report names it (dtypes and constexpr values)
    maxnreg: register cap for ptxas, or None
    """

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    describe: dict
    maxnreg: int | None = None

    def run(self) -> None:
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages, **extra)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_PARTIAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def partial_dtype(cfg: LaunchConfig) -> torch.dtype:
    """The torch dtype of ``cfg``'s split partials."""
    return _PARTIAL_DTYPES[cfg.partial_dtype]
# The combine kernel reads only fp32 partials; 16 heads x 512 columns in 4 warps keeps it far
# from spilling, whatever head block the main kernel used.
COMBINE_BLOCK_H = 16
COMBINE_WARPS = 4
COMBINE_STAGES = 2


def launch_plan(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, lse, lse_base,
                cfg: LaunchConfig, interpret: bool) -> list[Launch]:
    """The launches that compute ``out`` (and ``lse`` when given) for already-checked inputs.

    One launch when ``cfg.num_splits == 1``; otherwise the split kernel into fresh fp32 partials,
    then the combine kernel into ``out``.
    """
    num_tokens, num_heads, _ = q.shape
    if not interpret and q.dtype != torch.bfloat16:
        # The GPU dot rounds q to bfloat16 anyway; converting first halves the q traffic and the
        # registers, and leaves one q dtype to compile. out keeps the caller's dtype.
        q = q.to(torch.bfloat16)
    # fp8 offsets are bytes; the validator guarantees the 4-byte alignment of every token that the
    # kernel's fp32 view of the scales needs.
    page_size, page_stride, row_stride = _cache_geometry(kv_cache)
    has_len, has_sink = topk_length is not None, sink is not None
    lse_scale = 1.0 if lse_base == "2" else _LN2
    head_blocks = _cdiv(num_heads, cfg.block_h)
    final = cfg.num_splits == 1
    if final:
        dest, dest_strides = out, (out.stride(0), 0, out.stride(1))
        dest_lse, dest_lse_strides = (lse, (lse.stride(0), 0, lse.stride(1))) if lse is not None else (out, (0, 0, 0))
    else:
        dest = torch.empty(num_tokens, cfg.num_splits, num_heads, layout.KV_LORA_RANK,
                           dtype=partial_dtype(cfg), device=q.device)  # [T, S, H, 512] partials
        dest_lse = torch.empty(num_tokens, cfg.num_splits, num_heads, dtype=torch.float32, device=q.device)  # [T, S, H]
        dest_strides, dest_lse_strides = dest.stride()[:3], dest_lse.stride()
    main = Launch(
        kernel=_sparse_mla_kernel,
        grid=(num_tokens, head_blocks, cfg.num_splits),
        args=(
            q, q.stride(0), q.stride(1),
            kv_cache, page_stride, row_stride, *page_divisor(page_size), page_size, kv_cache.shape[0] * page_size,
            indices, indices.stride(0), indices.shape[1],
            topk_length if has_len else indices, topk_length.stride(0) if has_len else 0, int(has_len),
            sink if has_sink else dest, sink.stride(0) if has_sink else 0, int(final and has_sink),
            dest, *dest_strides,
            dest_lse, *dest_lse_strides, int(not final or lse is not None), lse_scale if final else 1.0,
            num_heads, float(sm_scale) * _LOG2E, cfg.blocks_per_split,
        ),
        constexprs=dict(**layout_constexprs(kv_layout), FINAL=final, DOT_BF16=not interpret,
                        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        describe=dict(kernel="sparse_mla", q=_DTYPE_NAMES[q.dtype], cache=kv_layout,
                      out=_DTYPE_NAMES[dest.dtype], final=int(final), block_h=cfg.block_h,
                      block_k=cfg.block_k, warps=cfg.num_warps, stages=cfg.num_stages),
    )
    if final:
        return [main]
    return [main, combine_launch(dest, dest_lse, sink=sink, out=out, lse=lse, lse_scale=lse_scale)]


def combine_launch(partials, partial_lse, *, sink, out, lse, lse_scale) -> Launch:
    """The combine of ``partials`` ([T, S, H, 512], fp32 or bf16) and their base-2 LSE ([T, S, H])
    into ``out`` (and ``lse``, times ``lse_scale``, when given); shared by both Triton kernels."""
    num_tokens, num_splits, num_heads, _ = partials.shape
    has_sink = sink is not None
    lse_arg = lse if lse is not None else partial_lse
    return Launch(
        kernel=_combine_kernel,
        grid=(num_tokens, _cdiv(num_heads, COMBINE_BLOCK_H)),
        args=(
            partials, *partials.stride()[:3],
            partial_lse, *partial_lse.stride(),
            sink if has_sink else partials, sink.stride(0) if has_sink else 0, int(has_sink),
            out, out.stride(0), out.stride(1),
            lse_arg, lse_arg.stride(0), lse_arg.stride(-1), int(lse is not None), lse_scale,
            num_heads, num_splits,
        ),
        constexprs=dict(BLOCK_H=COMBINE_BLOCK_H),
        num_warps=COMBINE_WARPS,
        num_stages=COMBINE_STAGES,
        describe=dict(kernel="combine", part=_DTYPE_NAMES[partials.dtype], out=_DTYPE_NAMES[out.dtype],
                      block_h=COMBINE_BLOCK_H, warps=COMBINE_WARPS, stages=COMBINE_STAGES),
    )


@functools.lru_cache(maxsize=None)
def _family(device_index: int) -> str:
    return plan.family_of(*torch.cuda.get_device_capability(device_index))


def _run(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, return_lse, lse_base,
         config: LaunchConfig | None):
    """:func:`triton_sparse_mla` with an optional forced :class:`LaunchConfig` (tests use it)."""
    return run_plan(launch_plan, plan.EXACT, q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                    topk_length=topk_length, sink=sink, out=out, return_lse=return_lse, lse_base=lse_base,
                    config=config)


# fp8 rows hold fp32 scales at byte 512 of each row: a GPU loads them as 4-byte words, which fault
# (misaligned address) where a row does not start on a 4-byte boundary; the interpreter reads them
# anyway.
_SCALE_ALIGNMENT = 4


def _check_alignment(kv_cache: torch.Tensor, kv_layout: str) -> None:
    """Refuse an fp8 cache whose rows do not all start 4-byte aligned (its origin or a stride)."""
    if not layout.get(kv_layout).fp8:
        return
    item = kv_cache.element_size()
    offsets = {"the cache's first byte (data_ptr)": kv_cache.data_ptr()}
    offsets.update({f"kv_cache.stride({d}) in bytes": kv_cache.stride(d) * item for d in range(kv_cache.dim() - 1)})
    for what, value in offsets.items():
        if value % _SCALE_ALIGNMENT:
            raise KernelInputError(format_error(
                f"kv_cache ({kv_layout}) with {what} = {value}, not a multiple of {_SCALE_ALIGNMENT}",
                f"rows that start on {_SCALE_ALIGNMENT}-byte boundaries: each fp8 row's fp32 scales are "
                "loaded as 4-byte words, which a GPU cannot load from a misaligned address",
                "pass the cache tensor itself (or a view starting at a row), not a view offset by a few bytes"))


def run_plan(make_plan, kernel: plan.KernelShape, q, kv_cache, indices, *, sm_scale, kv_layout, topk_length,
             sink, out, return_lse, lse_base, config: LaunchConfig | None):
    """Allocate what a call returns, pick its config (``config`` or the table's for ``kernel`` on
    this device's family) and run the launches ``make_plan`` (a ``launch_plan``) returns."""
    num_tokens, num_heads, _ = q.shape
    device = q.device
    _check_alignment(kv_cache, kv_layout)
    # The kernels read topk_length as int32 and the sink as fp32; a GPU compiles whatever dtype it is
    # handed (an int64 length read as two int32 halves, a float64 sink as garbage), so they are
    # converted here. A length past int32 is past any top-k, which the kernels clamp to anyway.
    if topk_length is not None and topk_length.dtype != torch.int32:
        topk_length = topk_length.clamp(max=2**31 - 1).to(torch.int32)
    if sink is not None and sink.dtype != torch.float32:
        sink = sink.to(torch.float32)
    # The kernels index the last dim of q, indices and out with stride 1.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    if out is not None and out.stride(-1) != 1:
        result = run_plan(make_plan, kernel, q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                          topk_length=topk_length, sink=sink, out=None, return_lse=return_lse,
                          lse_base=lse_base, config=config)
        out.copy_(result[0] if return_lse else result)
        return (out, result[1]) if return_lse else out
    if out is None:
        out = torch.empty(num_tokens, num_heads, layout.KV_LORA_RANK, dtype=q.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device) if return_lse else None
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    interpret = _interpreting() or device.type == "cpu"
    family = plan.DEFAULT_FAMILY if device.type != "cuda" else _family(device.index or 0)
    cfg = config or plan.launch_config(kernel.name, num_tokens, num_heads, indices.shape[1], family, kv_layout)
    for launch in make_plan(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                            sink=sink, out=out, lse=lse, lse_base=lse_base, cfg=cfg, interpret=interpret):
        launch.run()
    return (out, lse) if return_lse else out
