"""Torch reference of sparse MLA: the ground truth every other kernel is tested against.

Semantics (the engines' sparse-MLA contract, docs/facts.md#sparse-mla-semantics): for token ``t`` and head ``h``,
``s_j = sm_scale * <q[t, h], K_j>`` over the valid slots ``j`` of ``indices[t]``, where
``K_j = [dequant(latent_j), rope_j]`` (``layout.head_dim`` wide: 576 for the DSA layouts, 512 for
the rope-less ones, which have no ``rope_j``) and ``V_j = K_j[:512]``;
``out = softmax(s) @ V`` and ``lse = logsumexp(s)``. A slot is invalid when it is ``-1``, outside
``[0, num_slots)``, or at a position ``>= topk_length[t]``. Invalid slots are never read: their
index is replaced by slot 0 before the gather and the gathered row is zeroed, so neither the bytes
behind an out-of-range id nor a NaN in slot 0 can reach the result. A row with no valid slot gives
``out = 0`` and ``lse = -inf``.

Runs on any device torch runs on. Inputs are not validated here: the public entry
:func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward` validates once. The fp32 matmuls follow torch's
fp32 matmul precision setting (exact fp32 unless TF32 was enabled for matmuls).
"""

from __future__ import annotations

import math

import torch

from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa.pack import dequantize

DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024

_INDEX_BYTES = 8 * 4  # int64 slot ids, their page and row, and the bool mask, per candidate


def bytes_per_token(num_heads: int, topk: int, kv_layout: str) -> int:
    """Upper bound on the temporary bytes the reference holds for one query token.

    Per candidate: index arithmetic (:data:`_INDEX_BYTES`), the gathered raw row (the layout's
    ``token_bytes``), the fp32 dequantized row (``head_dim`` x 4 B) plus one fp32 row of
    dequantization scratch. Per head and candidate: the fp32 scores and up to three score-sized
    temporaries inside ``logsumexp`` (not all visible to a tensor-level measurement, hence the
    margin). Per head: the fp32 copy of q (``head_dim`` wide), the fp32 output and its
    dtype-converted copy (``latent`` wide).
    """
    lay = layout.get(kv_layout)
    per_candidate = _INDEX_BYTES + lay.token_bytes + 2 * lay.head_dim * 4
    per_head = 4 * topk * 4 + (lay.head_dim + 2 * lay.latent) * 4
    return topk * per_candidate + num_heads * per_head


def tokens_per_chunk(num_heads: int, topk: int, kv_layout: str, max_chunk_bytes: int) -> int:
    """How many query tokens one chunk may hold so its temporaries stay within ``max_chunk_bytes``.

    At least 1: a single token whose temporaries exceed the bound is still processed, and then the
    bound is :func:`bytes_per_token` instead.
    """
    return max(1, max_chunk_bytes // bytes_per_token(num_heads, topk, kv_layout))


def _gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a paged or flat cache at (valid, in-range) global slots, without flattening.

    kv_cache: [P, page, W] (any page stride) or [S, W]
    slots: [c, K], int64, every value in [0, num_slots)
    returns: [c, K, W], contiguous
    """
    if kv_cache.dim() == 2:
        return kv_cache[slots]
    page_size = kv_cache.shape[1]
    return kv_cache[slots // page_size, slots % page_size]


def torch_sparse_mla(
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
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a paged KV cache, in torch, a chunk of query tokens at a time.

    Extra memory (beyond inputs and outputs) stays under ``max_chunk_bytes``: tokens are processed
    ``tokens_per_chunk(H, topk, kv_layout, max_chunk_bytes)`` at a time, each costing at most
    ``bytes_per_token(H, topk, kv_layout)``; a single token over the bound is still run alone. A
    naive full gather at T=4096, topk=2048 would need ~19 GB of fp32 keys.

    The contract (shapes, dtypes, masking) is :func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward`'s:

    q: [T, H, layout.head_dim], bfloat16, float32 or float64 (576 for the DSA layouts, 512 rope-less);
        float64 computes everything in float64 (the accuracy metrics' truth)
    kv_cache: [P, page_size, layout.row] in the layout's dtype (uint8 for fp8 layouts, bfloat16
        else); [num_slots, width] flat and page-strided views work too
    indices: [T, topk], int32, global slots (page * page_size + row), -1 padded
    topk_length: [T], int32, optional; positions >= topk_length[t] are invalid
    sink: [H], float32, optional; out *= 1 / (1 + exp(sink - lse)); a -inf sink counts nothing
    out: [T, H, 512], q's dtype, optional; written in place and returned
    returns: out [T, H, 512] in q's dtype, and lse [T, H] when ``return_lse``: float32 (float64 for
        a float64 q), natural log when ``lse_base == "e"``, base 2 when ``"2"``; with
        ``lse_with_sink`` the sink is one more term of it, ``log(exp(lse) + exp(sink))``
    """
    lay = layout.get(kv_layout)
    # float64 q: the whole computation in float64 (the truth the accuracy metrics compare against);
    # otherwise fp32. The dequantized rows are the cache's own values either way (e4m3 x fp32
    # scale and e2m1 x e4m3 are exact in fp32).
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_tokens, num_heads, _ = q.shape
    topk = indices.shape[1]
    num_slots = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)
    if out is None:
        out = torch.empty(num_tokens, num_heads, lay.latent, dtype=q.dtype, device=q.device)
    lse_out = torch.empty(num_tokens, num_heads, dtype=torch.promote_types(compute, torch.float32), device=q.device)
    positions = torch.arange(topk, device=indices.device)  # [K]
    chunk = tokens_per_chunk(num_heads, topk, kv_layout, max_chunk_bytes)

    for t0 in range(0, num_tokens, chunk):
        t1 = min(t0 + chunk, num_tokens)
        slots = indices[t0:t1].to(torch.int64)  # [c, K]
        valid = (slots >= 0) & (slots < num_slots)  # [c, K]
        if topk_length is not None:
            valid &= positions[None, :] < topk_length[t0:t1, None].to(torch.int64)
        # Invalid ids become slot 0 before the gather, so their bytes are never touched; the
        # gathered stand-in rows are zeroed below, so slot 0's content cannot leak in either.
        slots = torch.where(valid, slots, torch.zeros_like(slots)) if num_slots else slots.clamp(0, 0)
        if num_slots:
            raw = _gather_rows(kv_cache, slots)  # [c, K, W]
        else:
            raw = torch.zeros(*slots.shape, kv_cache.shape[-1], dtype=kv_cache.dtype, device=q.device)
        keys = dequantize(raw, kv_layout).to(compute)  # [c, K, D], D = head_dim (576 or 512)
        del raw
        keys.masked_fill_(~valid[:, :, None], 0.0)

        qf = q[t0:t1].to(compute)  # [c, H, D]
        scores = torch.bmm(qf, keys.transpose(1, 2)).mul_(sm_scale)  # [c, H, K]
        del qf
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [c, H]; -inf where no slot is valid
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # [c, H]
        probs = scores.sub_(finite_lse[:, :, None]).exp_()  # [c, H, K]; 0 at invalid slots
        result = torch.bmm(probs, keys[:, :, : lay.latent])  # [c, H, 512] fp32
        del probs, keys
        if sink is not None:
            sinks = sink.to(compute)[None, :]  # [1, H]
            # sigmoid(lse - sink) = 1 / (1 + exp(sink - lse)); a row with nothing valid is 0 already
            # (its factor is set to 0: for a -inf sink, -inf - -inf would be NaN).
            factor = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.sigmoid(lse - sinks))  # [c, H]
            result.mul_(factor[:, :, None])
            if lse_with_sink:
                lse = torch.logaddexp(lse, sinks)  # -inf with -inf stays -inf
        out[t0:t1] = result
        lse_out[t0:t1] = lse

    if not return_lse:
        return out
    if lse_base == "2":
        lse_out.mul_(math.log2(math.e))
    return out, lse_out
