"""The torch reference for DeepSeek-V4 attention: a window cache and a compressed cache in one call.

For query token ``t`` and head ``h``, over the candidates of both caches together (docs/facts.md#deepseek-v4)::

    s_j   = sm_scale * <q[t, h], k_j>                      k_j: a dequantized 512-wide row
    out   = sum_j exp(s_j - m) k_j / (sum_j exp(s_j - m) + exp(sink[h] - m))
    m     = max(max_j s_j, sink[h])

V is K (the whole row, rope included); the sink is a logit in natural-log units that adds to the
denominator only (``-inf``: none). A candidate is slot ``idx`` at position ``i`` of the row when
``i < length`` and ``0 <= idx < capacity`` (-1 padding and out-of-range ids are masked, never
read). A token with no candidate in either cache gets zeros. Computed in fp32 on the dequantized
rows, chunked over tokens so memory stays bounded; returns bf16 (and the natural-log LSE without
the sink, when asked). A float64 q is the truth: float64 throughout, returned in float64.
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsv4 import layout, pack

REC = layout.FP8_RECORD
_CHUNK_TOKENS = 16


def _bad(given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(given, supported, fix))


def _check_part(name: str, cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None,
                page_size: int, tokens: int, record: layout.Dsv4Record) -> None:
    if cache.dim() != 2 or cache.dtype != torch.uint8:
        raise _bad(f"{name}_cache of shape {tuple(cache.shape)}, dtype {cache.dtype}",
                   f"[pages, page_stride] uint8 (page-major {record.token_bytes}-byte records)",
                   "pass the engine's cache as bytes")
    if not isinstance(page_size, int) or page_size < 1 or cache.shape[1] < page_size * record.token_bytes:
        raise _bad(f"{name}_page_size={page_size!r} for pages of {cache.shape[1]} bytes",
                   f"a positive page size with page_size x {record.token_bytes} <= page bytes",
                   "pass the cache's own page size (entries a page)")
    if indices.dim() != 2 or indices.shape[0] != tokens or indices.dtype not in (torch.int32, torch.int64):
        raise _bad(f"{name}_indices of shape {tuple(indices.shape)}, dtype {indices.dtype}",
                   f"[{tokens}, K] int32 global slots (page * page_size + row; -1 pads)", "pass one index row a token")
    if lengths is not None and (lengths.shape != (tokens,) or lengths.dtype not in (torch.int32, torch.int64)):
        raise _bad(f"{name}_lengths of shape {tuple(lengths.shape)}, dtype {lengths.dtype}", f"[{tokens}] int32",
                   "pass one length a token (or None: the whole row)")


def _part(cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None,
          page_size: int, dtype: torch.dtype, record: layout.Dsv4Record) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized candidate rows [T, K, 512] (zeros where masked) and the mask [T, K]."""
    idx = indices.to(torch.int64)
    capacity = cache.shape[0] * page_size
    valid = (idx >= 0) & (idx < capacity)
    if lengths is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid &= pos[None, :] < lengths.to(torch.int64)[:, None]
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    rows = pack.gather(cache, safe.reshape(-1), page_size, record).reshape(*idx.shape, REC.head_dim).to(dtype)
    return torch.where(valid[..., None], rows, torch.zeros_like(rows)), valid


def dsv4_attention_reference(
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
    return_lse: bool = False,
    record: layout.Dsv4Record = REC,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 attention over a window cache and (optionally) a compressed cache.

    :param q: [T, H, 512] bf16 (or fp32) queries; float64: computed and returned in float64 (the truth
        a kernel is measured against).
    :param swa_cache: [pages, page_stride] uint8, the window cache (page-major 584-byte records).
    :param swa_indices: [T, W] int32 global window slots; -1 pads.
    :param swa_page_size: entries a window page holds.
    :param sm_scale: the softmax scale (512 ** -0.5 for DeepSeek-V4).
    :param swa_lengths: [T] int32: how many of each row's slots count (None: all).
    :param extra_cache: [pages, page_stride] uint8, the compressed cache, or None.
    :param extra_indices: [T, K] int32 global compressed slots; -1 pads.
    :param extra_lengths: [T] int32 or None.
    :param extra_page_size: entries a compressed page holds.
    :param sinks: [H] float32 sink logits (natural log), or None.
    :param record: the caches' record (:data:`.layout.FP8_RECORD`, or :data:`.layout.NVFP4_RECORD`).
    :param return_lse: also return the natural-log LSE of the scores ([T, H] fp32, sink excluded;
        -inf for a token with no candidate).
    :returns: [T, H, 512] bf16, float64 for a float64 q (and the LSE).
    :raises KernelInputError: a tensor of the wrong shape or dtype.
    """
    if q.dim() != 3 or q.shape[2] != REC.head_dim or not q.dtype.is_floating_point:
        raise _bad(f"q of shape {tuple(q.shape)}, dtype {q.dtype}", f"[T, H, {REC.head_dim}] bf16",
                   "pass the layer's queries (after norm and rope)")
    tokens, heads, _ = q.shape
    _check_part("swa", swa_cache, swa_indices, swa_lengths, swa_page_size, tokens, record)
    if (extra_cache is None) != (extra_indices is None):
        raise _bad("only one of extra_cache / extra_indices", "both or neither", "pass the compressed cache with its indices")
    if extra_cache is not None:
        if extra_page_size is None:
            raise _bad("extra_page_size=None with a compressed cache", "its page size", "pass extra_page_size")
        _check_part("extra", extra_cache, extra_indices, extra_lengths, extra_page_size, tokens, record)
    if sinks is not None and (sinks.shape != (heads,) or not sinks.dtype.is_floating_point):
        raise _bad(f"sinks of shape {tuple(sinks.shape)}, dtype {sinks.dtype}", f"[{heads}] float32", "one logit a head")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(tokens, heads, REC.head_dim, dtype=torch.float64 if work == torch.float64 else torch.bfloat16,
                      device=q.device)
    lse = torch.empty(tokens, heads, dtype=work, device=q.device)
    sink = (sinks.to(work) if sinks is not None else torch.full((heads,), float("-inf"), dtype=work, device=q.device))
    for start in range(0, tokens, _CHUNK_TOKENS):
        end = min(start + _CHUNK_TOKENS, tokens)
        rows, valid = _part(swa_cache, swa_indices[start:end], None if swa_lengths is None else swa_lengths[start:end],
                            swa_page_size, work, record)
        if extra_cache is not None:
            extra_rows, extra_valid = _part(extra_cache, extra_indices[start:end],
                                            None if extra_lengths is None else extra_lengths[start:end], extra_page_size,
                                            work, record)
            rows, valid = torch.cat([rows, extra_rows], 1), torch.cat([valid, extra_valid], 1)
        scores = torch.einsum("thd,tkd->thk", q[start:end].to(work), rows) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        top = torch.maximum(scores.amax(-1), sink[None, :])
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(scores - top[..., None])
        denom = weights.sum(-1) + torch.exp(sink[None, :] - top)
        any_valid = valid.any(-1)[:, None]
        result = torch.einsum("thk,tkd->thd", weights, rows) / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
        out[start:end] = torch.where(any_valid[..., None], result, torch.zeros_like(result)).to(out.dtype)
        lse[start:end] = torch.where(any_valid, torch.log(weights.sum(-1)) + top, torch.full_like(top, float("-inf")))
    return (out, lse) if return_lse else out
