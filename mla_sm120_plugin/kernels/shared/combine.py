"""The one combine of split partials, for every Triton kernel of both families, and the store it ends in.

A split program stores its range's normalized output (fp32 or bf16 ``[T, S, H, 512]``) and base-2
LSE (``[T, S, H]``); :func:`combine_kernel` merges a (token, head, 128 columns)'s splits with
weights ``exp2(lse_s - running max)`` and, as an unsplit program does in :func:`finalize`, applies
the sink once (``out *= 1 / (1 + exp(sink - lse))``, :func:`sink_factor`), rounds the output to
its dtype and stores the LSE: sink-free, or with the sink folded in (:func:`fold_sink`) when the caller
asks for it (``write_lse`` = :data:`~.host.LSE_WITH_SINK`). Both families' outputs are 512 wide, held by
an unsplit program as four 128-wide tiles (four accumulators).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.kernels.shared.host import LSE_WITH_SINK, lse_mode
from mla_sm120_plugin.kernels.shared.launch_plan import COMBINE_SPLIT_BLOCK
from mla_sm120_plugin.kernels.shared.triton import LOG2E_K, Launch, store_rounded

OUT_DIM = 512
TILE_COLS = OUT_DIM // 4
TILE: tl.constexpr = tl.constexpr(TILE_COLS)

# Arguments Triton must not specialize on (it compiles a separate variant for every int equal to 1
# or divisible by 16): the runtime flags and their strides, and counts that are only compared.
UNSPECIALIZED_COMBINE = ("sink_stride", "has_sink", "write_lse", "num_heads", "num_splits")

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

# One program a (token, head, 128-column tile), merging COMBINE_SPLIT_BLOCK (32) splits a step: at
# one token a call's partials are read by 64 programs for 16 heads, in cdiv(splits, 32) steps
# each, where one program a (token, 16 heads) walked every split one round trip at a time
# (launch_plan.py models the combine's steps with the same constant).
COMBINE_WARPS = 4
COMBINE_STAGES = 2


@triton.jit
def sink_factor(sink, lse2):
    """``1 / (1 + exp(sink - lse))`` in base 2 (``sink`` natural log, ``lse2`` base 2). A head with
    nothing valid (lse2 = -inf) has zeros to scale: its factor is 0, also for a -inf sink (padded
    heads), where -inf - -inf would be NaN."""
    empty = lse2 == float("-inf")
    return tl.where(empty, 0.0, 1.0 / (1.0 + tl.math.exp2(sink * LOG2E_K - tl.where(empty, 0.0, lse2))))


LSE_WITH_SINK_K: tl.constexpr = tl.constexpr(LSE_WITH_SINK)


@triton.jit
def fold_sink(lse2, sink):
    """``log2(2^lse2 + e^sink)``: a base-2 LSE with the sink (natural log) counted as one more term of
    the denominator. Total: an empty head (``lse2`` = -inf) gets the sink itself, a -inf sink (a head
    whose sink this call does not count) leaves ``lse2`` as it is, both -inf stay -inf (no -inf - -inf)."""
    sink2 = sink * LOG2E_K
    top = tl.maximum(lse2, sink2)
    none = top == float("-inf")
    safe = tl.where(none, 0.0, top)
    return tl.where(none, float("-inf"), safe + tl.math.log2(tl.math.exp2(lse2 - safe) + tl.math.exp2(sink2 - safe)))


@triton.jit
def finalize(
    out_ptr, out_row, out_stride_h, lse_ptr, lse_row, lse_stride_h,
    sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
    heads, h_mask, lse2, acc0, acc1, acc2, acc3,
):
    """Apply the sink, store the normalized output tiles (in out's dtype) and the LSE.

    ``acc*`` are already normalized (0 for a row with no valid candidate); ``lse2`` is base 2 and
    is stored times ``lse_scale`` (1 for base 2, ln 2 for natural log), with the sink folded in
    where ``write_lse`` asks for it (:data:`~.host.LSE_WITH_SINK`).
    """
    stored = lse2
    if has_sink:
        sink = tl.load(sink_ptr + heads * sink_stride, mask=h_mask, other=0.0)
        if write_lse == LSE_WITH_SINK_K:
            stored = fold_sink(lse2, sink)
        factor = sink_factor(sink, lse2)[:, None]
        acc0 = acc0 * factor
        acc1 = acc1 * factor
        acc2 = acc2 * factor
        acc3 = acc3 * factor
    col = tl.arange(0, TILE)
    ptrs = out_ptr + out_row + heads[:, None].to(tl.int64) * out_stride_h + col[None, :]
    mask = h_mask[:, None]
    store_rounded(ptrs, acc0, mask)
    store_rounded(ptrs + TILE, acc1, mask)
    store_rounded(ptrs + 2 * TILE, acc2, mask)
    store_rounded(ptrs + 3 * TILE, acc3, mask)
    if write_lse:
        tl.store(lse_ptr + lse_row + heads * lse_stride_h, stored * lse_scale, mask=h_mask)


@triton.jit(do_not_specialize=UNSPECIALIZED_COMBINE)
def combine_kernel(
    part_ptr, part_stride_t, part_stride_s, part_stride_h,
    plse_ptr, plse_stride_t, plse_stride_s, plse_stride_h,
    sink_ptr, sink_stride, has_sink,
    out_ptr, out_stride_t, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_h, write_lse, lse_scale,
    num_heads, num_splits,
    SPLIT_BLOCK: tl.constexpr,
):
    """Merge one (token, head, column tile)'s splits, ``SPLIT_BLOCK`` a step: weights
    exp2(lse_s - running max), renormalized; then the sink once, the store and (tile 0) the LSE
    (the sink folded in where ``write_lse`` asks for it)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    cols = tile * TILE + tl.arange(0, TILE)
    plse_row = plse_ptr + tok * plse_stride_t + head * plse_stride_h
    part_row = part_ptr + tok * part_stride_t + head.to(tl.int64) * part_stride_h

    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([TILE], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        splits = s0 + tl.arange(0, SPLIT_BLOCK)
        valid = splits < num_splits
        lse = tl.load(plse_row + splits * plse_stride_s, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.math.exp2(m - m_safe)  # 0 while nothing was valid (m = -inf)
        w = tl.math.exp2(lse - m_safe)  # 0 for an empty split
        part = tl.load(part_row + splits[:, None].to(tl.int64) * part_stride_s + cols[None, :],
                       mask=valid[:, None], other=0.0).to(tl.float32)
        total = total * rescale + tl.sum(w, axis=0)
        acc = acc * rescale + tl.sum(w[:, None] * part, axis=0)
        m = m_new

    has_any = total > 0.0
    lse2 = tl.where(has_any, tl.where(m == float("-inf"), 0.0, m) + tl.math.log2(tl.where(has_any, total, 1.0)),
                    float("-inf"))
    acc = acc * tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)
    stored = lse2
    if has_sink:
        sink = tl.load(sink_ptr + head * sink_stride)
        if write_lse == LSE_WITH_SINK_K:
            stored = fold_sink(lse2, sink)
        acc = acc * sink_factor(sink, lse2)
    store_rounded(out_ptr + tok * out_stride_t + head.to(tl.int64) * out_stride_h + cols, acc, None)
    if write_lse:
        tl.store(lse_ptr + tok * lse_stride_t + head * lse_stride_h, stored * lse_scale, mask=tile == 0)


def combine_launch(partials, partial_lse, *, sink, out, lse, lse_scale, lse_with_sink: bool = False) -> Launch:
    """The combine of ``partials`` ([T, S, H, 512], fp32 or bf16) and their base-2 LSE ([T, S, H])
    into ``out`` (and ``lse``, times ``lse_scale``, when given, with ``sink`` folded in when
    ``lse_with_sink``; ``sink`` applied to ``out`` once)."""
    num_tokens, num_splits, num_heads, _ = partials.shape
    has_sink = sink is not None
    lse_arg = lse if lse is not None else partial_lse
    return Launch(
        kernel=combine_kernel,
        grid=(num_tokens, num_heads, OUT_DIM // TILE_COLS),
        args=(
            partials, *partials.stride()[:3],
            partial_lse, *partial_lse.stride(),
            sink if has_sink else partials, sink.stride(0) if has_sink else 0, int(has_sink),
            out, out.stride(0), out.stride(1),
            lse_arg, lse_arg.stride(0), lse_arg.stride(-1), lse_mode(lse is not None, lse_with_sink), lse_scale,
            num_heads, num_splits,
        ),
        constexprs=dict(SPLIT_BLOCK=COMBINE_SPLIT_BLOCK),
        num_warps=COMBINE_WARPS,
        num_stages=COMBINE_STAGES,
        describe=dict(kernel="combine", part=DTYPE_NAMES[partials.dtype], out=DTYPE_NAMES[out.dtype],
                      splits_a_step=COMBINE_SPLIT_BLOCK, warps=COMBINE_WARPS, stages=COMBINE_STAGES),
    )
