"""What the DSA family's two Triton kernels share: the exact (:mod:`.triton`) and the fast (:mod:`.triton_fast`).

Both kernels take the same runtime arguments and run one program per (query token, block of
``BLOCK_H`` heads, split of the top-k candidates): the slot-id and row-offset helpers, the
epilogue (normalize, then :mod:`..shared.combine`'s finalize: the sink, the output and the LSE),
the host-side launch builder (:func:`launches`) and the call driver
(:func:`run_plan`: checks, output allocation, the config from :mod:`.plan`) live here.
A kernel module keeps only its own inner loop and its constexprs. See docs/kernels.md, section
``kernels/dsa/triton_parts.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.shared.host import LN2, LOG2E, LSE_PLAIN, cdiv, interpreting, lse_mode, page_divisor
from mla_sm120_plugin.kernels.shared.combine import DTYPE_NAMES, combine_launch, finalize
from mla_sm120_plugin.kernels.shared.triton import Launch

# What the kernels' structure assumes of every layout (checked per call by layout_constexprs):
# a 512-wide latent in four 128-wide tiles (four accumulators), and fp8 tile scales right after it.
NOPE: tl.constexpr = tl.constexpr(layout.KV_LORA_RANK)
TILE: tl.constexpr = tl.constexpr(layout.FP8_TILE)
FP8_SCALE_OFF: tl.constexpr = tl.constexpr(layout.FP8_SCALE_OFFSET)

# Arguments Triton must not specialize on (it compiles a separate variant for every int equal to 1
# or divisible by 16): the runtime flags and their strides, and sizes that are only compared,
# never used to align an address (a flat cache's page_size and a one-step split are 1).
UNSPECIALIZED_MAIN = ("topk_len_stride", "has_topk_len", "sink_stride", "has_sink", "write_lse",
                      "page_magic", "page_shift", "page_size", "num_slots", "topk", "num_heads",
                      "blocks_per_split")

_PARTIAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# fp8 rows hold fp32 scales at byte 512 of each row: a GPU loads them as 4-byte words, which fault
# (misaligned address) where a row does not start on a 4-byte boundary; the interpreter reads them
# anyway.
_SCALE_ALIGNMENT = 4


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


def num_slots(kv_cache: torch.Tensor) -> int:
    """Global slots a paged ([P, page, W]) or flat ([S, W]) cache holds."""
    return kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)



def cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, page stride, row stride) in the cache's elements; a flat cache is 1-row pages."""
    if kv_cache.dim() == 3:
        return kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1)
    return 1, kv_cache.stride(0), kv_cache.stride(0)


def partial_dtype(cfg: plan.LaunchConfig) -> torch.dtype:
    """The torch dtype of ``cfg``'s split partials."""
    return _PARTIAL_DTYPES[cfg.partial_dtype]


@triton.jit
def slot_ids(idx_ptr, idx_row, pos, length):
    """A step's raw slot ids ([BLOCK_K] int32); -1 at positions past ``length``."""
    return tl.load(idx_ptr + idx_row + pos, mask=pos < length, other=-1)


@triton.jit
def row_offset(slot, page_magic, page_shift, page_size, page_stride, row_stride):
    """Cache offset of each (valid, >= 0) slot's row: page by a multiply-shift (the host computes
    the magic number, :func:`page_divisor`), where a runtime integer division costs registers
    enough to spill; int64 offsets for caches over 2 GiB."""
    page = (slot.to(tl.int64) * page_magic) >> page_shift
    return page * page_stride + (slot.to(tl.int64) - page * page_size) * row_stride


@triton.jit
def walk_step(next_slot, pos, length, idx_ptr, tok, idx_stride_t, num_slots, page_magic, page_shift, page_size,
              page_stride, row_stride, BLOCK_K: tl.constexpr):
    """One step of the walk: the step's slots (loaded a step earlier), which are valid (``>= 0`` and
    inside the cache; positions past ``length`` were loaded as -1, so the slot alone says), their
    row offsets, and the next step's slot ids, loaded now: one step ahead, by hand, so every row
    address of a step depends only on the previous iteration and Triton's pipeliner issues the row
    gathers as asynchronous copies a step early (triton#4721). Returns ``(valid, row_off, pos,
    next_slot)``."""
    slot = next_slot
    valid = (slot >= 0) & (slot < num_slots)
    row_off = row_offset(tl.where(valid, slot, 0), page_magic, page_shift, page_size, page_stride, row_stride)
    pos += BLOCK_K
    next_slot = slot_ids(idx_ptr, tok * idx_stride_t, pos, length)
    return valid, row_off, pos, next_slot


@triton.jit
def q_tile(q_ptr, q_row, heads, h_mask, q_stride_h, cols):
    """q[tok, heads, cols] ([BLOCK_H, width], q's dtype); padded heads read as 0."""
    return tl.load(q_ptr + q_row + heads[:, None].to(tl.int64) * q_stride_h + cols[None, :],
                   mask=h_mask[:, None], other=0.0)


@triton.jit
def kv_tile(kv_ptr, row_off, valid, cols, TRANS: tl.constexpr):
    """Cache elements ``cols`` of each candidate in the pointer's dtype, 0 when invalid: [BLOCK_K,
    width], or transposed with ``TRANS`` ([width, BLOCK_K], candidates along the columns: the key
    tile's form, which Triton's pipeliner turns into an asynchronous copy issued a step ahead)."""
    if TRANS:
        t = tl.load(kv_ptr + row_off[None, :] + cols[:, None], mask=valid[None, :], other=0.0)
    else:
        t = tl.load(kv_ptr + row_off[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
    return t


@triton.jit
def epilogue(
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h,
    sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
    tok, split, heads, h_mask, m_i, l_i, acc0, acc1, acc2, acc3, FINAL: tl.constexpr,
):
    """The main kernels' end: normalize an online softmax's state (``m_i`` base 2, ``l_i``, the four
    ``[BLOCK_H, 128]`` accumulators) and store it with :func:`finalize`: with ``FINAL`` the output
    row of ``tok`` (the sink, the caller's LSE base and flags applied), else split ``split``'s
    normalized partial and its base-2 LSE, whatever the caller asked (the combine applies the rest).
    A head with nothing valid (``l_i == 0``) stores 0 and an LSE of -inf."""
    has_any = l_i > 0.0
    inv_l = tl.where(has_any, 1.0 / tl.where(has_any, l_i, 1.0), 0.0)[:, None]
    lse2 = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    if FINAL:
        finalize(
            out_ptr, tok * out_stride_t, out_stride_h, lse_ptr, tok * lse_stride_t, lse_stride_h,
            sink_ptr, sink_stride, has_sink, write_lse, lse_scale,
            heads, h_mask, lse2, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l,
        )
    else:
        finalize(
            out_ptr, tok * out_stride_t + split * out_stride_s, out_stride_h,
            lse_ptr, tok * lse_stride_t + split * lse_stride_s, lse_stride_h,
            sink_ptr, sink_stride, 0, 1, 1.0,
            heads, h_mask, lse2, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l,
        )


def launches(kernel, name: str, constexprs: dict, q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink,
             out, lse, lse_base, cfg: plan.LaunchConfig, interpret: bool, lse_with_sink: bool = False) -> list[Launch]:
    """The launches of one call of a DSA kernel (``kernel``, reported as ``name``; ``constexprs``:
    its layout constexprs) for already-checked inputs.

    One launch when ``cfg.num_splits == 1``; otherwise the split kernel into fresh
    ``cfg.partial_dtype`` partials ([T, S, H, 512], and their base-2 LSE [T, S, H]), then the
    combine kernel into ``out``. ``lse`` (when given) is written in ``lse_base``, with the sink folded
    in when ``lse_with_sink``.
    """
    num_tokens, num_heads, _ = q.shape
    if not interpret and q.dtype != torch.bfloat16:
        # The GPU dot rounds (or quantizes) q anyway; converting first halves the q traffic and the
        # registers, and leaves one q dtype to compile. out keeps the caller's dtype.
        q = q.to(torch.bfloat16)
    # fp8 offsets are bytes; the validator guarantees the 4-byte alignment of every token that the
    # kernel's fp32 view of the scales needs.
    page_size, page_stride, row_stride = cache_geometry(kv_cache)
    has_len, has_sink = topk_length is not None, sink is not None
    lse_scale = 1.0 if lse_base == "2" else LN2
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
        kernel=kernel,
        grid=(num_tokens, cdiv(num_heads, cfg.block_h), cfg.num_splits),
        args=(
            q, q.stride(0), q.stride(1),
            kv_cache, page_stride, row_stride, *page_divisor(page_size), page_size, num_slots(kv_cache),
            indices, indices.stride(0), indices.shape[1],
            topk_length if has_len else indices, topk_length.stride(0) if has_len else 0, int(has_len),
            sink if has_sink else dest, sink.stride(0) if has_sink else 0, int(final and has_sink),
            dest, *dest_strides,
            dest_lse, *dest_lse_strides,
            lse_mode(lse is not None, lse_with_sink) if final else LSE_PLAIN, lse_scale if final else 1.0,
            num_heads, float(sm_scale) * LOG2E, cfg.blocks_per_split,
        ),
        constexprs=dict(**constexprs, FINAL=final, DOT_BF16=not interpret, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
        describe=dict(kernel=name, q=DTYPE_NAMES[q.dtype], cache=kv_layout,
                      out=DTYPE_NAMES[dest.dtype], final=int(final), block_h=cfg.block_h,
                      block_k=cfg.block_k, warps=cfg.num_warps, stages=cfg.num_stages,
                      **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg})),
    )
    if final:
        return [main]
    return [main, combine_launch(dest, dest_lse, sink=sink, out=out, lse=lse, lse_scale=lse_scale,
                                 lse_with_sink=lse_with_sink)]


@functools.lru_cache(maxsize=None)
def _family(device_index: int) -> str:
    return plan.gpu_family(*torch.cuda.get_device_capability(device_index))


def check_alignment(kv_cache: torch.Tensor, kv_layout: str) -> None:
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
             sink, out, return_lse, lse_base, config: plan.LaunchConfig | None, lse_with_sink: bool = False):
    """Allocate what a call returns, pick its config (``config`` or the table's for ``kernel`` on
    this device's family) and run the launches ``make_plan`` (a ``launch_plan``) returns."""
    num_tokens, num_heads, _ = q.shape
    device = q.device
    check_alignment(kv_cache, kv_layout)
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
                          lse_base=lse_base, config=config, lse_with_sink=lse_with_sink)
        out.copy_(result[0] if return_lse else result)
        return (out, result[1]) if return_lse else out
    if out is None:
        out = torch.empty(num_tokens, num_heads, layout.KV_LORA_RANK, dtype=q.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device) if return_lse else None
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    interpret = interpreting() or device.type == "cpu"
    family = plan.DEFAULT_FAMILY if device.type != "cuda" else _family(device.index or 0)
    cfg = config or plan.launch_config(kernel.name, num_tokens, num_heads, indices.shape[1], family, kv_layout)
    for launch in make_plan(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                            sink=sink, out=out, lse=lse, lse_base=lse_base, cfg=cfg, interpret=interpret,
                            lse_with_sink=lse_with_sink):
        launch.run()
    return (out, lse) if return_lse else out
