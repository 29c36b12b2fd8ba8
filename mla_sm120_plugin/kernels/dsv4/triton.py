"""A portable Triton kernel for DeepSeek-V4 attention: a window cache and a compressed cache in one call.

Contract: :func:`dsv4_attention` computes :mod:`.reference`'s math (one softmax over both caches'
candidates, the sink logit in the denominator only, V = K = the whole 512-wide row, zeros for a
token with no candidate) over either record of :mod:`.layout` (the 584-byte fp8 one, the
384-byte NVFP4 one). Masked, never read: a slot < 0, a slot >= the cache's capacity (pages x page
size), a position at or past the row's length. Each cache has its own page size and page stride
(runtime arguments).

Structure: one program takes one query token, ``BLOCK_H`` heads and one split: a range of the
window's index row followed by the compressed cache's, ``BLOCK_N`` candidates a step
(:func:`_attend`), with an online softmax in base 2. The split count is :mod:`.plan`'s (shapes
only); several splits write fp32 partials that :mod:`..shared.combine` merges, applying the sink
once. A candidate's row is dequantized exactly (each NoPE value times its group's scale, the bf16
rope as is), so the key/value tile is exact in bf16; scores and the weighted sum
are bf16 x bf16 dots accumulated in fp32 (:func:`~mla_sm120_plugin.kernels.shared.triton.dot`).

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
from mla_sm120_plugin.kernels.shared.host import LOG2E, cdiv, interpreting
from mla_sm120_plugin.kernels.shared.launch_plan import gpu_family
from mla_sm120_plugin.kernels.shared.triton import LOG2E_K, Launch, dot, e2m1, e8m0_value, store_rounded

REC = layout.FP8_RECORD

_HEAD: tl.constexpr = tl.constexpr(layout.HEAD_DIM)
_NOPE: tl.constexpr = tl.constexpr(layout.NOPE_DIM)
_GROUP: tl.constexpr = tl.constexpr(layout.SCALE_GROUP)
_DATA: tl.constexpr = tl.constexpr(layout.DATA_ROW_BYTES)
_SCALES: tl.constexpr = tl.constexpr(layout.SCALE_ROW_BYTES)
_FP4_DATA: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.data_bytes)
_FP4_SCALES: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.scale_bytes)
_FP4_NOPE_BYTES: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.nope_bytes)
_FP4_GROUP: tl.constexpr = tl.constexpr(layout.NVFP4_RECORD.scale_group)


Dsv4Config = plan.Dsv4Config


def default_config(record: layout.Dsv4Record) -> Dsv4Config:
    """The record's block shape, unsplit."""
    return plan.shape_of(record).config


@triton.jit
def _attend(q, cache_ptr, idx_ptr, idx_row, lo, hi, page_size, page_stride, capacity, m_i, l_i, acc, qk_scale_log2,
            BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr, NVFP4: tl.constexpr):
    """Fold candidates ``[lo, hi)`` of one index row of one cache into the softmax state."""
    cols = tl.arange(0, _HEAD)
    nope = cols < _NOPE
    cache_f8 = cache_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    cache_b16 = cache_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if NVFP4:  # 224 bytes of e2m1 pairs + 64 bf16; 28 e4m3 scales (one per 16) + 4 pad bytes
        data_bytes: tl.constexpr = _FP4_DATA
        scale_bytes: tl.constexpr = _FP4_SCALES
        rope_at: tl.constexpr = _FP4_NOPE_BYTES
    else:  # 448 e4m3 + 64 bf16; 7 UE8M0 exponents (one per 64) + 1 pad byte
        data_bytes: tl.constexpr = _DATA
        scale_bytes: tl.constexpr = _SCALES
        rope_at: tl.constexpr = _NOPE
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + idx_row + pos, mask=pos < hi, other=-1)
        valid = (idx >= 0) & (idx < capacity)
        slot = tl.where(valid, idx, 0).to(tl.int64)
        base = (slot // page_size) * page_stride
        data = base + (slot % page_size) * data_bytes
        scales = base + page_size * data_bytes + (slot % page_size) * scale_bytes
        in_nope = valid[:, None] & nope[None, :]
        if NVFP4:
            packed = tl.load(cache_ptr + data[:, None] + cols[None, :] // 2, mask=in_nope, other=0)
            code = ((packed >> ((cols[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.int32)
            scale = tl.load(cache_f8 + scales[:, None] + cols[None, :] // _FP4_GROUP, mask=in_nope,
                            other=0.0).to(tl.float32)
            value = e2m1(code) * scale  # <= 6 significant bits: exact in bf16
        else:
            byte = tl.load(cache_ptr + scales[:, None] + cols[None, :] // _GROUP, mask=in_nope, other=0)
            value = tl.load(cache_f8 + data[:, None] + cols[None, :], mask=in_nope, other=0.0).to(tl.float32)
            value = value * e8m0_value(byte)  # 2 ** (byte - 127), exact
        rope = tl.load(cache_b16 + (data[:, None] + rope_at) // 2 + (cols[None, :] - _NOPE),
                       mask=valid[:, None] & (cols[None, :] >= _NOPE), other=0.0).to(tl.float32)
        k = tl.where(nope[None, :], value, rope)  # [BLOCK_N, 512], exact in bf16
        s = dot(q, tl.trans(k), DOT_BF16) * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, k, DOT_BF16)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=("head_blocks", "steps", "num_splits"))
def _dsv4_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    swa_ptr, swa_idx_ptr, swa_len_ptr, extra_ptr, extra_idx_ptr, extra_len_ptr,
    num_heads, q_stride_t, q_stride_h, out_stride_t, out_stride_s, out_stride_h, lse_stride_t, lse_stride_s,
    swa_idx_stride, swa_width, swa_page, swa_page_stride, swa_capacity,
    extra_idx_stride, extra_width, extra_page, extra_page_stride, extra_capacity,
    qk_scale_log2, head_blocks, steps, num_splits,
    FINAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, HAS_SWA_LEN: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr,
    NVFP4: tl.constexpr,
):
    """One (token, head block, split): the split's share of the call's ``steps`` steps of ``BLOCK_N``
    candidates (steps ``[split * steps // num_splits, (split + 1) * steps // num_splits)``: ranges
    differ by at most one step) of the window's index row followed by the compressed one's
    (positions by the rows' widths, so the cut depends on shapes only). ``FINAL`` (one split): the
    sink applied and ``out`` written; otherwise the range's normalized fp32 partial and base-2 LSE,
    which :mod:`..shared.combine` merges. A token's head blocks are neighbours in the grid's first
    axis, so they run side by side and read the same rows at about the same time (L2 serves all but
    the first; the plan's traffic model counts a row once a token)."""
    pid = tl.program_id(0)
    tok = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    h_mask = heads < num_heads
    cols = tl.arange(0, _HEAD)
    q = tl.load(q_ptr + tok * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h + cols[None, :],
                mask=h_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, _HEAD], tl.float32)
    lo = (split * steps // num_splits) * BLOCK_N
    hi = ((split + 1) * steps // num_splits) * BLOCK_N
    n = swa_width
    if HAS_SWA_LEN:
        n = tl.minimum(tl.maximum(tl.load(swa_len_ptr + tok), 0), swa_width)
    m_i, l_i, acc = _attend(q, swa_ptr, swa_idx_ptr, tok * swa_idx_stride, tl.minimum(lo, n), tl.minimum(hi, n),
                            swa_page, swa_page_stride, swa_capacity, m_i, l_i, acc, qk_scale_log2, BLOCK_N, DOT_BF16,
                            NVFP4)
    if HAS_EXTRA:
        n = extra_width
        if HAS_EXTRA_LEN:
            n = tl.minimum(tl.maximum(tl.load(extra_len_ptr + tok), 0), extra_width)
        e_lo = tl.minimum(tl.maximum(lo - swa_width, 0), n)
        e_hi = tl.minimum(tl.maximum(hi - swa_width, 0), n)
        m_i, l_i, acc = _attend(q, extra_ptr, extra_idx_ptr, tok * extra_idx_stride, e_lo, e_hi, extra_page,
                                extra_page_stride, extra_capacity, m_i, l_i, acc, qk_scale_log2, BLOCK_N, DOT_BF16,
                                NVFP4)
    out_rows = out_ptr + tok * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h + cols[None, :]
    if FINAL:
        if HAS_SINK:
            # the sink is a natural-log logit; the scores are base 2
            sink = tl.load(sink_ptr + heads, mask=h_mask, other=float("-inf")) * LOG2E_K
            l_i += tl.math.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        found = (m_i > float("-inf"))[:, None]
        out = tl.where(found, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
        store_rounded(out_rows, out, h_mask[:, None])
    else:
        # an empty range stores zeros and an LSE of -inf: the combine gives it no weight
        has_any = l_i > 0.0
        inv_l = tl.where(has_any, 1.0 / tl.where(has_any, l_i, 1.0), 0.0)
        lse2 = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(out_rows + split * out_stride_s, acc * inv_l[:, None], mask=h_mask[:, None])
        tl.store(lse_ptr + tok * lse_stride_t + split * lse_stride_s + heads, lse2, mask=h_mask)


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
    candidates = swa_indices.shape[1] + (extra_indices.shape[1] if extra else 0)
    head_blocks = cdiv(heads, cfg.block_h)
    # The cap binds the one variant ptxas builds past it (NVFP4, two caches, unsplit: 156 registers,
    # one CTA an SM); on the others, which it builds at <= 128 uncapped, a cap makes it spill a few bytes.
    maxnreg = cfg.maxnreg if final and extra else None
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
              swa_indices.stride(0), swa_indices.shape[1], swa_page_size, swa_cache.stride(0),
              swa_cache.shape[0] * swa_page_size,
              extra_indices.stride(0) if extra else 0, extra_indices.shape[1] if extra else 0,
              extra_page_size if extra else 1, extra_cache.stride(0) if extra else 0,
              extra_cache.shape[0] * extra_page_size if extra else 0,
              sm_scale * LOG2E, head_blocks, cfg.steps(candidates), cfg.num_splits),
        constexprs=dict(FINAL=final, NVFP4=record.nope_bits == 4, HAS_EXTRA=extra,
                        HAS_SINK=final and sinks is not None, HAS_SWA_LEN=swa_lengths is not None,
                        HAS_EXTRA_LEN=extra and extra_lengths is not None, BLOCK_H=cfg.block_h,
                        BLOCK_N=cfg.block_n, DOT_BF16=not interpret),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=maxnreg,
        describe=dict(kernel="dsv4", record=record.name, extra=extra, sink=sinks is not None,
                      out=str(dest.dtype).replace("torch.", ""), final=int(final), block_h=cfg.block_h,
                      block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages,
                      **({} if maxnreg is None else {"maxnreg": maxnreg})),
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
