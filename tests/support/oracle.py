"""The tests' one float64 attention: sparse MLA over rows already dequantized to float64.

Every kernel, dispatch, engine and DCP test that needs the exact answer asks :func:`sparse_attention`
(DeepSeek-V4's two-cache call too: :func:`dsv4_sparse_attention` is the same attention over the window's
rows and the compressed cache's rows). It is written from docs/facts.md#sparse-mla-semantics alone and
computes from the rows it is given; the rows come from :mod:`support.layout_oracle`, which reads the
cache bytes with ``struct`` and never with the package's code (or, where a test means it, from an
engine's own dequantization), so no test compares a function of the package with itself.

Semantics, per query row ``t`` and head ``h``:

- the candidates are the first ``min(topk_length[t], K)`` ids of row ``t`` (all ``K`` without
  ``topk_length``; none for a length <= 0), less every -1 and every id outside ``[0, len(keys))``;
  a duplicate id counts twice;
- ``score_j = sm_scale * q[t, h] . keys[j]`` (the whole row: rope included where the rows have one);
- ``out[t, h] = sum_j exp(score_j) * keys[j, :value_width] / (sum_j exp(score_j) + exp(sink[h]))``:
  the sink is one more logit of the denominator that brings no value (none without ``sink``; a
  ``-inf`` sink counts nothing); a row with no candidate gives 0, whatever the sink;
- ``lse[t, h] = log(sum_j exp(score_j))``, natural log (``lse_base="2"``: base 2, the same value
  divided by ln 2), the sink left out; ``lse_with_sink=True`` folds it in,
  ``log(exp(lse) + exp(sink))``. A row with no candidate: ``-inf`` (the sink, with it folded in).

These are the kernel contract's names and conventions (``lse_base``, ``lse_with_sink``:
``mla_sm120_plugin/kernels/dsa/reference.py``), stated here once for the tests.
"""

from __future__ import annotations

import math

import torch

from support import layout_oracle

LATENT = 512  # the value width: the latent of a DSA row, the whole of a DeepSeek-V4 row's NoPE + rope values
DSV4_SCALE = 512**-0.5  # DeepSeek-V4's softmax scale


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, sm_scale: float, *,
                     topk_length: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                     lse_base: str = "e", lse_with_sink: bool = False,
                     value_width: int = LATENT) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention in float64 (the module docstring states the semantics).

    :param q: [T, H, D], any float dtype or device (read as float64 on the CPU).
    :param keys: [S, D] the rows as values (float64 from :mod:`support.layout_oracle`; D = 576, or
        512 rope-less and DeepSeek-V4); the first ``value_width`` columns are the values.
    :param ids: [T, K] integer candidate ids into ``keys``.
    :param topk_length: [T] or None: how many of each row's ids count.
    :param sink: [H] or None: a logit per head in the denominator only (``-inf``: none).
    :param lse_base: ``"e"`` (natural log) or ``"2"``.
    :param lse_with_sink: the sink folded into the LSE (else left out).
    :returns: (out [T, H, value_width], lse [T, H]), float64 on the CPU.
    """
    assert lse_base in ("e", "2"), lse_base
    q = q.detach().cpu().double()
    keys = keys.detach().cpu().double()
    ids = ids.detach().cpu().long()
    tokens, heads = q.shape[:2]
    num_rows, topk = keys.shape[0], ids.shape[1]
    sink64 = None if sink is None else sink.detach().cpu().double().reshape(heads)
    out = torch.zeros(tokens, heads, value_width, dtype=torch.float64)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64)
    for t in range(tokens):
        count = topk if topk_length is None else max(0, min(int(topk_length[t]), topk))
        row = ids[t, :count]
        row = row[(row >= 0) & (row < num_rows)]
        if row.numel() == 0:
            if sink64 is not None and lse_with_sink:
                lse[t] = sink64
            continue
        k = keys[row]  # [n, D]
        scores = sm_scale * (q[t] @ k.T)  # [H, n]
        lse[t] = torch.logsumexp(scores, dim=-1)
        total = lse[t] if sink64 is None else torch.logaddexp(lse[t], sink64)  # the denominator, logged
        out[t] = torch.exp(scores - total[:, None]) @ k[:, :value_width]
        if lse_with_sink:
            lse[t] = total
    if lse_base == "2":
        lse = lse / math.log(2.0)
    return out, lse


def dsv4_sparse_attention(q: torch.Tensor, parts, sinks: torch.Tensor | None, record: str = "fp8", *,
                          sm_scale: float = DSV4_SCALE, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's call (a sliding window and a compressed cache, docs/facts.md#deepseek-v4) as
    :func:`sparse_attention` over both caches' rows.

    ``parts`` = [(cache, indices [T, K], lengths [T] or None, page_size)]: ``cache`` a page-major pool
    ([pages, page stride] bytes, any view of one) of ``record`` ("fp8": 584-byte, "nvfp4": 384-byte
    rows); a row's candidates in a part are its first ``lengths[t]`` ids (all without lengths) within
    ``[0, pages * page_size)``. Each part's named rows are read from the bytes by
    :func:`support.layout_oracle.dsv4_oracle_rows` into one key table, its ids pointed into it, and the
    parts' rows concatenated: the window's candidates, then the compressed ones. ``sinks`` [H] or None;
    ``options``: :func:`sparse_attention`'s (``lse_base``, ``lse_with_sink``)."""
    tables, pointers, at = [], [], 0
    for cache, indices, lengths, page_size in parts:
        idx = indices.detach().cpu().long()
        topk = idx.shape[1]
        count = (torch.full((idx.shape[0],), topk) if lengths is None
                 else lengths.detach().cpu().long().clamp(0, topk))
        named = (torch.arange(topk)[None, :] < count[:, None]) & (idx >= 0) & (idx < cache.shape[0] * page_size)
        slots = torch.unique(idx[named])  # sorted: a slot's row is read once however often it is named
        tables.append(layout_oracle.dsv4_oracle_rows(cache, slots.tolist(), page_size, record))
        pointers.append(torch.where(named, torch.searchsorted(slots, idx) + at, -1))
        at += slots.numel()
    return sparse_attention(q, torch.cat(tables), torch.cat(pointers, dim=1), sm_scale, sink=sinks, **options)
