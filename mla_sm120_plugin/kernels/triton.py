"""Portable Triton sparse-MLA kernel: reads fp8_ds_mla or bf16 pages directly, dequantizes in-kernel.

Same semantics as :func:`mla_sm120_plugin.kernels.reference.torch_sparse_mla` (FACTS.md section 4).

Structure. One program handles one query token, one block of heads and one range of top-k
candidates (a *split*). It walks its range ``BLOCK_K`` candidates at a time with an online softmax
in fp32 (scores pre-multiplied by ``log2(e)`` so it can use ``exp2``). The 576-wide head is never
held whole: scores are summed over the four 128-wide latent tiles plus the 64-wide rope tile, and
the output is kept as four 128-wide accumulators.

* Prefill (many tokens): one split, so the program writes the final output directly.
* Decode (few tokens): top-k is cut into splits so that enough programs exist to fill the GPU; each
  writes a normalized partial output and its base-2 LSE, and :func:`_combine_kernel` merges them.

Invalid candidates (-1, outside ``[0, num_slots)``, or at positions ``>= topk_length[t]``) are
masked in every load, so their bytes are never read, and get score ``-inf``.

Shared memory on SM120 (99 KB a block), estimated, not measured: with ``BLOCK_K = 64`` and
``BLOCK_H <= 32``, the largest live dot operands are one 128 x 64 key tile (16 KB in bf16) and one
``BLOCK_H`` x 128 query tile (8 KB at 32 heads); the P @ V dot adds a ``BLOCK_H`` x 64 probability
tile (4 KB) and a 64 x 128 value tile (16 KB). Even double-buffered that is under 90 KB. On a GPU,
``benchmarks/bench_kernels.py`` reports the compiled kernel's real shared-memory size.

CPU. Under ``TRITON_INTERPRET=1`` it runs on numpy, which has no bfloat16 arithmetic, so every
bfloat16 value (q, rope, the bf16 cache, the bf16 output) is moved as raw int16 bits: widened by
shifting into the high half of an int32 and bitcasting (exact), and narrowed with an integer
round-to-nearest-even (what torch does). Dots then run in fp32 on the CPU; on a GPU their operands
are cast to bfloat16 (exact for fp8 keys, rope and bf16 q; probabilities round to 8 bits) with fp32
accumulation. An fp32 q on a GPU is therefore rounded to bfloat16 for the dot.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.kernels import layout

_LOG2E = math.log2(math.e)
_LOG2E_K: tl.constexpr = tl.constexpr(_LOG2E)  # the same constants, visible inside kernels
_LN2_K: tl.constexpr = tl.constexpr(math.log(2.0))

# Layout constants the kernels see, from the one source in layout.py.
_NOPE: tl.constexpr = tl.constexpr(layout.KV_LORA_RANK)
_TILE: tl.constexpr = tl.constexpr(layout.FP8_TILE)
_ROPE: tl.constexpr = tl.constexpr(layout.ROPE_DIM)
_HEAD_DIM: tl.constexpr = tl.constexpr(layout.HEAD_DIM)
_SCALE_OFF_F32: tl.constexpr = tl.constexpr(layout.FP8_SCALE_OFFSET // 4)
_ROPE_OFF_I16_FP8: tl.constexpr = tl.constexpr(layout.FP8_ROPE_OFFSET // 2)

DEFAULT_NUM_SMS = 170  # RTX 5090; used when no CUDA device can be asked (CPU interpreter)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is cut into programs.

    block_h: heads a program handles (a power of two >= 16, for tl.dot), padded and masked
    block_k: candidates a loop step handles
    num_splits: top-k ranges per (token, head block); 1 is the prefill path
    blocks_per_split: ``block_k`` steps in each range
    """

    block_h: int
    block_k: int
    num_splits: int
    blocks_per_split: int
    num_warps: int = 4


def _launch_config(num_tokens: int, num_heads: int, topk: int, num_sms: int) -> LaunchConfig:
    """Pick block sizes and the split count.

    Heads: a block of ``next_pow2(H)`` clamped to [16, 32]; 32 heads x 512 fp32 accumulators is
    already 64 KB of registers a program. More than 32 heads means several head blocks, each
    reading the same candidates (2x the cache reads at 64 heads, 4x at 128; L2 absorbs part of it). Splits: the (token, head block) programs alone fill
    ``num_programs`` slots; if that is under two waves of ``num_sms`` we cut top-k into
    ``ceil(2 * num_sms / num_programs)`` splits, at most one per ``block_k`` step and at most 64 (the
    combine step reads every split). Empty splits are avoided by recomputing the count from the
    steps per split. Many tokens therefore get one split (prefill path), few tokens many (decode).
    """
    block_h = min(max(triton.next_power_of_2(num_heads), 16), 32)
    block_k = 64
    num_k_blocks = triton.cdiv(max(topk, 1), block_k)
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    wanted = triton.cdiv(2 * num_sms, max(programs, 1))
    splits = max(1, min(wanted, num_k_blocks, 64))
    blocks_per_split = triton.cdiv(num_k_blocks, splits)
    splits = triton.cdiv(num_k_blocks, blocks_per_split)
    return LaunchConfig(block_h, block_k, splits, blocks_per_split, num_warps=8 if block_h > 16 else 4)


@triton.jit
def _bf16_bits_to_f32(bits):
    """int16 bfloat16 bit patterns -> float32 values (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x):
    """float32 values -> int16 bfloat16 bit patterns, rounded to nearest even (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (bits >> 16).to(tl.int16)


@triton.jit
def _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, col, Q_BF16: tl.constexpr):
    """A [BLOCK_H, width] fp32 tile of q at columns ``col``; padded heads read as 0."""
    offs = q_base + heads[:, None].to(tl.int64) * q_stride_h + col[None, :]
    if Q_BF16:
        return _bf16_bits_to_f32(tl.load(q_ptr + offs, mask=h_mask[:, None], other=0))
    return tl.load(q_ptr + offs, mask=h_mask[:, None], other=0.0)


@triton.jit
def _load_keys_t(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col, IS_FP8: tl.constexpr):
    """Latent columns ``col`` of the candidates, transposed: [width, BLOCK_K] fp32, unscaled.

    Invalid candidates are masked, never read, and come back as 0.
    """
    if IS_FP8:
        ptrs = kv_fp8_ptr + row_bytes[None, :] + col[:, None]
        return tl.load(ptrs, mask=valid[None, :], other=0.0).to(tl.float32)
    ptrs = kv_i16_ptr + (row_bytes // 2)[None, :] + col[:, None]
    return _bf16_bits_to_f32(tl.load(ptrs, mask=valid[None, :], other=0))


@triton.jit
def _load_values(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col, IS_FP8: tl.constexpr):
    """Latent columns ``col`` of the candidates: [BLOCK_K, width] fp32, unscaled, 0 when invalid."""
    if IS_FP8:
        ptrs = kv_fp8_ptr + row_bytes[:, None] + col[None, :]
        return tl.load(ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
    ptrs = kv_i16_ptr + (row_bytes // 2)[:, None] + col[None, :]
    return _bf16_bits_to_f32(tl.load(ptrs, mask=valid[:, None], other=0))


@triton.jit
def _load_scale(kv_f32_ptr, row_bytes, valid, tile: tl.constexpr, IS_FP8: tl.constexpr):
    """Per-candidate fp32 scale of latent tile ``tile`` ([BLOCK_K]); 1 for the bf16 layout."""
    if IS_FP8:
        return tl.load(kv_f32_ptr + row_bytes // 4 + (_SCALE_OFF_F32 + tile), mask=valid, other=0.0)
    return tl.where(valid, 1.0, 0.0)


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _store_tile(ptr, offs, x, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(ptr + offs, _f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _finalize(
    out_ptr, out_base, out_stride_h, lse_ptr, lse_base_off, lse_stride_h, sink_ptr,
    heads, h_mask, lse2, acc0, acc1, acc2, acc3,
    HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr, LSE_BASE2: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """Apply the sink, store the normalized output tiles and the LSE in the requested base.

    ``acc*`` are already normalized (0 for a row with no valid candidate); ``lse2`` is base 2.
    """
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=h_mask, other=0.0)
        # 1 / (1 + exp(sink - lse)) in base 2; lse2 = -inf gives exp2(inf) = inf and a factor 0.
        factor = 1.0 / (1.0 + tl.math.exp2(sink * _LOG2E_K - lse2))
        acc0 = acc0 * factor[:, None]
        acc1 = acc1 * factor[:, None]
        acc2 = acc2 * factor[:, None]
        acc3 = acc3 * factor[:, None]
    col = tl.arange(0, _TILE)
    offs = out_base + heads[:, None].to(tl.int64) * out_stride_h + col[None, :]
    mask = h_mask[:, None]
    _store_tile(out_ptr, offs, acc0, mask, OUT_BF16)
    _store_tile(out_ptr, offs + _TILE, acc1, mask, OUT_BF16)
    _store_tile(out_ptr, offs + 2 * _TILE, acc2, mask, OUT_BF16)
    _store_tile(out_ptr, offs + 3 * _TILE, acc3, mask, OUT_BF16)
    if WRITE_LSE:
        lse = lse2
        if not LSE_BASE2:
            lse = lse2 * _LN2_K
        tl.store(lse_ptr + lse_base_off + heads * lse_stride_h, lse, mask=h_mask)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, q_stride_t, q_stride_h,
    kv_fp8_ptr, kv_i16_ptr, kv_f32_ptr, page_stride_bytes, row_stride_bytes, page_size, num_slots,
    idx_ptr, idx_stride_t, topk,
    topk_len_ptr, sink_ptr,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s, lse_stride_h,
    num_heads, qk_scale_log2, blocks_per_split,
    IS_FP8: tl.constexpr, Q_BF16: tl.constexpr, OUT_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_SINK: tl.constexpr, FINAL: tl.constexpr,
    WRITE_LSE: tl.constexpr, LSE_BASE2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token, head block, split) program. FINAL: write the output (one split) or partials."""
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, _TILE)
    rope_col = tl.arange(0, _ROPE)

    q_base = tok * q_stride_t
    q0 = _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, col, Q_BF16)
    q1 = _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, col + _TILE, Q_BF16)
    q2 = _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, col + 2 * _TILE, Q_BF16)
    q3 = _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, col + 3 * _TILE, Q_BF16)
    q_rope = _load_q(q_ptr, q_base, q_stride_h, heads, h_mask, rope_col + _NOPE, Q_BF16)

    length = topk
    if HAS_TOPK_LEN:
        length = tl.minimum(tl.load(topk_len_ptr + tok), topk)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, _TILE], tl.float32)

    k_start = split * (blocks_per_split * BLOCK_K)
    for step in range(blocks_per_split):
        pos = k_start + step * BLOCK_K + tl.arange(0, BLOCK_K)
        in_row = pos < length
        slot = tl.load(idx_ptr + tok * idx_stride_t + pos, mask=in_row, other=-1).to(tl.int64)
        valid = in_row & (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        row_bytes = (slot // page_size) * page_stride_bytes + (slot % page_size) * row_stride_bytes

        sc0 = _load_scale(kv_f32_ptr, row_bytes, valid, 0, IS_FP8)
        sc1 = _load_scale(kv_f32_ptr, row_bytes, valid, 1, IS_FP8)
        sc2 = _load_scale(kv_f32_ptr, row_bytes, valid, 2, IS_FP8)
        sc3 = _load_scale(kv_f32_ptr, row_bytes, valid, 3, IS_FP8)
        s = _dot(q0, _load_keys_t(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col, IS_FP8), DOT_BF16) * sc0[None, :]
        s += _dot(q1, _load_keys_t(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + _TILE, IS_FP8), DOT_BF16) * sc1[None, :]
        s += _dot(q2, _load_keys_t(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + 2 * _TILE, IS_FP8), DOT_BF16) * sc2[None, :]
        s += _dot(q3, _load_keys_t(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + 3 * _TILE, IS_FP8), DOT_BF16) * sc3[None, :]
        if IS_FP8:
            rope_bits = tl.load(
                kv_i16_ptr + (row_bytes // 2)[None, :] + (rope_col + _ROPE_OFF_I16_FP8)[:, None],
                mask=valid[None, :], other=0,
            )
        else:
            rope_bits = tl.load(
                kv_i16_ptr + (row_bytes // 2)[None, :] + (rope_col + _NOPE)[:, None],
                mask=valid[None, :], other=0,
            )
        s += _dot(q_rope, _bf16_bits_to_f32(rope_bits), DOT_BF16)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_K], base 2

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing valid yet keeps m = -inf; subtracting 0 instead keeps exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # Values are the same bytes as the keys; re-reading them (an L1/L2 hit) is cheaper than
        # keeping four 64 x 128 key tiles live in registers. The fp8 scale goes on p's columns.
        acc0 = acc0 * alpha[:, None] + _dot(p * sc0[None, :], _load_values(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col, IS_FP8), DOT_BF16)
        acc1 = acc1 * alpha[:, None] + _dot(p * sc1[None, :], _load_values(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + _TILE, IS_FP8), DOT_BF16)
        acc2 = acc2 * alpha[:, None] + _dot(p * sc2[None, :], _load_values(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + 2 * _TILE, IS_FP8), DOT_BF16)
        acc3 = acc3 * alpha[:, None] + _dot(p * sc3[None, :], _load_values(kv_fp8_ptr, kv_i16_ptr, row_bytes, valid, col + 3 * _TILE, IS_FP8), DOT_BF16)

    has_any = l_i > 0.0
    inv_l = tl.where(has_any, 1.0 / tl.where(has_any, l_i, 1.0), 0.0)
    lse2 = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    out_base = tok * out_stride_t + split * out_stride_s
    lse_base_off = tok * lse_stride_t + split * lse_stride_s
    if FINAL:
        _finalize(
            out_ptr, out_base, out_stride_h, lse_ptr, lse_base_off, lse_stride_h, sink_ptr,
            heads, h_mask, lse2, acc0 * inv_l[:, None], acc1 * inv_l[:, None],
            acc2 * inv_l[:, None], acc3 * inv_l[:, None],
            HAS_SINK, WRITE_LSE, LSE_BASE2, OUT_BF16,
        )
    else:
        # Partials stay fp32 and base 2 regardless of the caller's dtype and base.
        _finalize(
            out_ptr, out_base, out_stride_h, lse_ptr, lse_base_off, lse_stride_h, sink_ptr,
            heads, h_mask, lse2, acc0 * inv_l[:, None], acc1 * inv_l[:, None],
            acc2 * inv_l[:, None], acc3 * inv_l[:, None],
            False, True, True, False,
        )


@triton.jit
def _combine_kernel(
    part_ptr, part_stride_t, part_stride_s, part_stride_h,
    plse_ptr, plse_stride_t, plse_stride_s, plse_stride_h,
    sink_ptr,
    out_ptr, out_stride_t, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_h,
    num_heads, num_splits,
    HAS_SINK: tl.constexpr, WRITE_LSE: tl.constexpr, LSE_BASE2: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Merge the splits of one (token, head block): weights exp2(lse_s - max), renormalized."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    col = tl.arange(0, _TILE)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(plse_ptr + tok * plse_stride_t + s * plse_stride_s + heads * plse_stride_h, mask=h_mask, other=float("-inf"))
        m = tl.maximum(m, lse_s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc1 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc2 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    acc3 = tl.zeros([BLOCK_H, _TILE], tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(plse_ptr + tok * plse_stride_t + s * plse_stride_s + heads * plse_stride_h, mask=h_mask, other=float("-inf"))
        w = tl.math.exp2(lse_s - m_safe)  # 0 for an empty split
        total += w
        offs = tok * part_stride_t + s * part_stride_s + heads[:, None].to(tl.int64) * part_stride_h + col[None, :]
        acc0 += w[:, None] * tl.load(part_ptr + offs, mask=h_mask[:, None], other=0.0)
        acc1 += w[:, None] * tl.load(part_ptr + offs + _TILE, mask=h_mask[:, None], other=0.0)
        acc2 += w[:, None] * tl.load(part_ptr + offs + 2 * _TILE, mask=h_mask[:, None], other=0.0)
        acc3 += w[:, None] * tl.load(part_ptr + offs + 3 * _TILE, mask=h_mask[:, None], other=0.0)

    has_any = total > 0.0
    inv = tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)
    lse2 = tl.where(has_any, m_safe + tl.math.log2(tl.where(has_any, total, 1.0)), float("-inf"))
    _finalize(
        out_ptr, tok * out_stride_t, out_stride_h, lse_ptr, tok * lse_stride_t, lse_stride_h, sink_ptr,
        heads, h_mask, lse2, acc0 * inv[:, None], acc1 * inv[:, None], acc2 * inv[:, None],
        acc3 * inv[:, None], HAS_SINK, WRITE_LSE, LSE_BASE2, OUT_BF16,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def _as_int_bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as int16 bits (see the module docstring); others unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


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

    q: [T, H, 576], bfloat16 or float32, last dim contiguous
    kv_cache: [P, page_size, 656] uint8 (fp8_ds_mla) or [P, page_size, 576] bfloat16 (bf16);
        [num_slots, width] flat and page-strided views work too (last dim contiguous)
    indices: [T, topk], int32, global slots (page * page_size + row), -1 padded
    topk_length: [T], int32, optional; positions >= topk_length[t] are invalid
    sink: [H], float32, optional; out *= 1 / (1 + exp(sink - lse))
    out: [T, H, 512], q's dtype, optional; written in place and returned
    returns: out [T, H, 512] in q's dtype, and lse [T, H] float32 when ``return_lse`` (natural
        log when ``lse_base == "e"``, base 2 when ``"2"``)
    """
    return _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                sink=sink, out=out, return_lse=return_lse, lse_base=lse_base, config=None)


def _run(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, sink, out, return_lse, lse_base,
         config: LaunchConfig | None):
    """:func:`triton_sparse_mla` with an optional forced :class:`LaunchConfig` (tests use it)."""
    num_tokens, num_heads, _ = q.shape
    topk = indices.shape[1]
    device = q.device
    # The kernels index the last dim of q, indices and out with stride 1.
    q = q if q.stride(-1) == 1 else q.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    if out is not None and out.stride(-1) != 1:
        result = _run(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                      topk_length=topk_length, sink=sink, out=None, return_lse=return_lse,
                      lse_base=lse_base, config=config)
        out.copy_(result[0] if return_lse else result)
        return (out, result[1]) if return_lse else out
    if out is None:
        out = torch.empty(num_tokens, num_heads, layout.KV_LORA_RANK, dtype=q.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device) if return_lse else None
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    cfg = config or _launch_config(num_tokens, num_heads, topk, _num_sms(device))

    if kv_cache.dim() == 3:
        page_size = kv_cache.shape[1]
        page_stride, row_stride = kv_cache.stride(0), kv_cache.stride(1)
    else:
        page_size = 1
        page_stride = row_stride = kv_cache.stride(0)
    num_slots = kv_cache.shape[0] * page_size
    item = kv_cache.element_size()
    is_fp8 = kv_layout == layout.FP8_DS_MLA
    if is_fp8:
        # Three typed views of the same bytes: fp8 latent, fp32 scales, int16 rope bits. Torch
        # refuses the fp32 view when strides or the storage offset are not 4-byte multiples.
        kv_fp8 = kv_cache.view(torch.float8_e4m3fn)
        kv_f32 = kv_cache.view(torch.float32)
        kv_i16 = kv_cache.view(torch.int16)
    else:
        kv_i16 = kv_cache.view(torch.int16)
        kv_fp8 = kv_f32 = kv_i16  # unused by the bf16 path

    q_arg = _as_int_bits(q)
    interpret = _interpreting() or device.type == "cpu"
    out_bf16 = out.dtype == torch.bfloat16
    num_head_blocks = triton.cdiv(num_heads, cfg.block_h)
    final = cfg.num_splits == 1
    if final:
        part, part_lse = out, lse
        dummy = out  # never read when the flags below are off
    else:
        part = torch.empty(num_tokens, cfg.num_splits, num_heads, layout.KV_LORA_RANK,
                           dtype=torch.float32, device=device)  # [T, S, H, 512]
        part_lse = torch.empty(num_tokens, cfg.num_splits, num_heads, dtype=torch.float32, device=device)
        dummy = part
    part_arg = _as_int_bits(part)
    if part.dim() == 3:
        part_strides = (part.stride(0), 0, part.stride(1))
    else:
        part_strides = (part.stride(0), part.stride(1), part.stride(2))
    if part_lse is None:
        plse_arg, plse_strides = dummy, (0, 0, 0)
    elif part_lse.dim() == 2:
        plse_arg, plse_strides = part_lse, (part_lse.stride(0), 0, part_lse.stride(1))
    else:
        plse_arg, plse_strides = part_lse, part_lse.stride()

    _sparse_mla_kernel[(num_tokens, num_head_blocks, cfg.num_splits)](
        q_arg, q.stride(0), q.stride(1),
        kv_fp8, kv_i16, kv_f32, page_stride * item, row_stride * item, page_size, num_slots,
        indices, indices.stride(0), topk,
        topk_length if topk_length is not None else indices, sink if sink is not None else dummy,
        part_arg, *part_strides,
        plse_arg, *plse_strides,
        num_heads, float(sm_scale) * _LOG2E, cfg.blocks_per_split,
        IS_FP8=is_fp8, Q_BF16=q.dtype == torch.bfloat16, OUT_BF16=final and out_bf16,
        DOT_BF16=not interpret, HAS_TOPK_LEN=topk_length is not None,
        HAS_SINK=final and sink is not None, FINAL=final,
        WRITE_LSE=(not final) or return_lse, LSE_BASE2=(not final) or lse_base == "2",
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    if not final:
        lse_arg = lse if lse is not None else part_lse
        _combine_kernel[(num_tokens, num_head_blocks)](
            part, *part.stride()[:3],
            part_lse, *part_lse.stride(),
            sink if sink is not None else part,
            _as_int_bits(out), out.stride(0), out.stride(1),
            lse_arg, lse_arg.stride(0), lse_arg.stride(-1),
            num_heads, cfg.num_splits,
            HAS_SINK=sink is not None, WRITE_LSE=return_lse, LSE_BASE2=lse_base == "2",
            OUT_BF16=out_bf16, BLOCK_H=cfg.block_h,
        )
    return (out, lse) if return_lse else out
