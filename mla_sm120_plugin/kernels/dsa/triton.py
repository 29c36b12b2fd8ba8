"""Portable (exact) Triton sparse-MLA kernel: every cache layout of :mod:`.layout`, dequantized in-kernel.

Contract: :func:`triton_sparse_mla` computes what :func:`.reference.torch_sparse_mla` does (the
semantics are stated there) for fp8 rows with or without a rope part (656 or 528 bytes), nvfp4
rows (352 bytes) and bf16 rows (576 or 512 values); ``sparse_mla_forward`` validates its inputs.

Structure: one program per (query token, ``BLOCK_H`` heads, split of the top-k candidates) walks
its candidates ``BLOCK_K`` a step with an online softmax in base 2; the 512-wide latent is four
128-wide tiles (four fp32 accumulators) plus the rope tile. Dots are bf16 x bf16 with fp32
accumulation (:func:`~mla_sm120_plugin.kernels.shared.triton.dot`); each tile's scale multiplies
the fp32 scores and the probabilities, never a rounded key. What it shares with the fast kernel
(slot ids, row offsets, the epilogue, the combine of splits, the launch builder and the call
driver) is :mod:`.triton_parts`; the split count comes from :mod:`.plan`.

Design notes and measurements: docs/kernels.md, section ``kernels/dsa/triton.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
from mla_sm120_plugin.kernels.shared.triton import dot, e2m1

# One block shape for every head count (the compile gate's numbers behind it: docs/kernels.md); the
# split count comes from the configuration table in :mod:`.plan`.
BLOCK_H = plan.EXACT.block_h
BLOCK_K = plan.EXACT.block_k
NUM_WARPS = plan.EXACT.num_warps
NUM_STAGES = plan.EXACT.num_stages
MAX_SPLITS = plan.MAX_SPLITS
LaunchConfig = plan.LaunchConfig


def launch_config(num_tokens: int, num_heads: int, topk: int, family: str = plan.DEFAULT_FAMILY) -> LaunchConfig:
    """The exact kernel's config for one call, from :func:`.plan.launch_config`'s table
    (deterministic: no autotuning at serve time). Few tokens get several splits, many get one."""
    return plan.launch_config(plan.EXACT.name, num_tokens, num_heads, topk, family)


def launch_variants() -> list[LaunchConfig]:
    """One config per compiled shape :func:`launch_config` can pick: the final and the split path.

    ``num_splits`` and ``blocks_per_split`` are runtime values (not specialized), so these two
    stand for every config it returns.
    """
    return [plan.EXACT.config(splits, 2) for splits in (1, 2)]


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
    return e2m1((byte.to(tl.int32) >> shift) & 0xF) * sf.to(tl.float32)


@triton.jit
def _lat_tile(kv_lat, kv_e4m3, row_off, valid, cols, IS_FP4: tl.constexpr, SCALE_OFF: tl.constexpr,
              TRANS: tl.constexpr):
    """Latent elements ``cols`` of each candidate (cache dtype, or fp32 for nvfp4): the value tile
    [BLOCK_K, width], or with ``TRANS`` the key tile [width, BLOCK_K]."""
    if IS_FP4:
        t = _fp4_tile(kv_lat, kv_e4m3, row_off, valid, cols, SCALE_OFF, TRANS)
    else:
        t = kv_tile(kv_lat, row_off, valid, cols, TRANS)
    return t


@triton.jit
def _tile_scales(kv_f32_ptr, row_off, valid, IS_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 scales of the four latent tiles for each candidate (four [BLOCK_K]); 1 for bf16 caches.

    One 16-byte gather a row ([BLOCK_K, 4]) split into columns, not four 4-byte gathers: fewer
    loads, and fewer live addresses (the rope-less variant spilled 20 bytes on sm_120a with four).
    """
    if IS_FP8:
        sc = tl.load(kv_f32_ptr + ((row_off + FP8_SCALE_OFF) // 4)[:, None] + tl.arange(0, 4)[None, :],
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


@triton.jit(do_not_specialize=UNSPECIALIZED_MAIN)
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
    """One (token, head block, split) program.

    Constexprs: ``IS_FP8`` / ``IS_FP4`` / neither (fp8, nvfp4 or bf16 latent), ``ROPE`` (the rope
    width, 0 for a rope-less layout: no rope byte is loaded, not even the code), ``ROPE_OFF`` and
    ``SCALE_OFF`` (where the rope and the nvfp4 scales start), all from the layout
    (:func:`.triton_parts.layout_constexprs`); ``FINAL`` (write the output, one split, or a split's
    fp32 partial and base-2 LSE); ``DOT_BF16`` (False under the interpreter); ``BLOCK_H`` and
    ``BLOCK_K``. The output dtype is its pointer's. Whether ``topk_length``, the sink and the LSE are
    used is decided by runtime flags, never specialized, so they do not multiply the variants.

    Cache offsets (``page_stride``, ``row_stride``, the per-candidate ``row_off``) are in elements
    of ``kv_ptr``: bytes of a uint8 cache, read through typed views of the same pointer (fp8
    latent, fp32 scales, bf16 rope), or elements of a bfloat16 cache; the row stride is the cache
    tensor's own, and reserved bytes (``fp8_ds_mla_nope``'s [528, 656)) are never loaded. A slot's
    page is ``slot * page_magic >> page_shift`` (:func:`..shared.host.page_divisor`).

    Each step loads the next step's slot ids, so every row address of a step is known one
    iteration ahead and Triton's pipeliner turns the row gathers into asynchronous copies issued a
    step early (triton#4721: it cannot for a gather whose indices load in the same iteration); the
    key tiles are loaded already transposed ([width, BLOCK_K]), the form it accepts for an fp8 tile
    widened before the dot. q is not held across the loop: each step reloads its tiles (from L1).
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
    col = tl.arange(0, TILE)
    q_row = tok * q_stride_t

    length = topk
    if has_topk_len:
        length = tl.minimum(tl.load(topk_len_ptr + tok * topk_len_stride), topk)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, TILE], tl.float32)

    pos = split * (blocks_per_split * BLOCK_K) + tl.arange(0, BLOCK_K)
    next_slot = slot_ids(idx_ptr, tok * idx_stride_t, pos, length)
    for _ in range(blocks_per_split):
        valid, row_off, pos, next_slot = walk_step(next_slot, pos, length, idx_ptr, tok, idx_stride_t, num_slots,
                                                   page_magic, page_shift, page_size, page_stride, row_stride, BLOCK_K)

        sc0, sc1, sc2, sc3 = _tile_scales(kv_f32, row_off, valid, IS_FP8, BLOCK_K)
        s = dot(q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col),
                _lat_tile(kv_lat, kv_rope, row_off, valid, col, IS_FP4, SCALE_OFF, True), DOT_BF16) * sc0[None, :]
        s += dot(q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + TILE),
                 _lat_tile(kv_lat, kv_rope, row_off, valid, col + TILE, IS_FP4, SCALE_OFF, True), DOT_BF16) * sc1[None, :]
        s += dot(q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + 2 * TILE),
                 _lat_tile(kv_lat, kv_rope, row_off, valid, col + 2 * TILE, IS_FP4, SCALE_OFF, True), DOT_BF16) * sc2[None, :]
        s += dot(q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, col + 3 * TILE),
                 _lat_tile(kv_lat, kv_rope, row_off, valid, col + 3 * TILE, IS_FP4, SCALE_OFF, True), DOT_BF16) * sc3[None, :]
        if ROPE > 0:  # a rope-less layout (GLM-5.3-Flash) has no rope tile: not even its code
            rope_col = tl.arange(0, ROPE)
            if IS_FP8:
                rope = kv_tile(kv_rope, (row_off + ROPE_OFF) // 2, valid, rope_col, False)
            else:  # bf16, or nvfp4's e4m3 rope (unscaled)
                rope = kv_tile(kv_rope, row_off + ROPE_OFF, valid, rope_col, False)
            s += dot(q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, rope_col + NOPE), tl.trans(rope), DOT_BF16)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_K], base 2

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing valid yet keeps m = -inf; subtracting 0 instead keeps exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # The fp8 scale goes on p's columns, so the value tiles stay exact in bf16.
        acc0 = acc0 * alpha[:, None] + dot(p * sc0[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col, IS_FP4, SCALE_OFF, False), DOT_BF16)
        acc1 = acc1 * alpha[:, None] + dot(p * sc1[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + TILE, IS_FP4, SCALE_OFF, False), DOT_BF16)
        acc2 = acc2 * alpha[:, None] + dot(p * sc2[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + 2 * TILE, IS_FP4, SCALE_OFF, False), DOT_BF16)
        acc3 = acc3 * alpha[:, None] + dot(p * sc3[None, :], _lat_tile(kv_lat, kv_rope, row_off, valid, col + 3 * TILE, IS_FP4, SCALE_OFF, False), DOT_BF16)

    epilogue(out_ptr, out_stride_t, out_stride_s, out_stride_h, lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h,
             sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
             tok, split, heads, h_mask, m_i, l_i, acc0, acc1, acc2, acc3, FINAL)


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
    lse_with_sink: bool = False,
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
        log when ``lse_base == "e"``, base 2 when ``"2"``; the sink folded in when ``lse_with_sink``)
    """
    return _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=None, lse_with_sink=lse_with_sink)


def launch_plan(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, lse, lse_base,
                cfg: LaunchConfig, interpret: bool, lse_with_sink: bool = False) -> list:
    """The launches that compute ``out`` (and ``lse`` when given) for already-checked inputs
    (:class:`~mla_sm120_plugin.kernels.shared.triton.Launch` objects, :func:`.triton_parts.launches`).

    One launch when ``cfg.num_splits == 1``; otherwise the split kernel into fresh fp32 partials,
    then the combine kernel into ``out``. An fp32 q is converted to bfloat16 first on a GPU (the dot
    would round it anyway); out keeps q's dtype.
    """
    return launches(_sparse_mla_kernel, "sparse_mla", layout_constexprs(kv_layout), q, kv_cache, indices,
                    sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length, sink=sink, out=out, lse=lse,
                    lse_base=lse_base, cfg=cfg, interpret=interpret, lse_with_sink=lse_with_sink)


def _run(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, return_lse, lse_base,
         config: LaunchConfig | None, lse_with_sink: bool = False):
    """:func:`triton_sparse_mla` with an optional forced :class:`LaunchConfig` (tests use it)."""
    return run_plan(launch_plan, plan.EXACT, q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                    topk_length=topk_length, sink=sink, out=out, return_lse=return_lse, lse_base=lse_base,
                    config=config, lse_with_sink=lse_with_sink)
