"""Writers of DeepSeek-V4's 384-byte NVFP4 record (:data:`.layout.NVFP4_RECORD`) for vLLM's layer.

vLLM writes DeepSeek-V4's caches in two places, the layer's fused q-norm / rope / KV insert (the
window cache) and its compressor (an entry every ``ratio`` tokens); these are the same two steps
writing the NVFP4 record:

- :func:`insert_rows`: the window rows. ``kv`` (already RMS-normed by the layer) gets GPT-J rope on
  its last 64 values at the token's position, is rounded to bf16, and is stored as the record.
- :func:`compress_insert`: the compressed rows. For a token that closes a ``ratio`` block, the
  ``(1 + overlap) * ratio`` saved states up to it are softmax-weighted (per value, over the
  states), summed, RMS-normed, roped at the block's first position, rounded to bf16 and stored.
- :func:`normed_roped_query`: q as vLLM's fused op returns it, in torch.

The bytes are :func:`.pack.quantize_nvfp4`'s, computed from the bits in the kernel (exact on a GPU
and under the interpreter). One program a token; a slot < 0 or past the cache is skipped, and so
is a token whose state slot is < 0 or that does not close a block; two tokens given one slot race,
as in vLLM's own writers (vLLM never gives one slot twice in a step). Design notes: docs/kernels.md,
section ``kernels/dsv4/nvfp4_writer.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsv4 import layout
from mla_sm120_plugin.kernels.shared.triton import Launch, round_bf16

REC = layout.NVFP4_RECORD
_HEAD: tl.constexpr = tl.constexpr(layout.HEAD_DIM)
_NOPE: tl.constexpr = tl.constexpr(layout.NOPE_DIM)
_HALF_ROPE: tl.constexpr = tl.constexpr(layout.ROPE_DIM // 2)
_GROUP: tl.constexpr = tl.constexpr(REC.scale_group)
_SCALES: tl.constexpr = tl.constexpr(REC.num_scales)
_DATA: tl.constexpr = tl.constexpr(REC.data_bytes)
_SCALE_ROW: tl.constexpr = tl.constexpr(REC.scale_bytes)
_NOPE_BYTES: tl.constexpr = tl.constexpr(REC.nope_bytes)
_E4M3_MAX: tl.constexpr = tl.constexpr(layout.E4M3_MAX)
WINDOW_WARPS = 4
COMPRESS_CHUNK = 8  # states a step of the compressor writer's loop: [8, 512] scores and values


@triton.jit
def _exponent(v):
    """``floor(log2(v))`` of positive normal fp32 values, from the bits (int32)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _e4m3_scale(amax):
    """``e4m3(amax * f32(1/6))`` rounded to nearest even, saturating at 448: (value fp32, byte int32)."""
    v = tl.minimum(amax * (1.0 / 6.0), _E4M3_MAX)
    e = tl.maximum(_exponent(tl.maximum(v, 1e-30)), -6)  # below 2**-6: the subnormal step 2**-9
    step = (((e - 3) + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # powers of two: exact products
    # v / step < 16: adding 1.5 * 2**23 rounds it to an integer, ties to even (fp32 addition)
    q = ((v * inv_step + 12582912.0) - 12582912.0) * step
    eq = _exponent(tl.maximum(q, 1e-30))
    normal = q >= 0.015625
    mant = tl.where(normal, q * ((127 - eq) << 23).to(tl.float32, bitcast=True) * 8.0 - 8.0, q * 512.0)
    byte = tl.where(normal, (eq + 7) * 8, 0) + mant.to(tl.int32)
    return q, byte


@triton.jit
def _e2m1_code(x):
    """fp32 -> e2m1 nibble (int32): nearest, ties to even, saturating at 6, sign bit 3 (-0 kept)."""
    a = tl.abs(x)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _rope_and_store(x, rope_pos, cs_ptr, cs_stride, cache_ptr, slot, page_size, page_stride):
    """GPT-J rope on ``x``'s last 64 values at ``rope_pos``, bf16, then the 384-byte record at ``slot``."""
    d = tl.arange(0, _HEAD)
    even, odd = tl.split(tl.reshape(x, (_HEAD // 2, 2)))
    pair = tl.arange(0, _HEAD // 2) - _NOPE // 2
    in_rope = pair >= 0
    cs = cs_ptr + rope_pos * cs_stride + tl.maximum(pair, 0)
    cos = tl.load(cs, mask=in_rope, other=1.0).to(tl.float32)
    sin = tl.load(cs + _HALF_ROPE, mask=in_rope, other=0.0).to(tl.float32)
    rotated = tl.interleave(even * cos - odd * sin, odd * cos + even * sin)
    # bf16, nearest even (the interpreter's own cast truncates); the NoPE values untouched (-0 stays -0)
    row = round_bf16(tl.where(d >= _NOPE, rotated, x))

    groups = tl.reshape(row, (_HEAD // _GROUP, _GROUP))
    scale, byte = _e4m3_scale(tl.max(tl.abs(groups), axis=1))
    inv = tl.where(scale == 0.0, 0.0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32),
                                                      tl.where(scale == 0.0, 1.0, scale)))
    codes = tl.reshape(_e2m1_code(groups * inv[:, None]), (_HEAD,))
    lo, hi = tl.split(tl.reshape(codes, (_HEAD // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)

    base = (slot // page_size) * page_stride
    data = base + (slot % page_size) * _DATA
    pairs = tl.arange(0, _HEAD // 2)
    tl.store(cache_ptr + data + pairs, packed, mask=pairs < _NOPE_BYTES)
    rope_ptr = (cache_ptr + data + _NOPE_BYTES).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tl.store(rope_ptr + (d - _NOPE), row.to(tl.bfloat16), mask=d >= _NOPE)
    g = tl.arange(0, _HEAD // _GROUP)  # 32 scale bytes: 28 scales, then 4 zero bytes
    scales = base + page_size * _DATA + (slot % page_size) * _SCALE_ROW
    tl.store(cache_ptr + scales + g, tl.where(g < _SCALES, byte, 0).to(tl.uint8))


@triton.jit
def _insert_rows_kernel(rows_ptr, row_stride, slot_ptr, pos_ptr, cs_ptr, cs_stride, cache_ptr, page_size,
                        page_stride, capacity):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < capacity):
        x = tl.load(rows_ptr + t * row_stride + tl.arange(0, _HEAD)).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        _rope_and_store(x, pos, cs_ptr, cs_stride, cache_ptr, slot, page_size, page_stride)


@triton.jit
def _compress_insert_kernel(state_ptr, state_s0, state_s1, state_slot_ptr, req_ptr, table_ptr, table_stride,
                            state_block, norm_ptr, eps, slot_ptr, pos_ptr, cs_ptr, cs_stride, cache_ptr, page_size,
                            page_stride, capacity, RATIO: tl.constexpr, WIN: tl.constexpr,
                            STATE_WIDTH: tl.constexpr, CHUNK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    state_slot = tl.load(state_slot_ptr + t)
    if (slot >= 0) & (slot < capacity) & (state_slot >= 0) & ((pos + 1) % RATIO == 0):
        req = tl.load(req_ptr + t).to(tl.int64)
        d = tl.arange(0, _HEAD)
        # a softmax over the states for each of the 512 values, CHUNK states at a time (online: C128A's
        # 128 x 512 scores and values at once would spill)
        m = tl.full((_HEAD,), float("-inf"), tl.float32)
        den = tl.zeros((_HEAD,), tl.float32)
        acc = tl.zeros((_HEAD,), tl.float32)
        for first in range(0, WIN, CHUNK):
            j = first + tl.arange(0, CHUNK)
            p = pos - WIN + 1 + j
            ok = p >= 0
            blk = tl.load(table_ptr + req * table_stride + tl.where(ok, p, 0) // state_block, mask=ok, other=0)
            # the first `ratio` states read the first half of an overlapping state row, the rest the second
            row = (blk.to(tl.int64) * state_s0 + (tl.where(ok, p, 0) % state_block) * state_s1
                   + (j >= RATIO).to(tl.int64) * _HEAD)
            score = tl.load(state_ptr + row[:, None] + STATE_WIDTH + d[None, :], mask=ok[:, None],
                            other=float("-inf")).to(tl.float32)
            kv = tl.load(state_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            m_new = tl.maximum(m, tl.max(score, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
            alpha = tl.exp(m - m_safe)
            w = tl.exp(score - m_safe[None, :])
            den = den * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(kv * w, axis=0)
            m = m_new
        c = acc / den
        normed = c * (1.0 / tl.sqrt(tl.sum(c * c, axis=0) / _HEAD + eps)) * tl.load(norm_ptr + d).to(tl.float32)
        _rope_and_store(normed, (pos // RATIO) * RATIO, cs_ptr, cs_stride, cache_ptr, slot, page_size, page_stride)


def _bad(argument: str, given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(f"{argument}: {given}", supported, fix))


def _cache_pages(cache: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """An engine's NVFP4 cache view (``[pages, P, 384]`` or ``[pages, P, 1, 384]``, uint8) as (base
    tensor, page size, page stride, capacity in slots)."""
    if cache.dtype != torch.uint8 or cache.dim() not in (3, 4) or cache.shape[-1] != REC.token_bytes or (
            cache.dim() == 4 and cache.shape[2] != 1):
        raise _bad("cache", f"shape {tuple(cache.shape)}, dtype {cache.dtype}",
                   f"[pages, P, {REC.token_bytes}] or [pages, P, 1, {REC.token_bytes}] uint8 (the 384-byte record)",
                   "pass the layer's bound NVFP4 cache")
    page_size = cache.shape[1]
    if cache.stride(-1) != 1 or (cache.shape[0] > 1 and cache.stride(0) < page_size * REC.token_bytes):
        raise _bad("cache", f"strides {cache.stride()}", f"pages >= {page_size} x {REC.token_bytes} bytes apart",
                   "pass the layer's bound cache view")
    return cache, page_size, cache.stride(0), cache.shape[0] * page_size


def _check_rope(cos_sin_cache: torch.Tensor) -> None:
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != layout.ROPE_DIM or cos_sin_cache.stride(1) != 1:
        raise _bad("cos_sin_cache", f"shape {tuple(cos_sin_cache.shape)}, strides {cos_sin_cache.stride()}",
                   f"[max_position, {layout.ROPE_DIM}] (32 cos then 32 sin a position), unit inner stride",
                   "pass the layer's rotary_emb.cos_sin_cache")


def insert_rows(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> None:
    """Rope ``kv`` at ``positions`` and store it at ``slots`` as the 384-byte record.

    :param cache: [pages, P, 384] (or [pages, P, 1, 384]) uint8, page-major, pages ``stride(0)`` apart.
    :param kv: [>= T, 512] bfloat16 rows, RMS-normed, rope not yet applied (rows past T: padding).
    :param slots: [T] int32/int64 global slots (``page * P + row``); < 0 or past the cache: skipped.
    :param positions: [>= T] int64 token positions (the rope's).
    :param cos_sin_cache: [max_position, 64] float (32 cos then 32 sin a position).
    """
    base, page_size, page_stride, capacity = _cache_pages(cache)
    tokens = slots.shape[0]
    if kv.dim() != 2 or kv.shape[1] != layout.HEAD_DIM or kv.stride(1) != 1:
        raise _bad("kv", f"shape {tuple(kv.shape)}, strides {kv.stride()}", "[T, 512] rows, unit inner stride",
                   "pass the layer's normed KV rows")
    if slots.dim() != 1 or kv.shape[0] < tokens or positions.shape[0] < tokens:
        raise _bad("slots / kv / positions", f"shapes {tuple(slots.shape)} / {tuple(kv.shape)} / "
                   f"{tuple(positions.shape)}", "[T] slots, at least T rows and T positions",
                   "pass the step's slot mapping, KV rows and positions")
    _check_rope(cos_sin_cache)
    if tokens:
        window_launch(kv, slots, positions, cos_sin_cache, base, page_size, page_stride, capacity).run()


def window_launch(kv, slots, positions, cos_sin_cache, base, page_size, page_stride, capacity) -> Launch:
    """The window writer's launch (what :func:`insert_rows` runs and the compile gate compiles)."""
    return Launch(kernel=_insert_rows_kernel, grid=(slots.shape[0],),
                  args=(kv, kv.stride(0), slots, positions, cos_sin_cache, cos_sin_cache.stride(0), base, page_size,
                        page_stride, capacity),
                  constexprs={}, num_warps=WINDOW_WARPS, num_stages=1,
                  describe=dict(kernel="dsv4_nvfp4_write", rows="window", warps=WINDOW_WARPS))


def compress_insert(cache: torch.Tensor, slots: torch.Tensor, *, state_cache: torch.Tensor,
                    state_slots: torch.Tensor, token_to_req: torch.Tensor, block_table: torch.Tensor,
                    state_block: int, state_width: int, positions: torch.Tensor, ratio: int, overlap: bool,
                    norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> None:
    """Compress the saved states into ``cache`` as the 384-byte record (vLLM's compressor step).

    :param cache: [pages, P, 384] uint8 compressed cache (P = tokens a page // ratio).
    :param slots: [T] compressed-cache slots for the step's tokens (-1: none).
    :param state_cache: [blocks, state_block, 2 * state_width] float32: kv states then score states,
        each ``(1 + overlap) * 512`` wide.
    :param state_slots: [T] the tokens' state slots (< 0: padding, skipped).
    :param token_to_req: [T] int32 request of each token; ``block_table``: [R, max_blocks] int32.
    :param state_block: tokens a state block holds; ``state_width``: the kv half's width.
    :param positions: [T] int64; ``ratio``: tokens an entry; ``overlap``: C4A's two-block window.
    :param norm_weight: [512] the compressor's RMSNorm weight; ``eps`` its epsilon.
    :param cos_sin_cache: [max_position, 64] float.
    """
    base, page_size, page_stride, capacity = _cache_pages(cache)
    tokens = slots.shape[0]
    win = (1 + int(overlap)) * ratio
    if win & (win - 1) or state_cache.dim() != 3 or state_cache.stride(2) != 1 or state_width < win // ratio * 512:
        raise _bad("ratio / overlap / state_cache", f"ratio={ratio}, overlap={overlap}, state shape "
                   f"{tuple(state_cache.shape)}, state_width={state_width}",
                   "a power-of-two window of states and [blocks, block, 2 x (1 + overlap) x 512] float states",
                   "pass the compressor's own state cache and ratio")
    _check_rope(cos_sin_cache)
    if tokens:
        compress_launch(slots, state_cache, state_slots, token_to_req, block_table, state_block, state_width,
                        positions, ratio, win, norm_weight, eps, cos_sin_cache, base, page_size, page_stride,
                        capacity).run()


def compress_launch(slots, state_cache, state_slots, token_to_req, block_table, state_block, state_width, positions,
                    ratio, win, norm_weight, eps, cos_sin_cache, base, page_size, page_stride, capacity) -> Launch:
    """The compressor writer's launch (what :func:`compress_insert` runs and the compile gate compiles)."""
    return Launch(kernel=_compress_insert_kernel, grid=(slots.shape[0],),
                  args=(state_cache, state_cache.stride(0), state_cache.stride(1), state_slots, token_to_req,
                        block_table, block_table.stride(0), state_block, norm_weight, float(eps), slots, positions,
                        cos_sin_cache, cos_sin_cache.stride(0), base, page_size, page_stride, capacity),
                  constexprs=dict(RATIO=ratio, WIN=win, STATE_WIDTH=state_width, CHUNK=min(win, COMPRESS_CHUNK)),
                  num_warps=compress_warps(win),
                  num_stages=1, describe=dict(kernel="dsv4_nvfp4_write", rows=f"c{ratio}a", states=win,
                                              warps=compress_warps(win)))


def compress_warps(win: int) -> int:
    """Warps for a ``win``-state compression (states are read :data:`COMPRESS_CHUNK` at a time)."""
    return 4


def normed_roped_query(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, padded_heads: int,
                       eps: float) -> torch.Tensor:
    """q as vLLM's fused DeepSeek-V4 insert returns it: [T, padded_heads, 512] bfloat16.

    :param q: [T, H, 512] bfloat16 (the q projection's heads).
    :param positions: [T] int64; ``cos_sin_cache``: [max_position, 64].
    :param padded_heads: the layer's padded q heads (>= H; the extra heads are zeros).
    :param eps: the layer's RMS-norm epsilon (the norm has no weight).
    """
    tokens, heads, width = q.shape
    x = q.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    cs = cos_sin_cache[positions[:tokens]].float()[:, None, :]
    cos, sin = cs[..., : layout.ROPE_DIM // 2], cs[..., layout.ROPE_DIM // 2:]
    even, odd = x[..., layout.NOPE_DIM::2], x[..., layout.NOPE_DIM + 1::2]
    rope = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    out = q.new_zeros(tokens, padded_heads, width)
    out[:, :heads, : layout.NOPE_DIM] = x[..., : layout.NOPE_DIM].to(q.dtype)
    out[:, :heads, layout.NOPE_DIM:] = rope.to(q.dtype)
    return out
