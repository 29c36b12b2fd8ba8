"""The one combine of split partials, for every Triton kernel of both families, and the store it ends in.

A split program stores its range's normalized output (fp32 or bf16 ``[T, S, H, 512]``) and base-2
LSE (``[T, S, H]``); :func:`combine_kernel` merges a (token, head block)'s splits with weights
``exp2(lse_s - max)`` and ends, as an unsplit program does, in :func:`finalize`: the sink applied
once (``out *= 1 / (1 + exp(sink - lse))``), the output rounded to its dtype, the LSE stored. Both
families' outputs are 512 wide, held as four 128-wide tiles (four accumulators).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.kernels.shared.host import cdiv
from mla_sm120_plugin.kernels.shared.triton import LOG2E_K, Launch, store_rounded

OUT_DIM = 512
TILE: tl.constexpr = tl.constexpr(OUT_DIM // 4)

# Arguments Triton must not specialize on (it compiles a separate variant for every int equal to 1
# or divisible by 16): the runtime flags and their strides, and counts that are only compared.
UNSPECIALIZED_COMBINE = ("sink_stride", "has_sink", "write_lse", "num_heads", "num_splits")

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

# The combine kernel reads only fp32 partials; 16 heads x 512 columns in 4 warps keeps it far
# from spilling, whatever head block the main kernel used.
COMBINE_BLOCK_H = 16
COMBINE_WARPS = 4
COMBINE_STAGES = 2


@triton.jit
def finalize(
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
        # 1 / (1 + exp(sink - lse)) in base 2. A head with nothing valid (lse2 = -inf) has zeros to
        # scale: its factor is 0, also for a -inf sink (padded heads), where -inf - -inf is NaN.
        empty = lse2 == float("-inf")
        factor = tl.where(empty, 0.0, 1.0 / (1.0 + tl.math.exp2(sink * LOG2E_K - tl.where(empty, 0.0, lse2))))
        factor = factor[:, None]
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
        tl.store(lse_ptr + lse_row + heads * lse_stride_h, lse2 * lse_scale, mask=h_mask)




@triton.jit(do_not_specialize=UNSPECIALIZED_COMBINE)
def combine_kernel(
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
    col = tl.arange(0, TILE)
    plse_row = plse_ptr + tok * plse_stride_t + heads * plse_stride_h

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(plse_row + s * plse_stride_s, mask=h_mask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, TILE], tl.float32)
    part_rows = part_ptr + tok * part_stride_t + heads[:, None].to(tl.int64) * part_stride_h + col[None, :]
    for s in range(num_splits):
        w = tl.math.exp2(tl.load(plse_row + s * plse_stride_s, mask=h_mask, other=float("-inf")) - m_safe)
        total += w  # w is 0 for an empty split
        ptrs = part_rows + s * part_stride_s
        acc0 += w[:, None] * tl.load(ptrs, mask=h_mask[:, None], other=0.0)
        acc1 += w[:, None] * tl.load(ptrs + TILE, mask=h_mask[:, None], other=0.0)
        acc2 += w[:, None] * tl.load(ptrs + 2 * TILE, mask=h_mask[:, None], other=0.0)
        acc3 += w[:, None] * tl.load(ptrs + 3 * TILE, mask=h_mask[:, None], other=0.0)

    has_any = total > 0.0
    inv = tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)[:, None]
    lse2 = tl.where(has_any, m_safe + tl.math.log2(tl.where(has_any, total, 1.0)), float("-inf"))
    finalize(
        out_ptr, tok * out_stride_t, out_stride_h, lse_ptr, tok * lse_stride_t, lse_stride_h,
        sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
        heads, h_mask, lse2, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv,
    )




def combine_launch(partials, partial_lse, *, sink, out, lse, lse_scale) -> Launch:
    """The combine of ``partials`` ([T, S, H, 512], fp32 or bf16) and their base-2 LSE ([T, S, H])
    into ``out`` (and ``lse``, times ``lse_scale``, when given; ``sink`` applied once)."""
    num_tokens, num_splits, num_heads, _ = partials.shape
    has_sink = sink is not None
    lse_arg = lse if lse is not None else partial_lse
    return Launch(
        kernel=combine_kernel,
        grid=(num_tokens, cdiv(num_heads, COMBINE_BLOCK_H)),
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
        describe=dict(kernel="combine", part=DTYPE_NAMES[partials.dtype], out=DTYPE_NAMES[out.dtype],
                      block_h=COMBINE_BLOCK_H, warps=COMBINE_WARPS, stages=COMBINE_STAGES),
    )
