"""The tests' float64 oracle (tests/support/oracle.py) held to a second formulation and to its stated conventions.

:func:`dense_formula` scores every row densely and weights each by how often it is a valid candidate
(duplicates count twice): no gather, no per-candidate softmax, so an indexing or masking slip in the
oracle's gather disagrees with it. The LSE's base, the sink in it or left out, and DeepSeek-V4's
two-cache call are each pinned against the stated formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from support import layout_oracle
from support.oracle import DSV4_SCALE, dsv4_sparse_attention, sparse_attention

ROWS, WIDTH, TOKENS, HEADS, TOPK = 40, 576, 7, 3, 12


def dense_formula(q, keys, ids, sm_scale, topk_length=None, sink=None):
    """Every row scored densely, weighted by its count among the valid candidates; (out, natural-log
    lse without the sink); the sink scales out by ``1 / (1 + exp(sink - lse))``."""
    num_rows = keys.shape[0]
    tokens, topk = ids.shape
    idx = ids.long()
    valid = (idx >= 0) & (idx < num_rows)
    if topk_length is not None:
        valid &= torch.arange(topk)[None, :] < topk_length.long()[:, None]
    counts = torch.zeros(tokens, num_rows + 1, dtype=keys.dtype)
    counts.scatter_add_(1, torch.where(valid, idx, num_rows), valid.to(keys.dtype))
    counts = counts[:, :num_rows]  # [T, S]
    scores = torch.einsum("thd,sd->ths", q.double(), keys) * sm_scale  # [T, H, S]
    scores = scores.masked_fill(counts[:, None, :] == 0, -math.inf)
    top = scores.amax(-1).nan_to_num(neginf=0)
    weights = torch.exp(scores - top[..., None]) * counts[:, None, :]
    total = weights.sum(-1)  # [T, H]
    lse = torch.where(total > 0, torch.log(total) + top, -math.inf)
    out = (weights @ keys[:, :512]) / total.clamp(min=1e-300)[..., None]
    if sink is not None:
        gap = (sink.double()[None, :] - lse).nan_to_num(nan=-math.inf)  # a -inf sink over an empty row: nothing
        out = out / (1 + torch.exp(gap))[..., None]
    return out, lse


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(ROWS, WIDTH, generator=gen).double()
    q = torch.randn(TOKENS, HEADS, WIDTH, generator=gen)
    ids = torch.randint(0, ROWS, (TOKENS, TOPK), generator=gen, dtype=torch.int32)
    ids[0, :3] = torch.tensor([-1, ROWS, ROWS + 100])  # masked: -1 and out of range
    ids[1, 1] = ids[1, 0]  # a duplicate counts twice
    ids[2] = -1  # nothing valid
    lengths = torch.tensor([TOPK, 5, TOPK, 0, TOPK + 9, -4, 1], dtype=torch.int32)  # full, prefix, none, above, below 0
    return q, keys, ids, lengths


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("sink", [None, "finite", "minus_inf"])
def test_the_oracle_matches_the_dense_formula(with_lengths, sink):
    q, keys, ids, lengths = _problem()
    sinks = {None: None, "finite": torch.tensor([-1.0, 2.5, 40.0]),
             "minus_inf": torch.full((HEADS,), -math.inf)}[sink]
    lengths = lengths if with_lengths else None
    out, lse = sparse_attention(q, keys, ids, 0.05, topk_length=lengths, sink=sinks)
    want_out, want_lse = dense_formula(q, keys, ids, 0.05, topk_length=lengths, sink=sinks)
    assert out.dtype == lse.dtype == torch.float64 and out.shape == (TOKENS, HEADS, 512)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-12, rtol=1e-12)
    assert torch.isneginf(lse[2]).all() and torch.equal(out[2], torch.zeros_like(out[2]))  # nothing valid: 0, -inf
    if with_lengths:
        assert torch.isneginf(lse[3]).all() and torch.isneginf(lse[5]).all()  # a length of 0 or below: none
    if sink == "minus_inf":  # a -inf sink counts nothing
        torch.testing.assert_close(out, sparse_attention(q, keys, ids, 0.05, topk_length=lengths)[0], atol=0, rtol=0)


def test_the_lse_base_and_the_sink_in_it_are_as_stated():
    q, keys, ids, lengths = _problem(1)
    sinks = torch.tensor([0.5, -math.inf, 3.0])
    out, lse = sparse_attention(q, keys, ids, 0.05, topk_length=lengths, sink=sinks)
    out2, lse2 = sparse_attention(q, keys, ids, 0.05, topk_length=lengths, sink=sinks, lse_base="2")
    assert torch.equal(out, out2)
    torch.testing.assert_close(lse2, lse / math.log(2.0), atol=0, rtol=1e-15)
    folded_out, folded = sparse_attention(q, keys, ids, 0.05, topk_length=lengths, sink=sinks, lse_with_sink=True)
    assert torch.equal(out, folded_out)
    want = torch.logaddexp(lse, sinks.double()[None, :])  # an empty row: the sink itself
    torch.testing.assert_close(folded, want, atol=1e-14, rtol=0)
    assert folded[2, 0].item() == 0.5 and math.isinf(folded[2, 1].item()) and folded[2, 2].item() == 3.0
    _, folded2 = sparse_attention(q, keys, ids, 0.05, topk_length=lengths, sink=sinks, lse_base="2", lse_with_sink=True)
    torch.testing.assert_close(folded2, folded / math.log(2.0), atol=0, rtol=1e-15)
    # one row, one head, two candidates, by hand: weights e^1, e^2 and the sink's e^0
    keys = torch.zeros(2, 512, dtype=torch.float64)
    keys[0, 0], keys[1, 0] = 1.0, 2.0
    one = torch.zeros(1, 1, 512)
    one[0, 0, 0] = 1.0
    out, lse = sparse_attention(one, keys, torch.tensor([[0, 1]]), 1.0, sink=torch.zeros(1), lse_with_sink=True)
    total = math.e + math.e**2 + 1
    assert out[0, 0, 0].item() == pytest.approx((math.e + 2 * math.e**2) / total, rel=1e-15)
    assert lse[0, 0].item() == pytest.approx(math.log(total), rel=1e-15)


@pytest.mark.parametrize("record", ["fp8", "nvfp4"])
def test_deepseek_v4s_call_is_sparse_attention_over_both_caches_rows(record):
    """Each part's first ``lengths[t]`` ids within its pages, read from the bytes slot by slot, in the
    window-then-compressed order, the sink in the denominator: the same as asking the oracle over the
    rows gathered here one id at a time."""
    from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout
    from mla_sm120_plugin.kernels.dsv4 import pack as dsv4_pack

    rec = {"fp8": dsv4_layout.FP8_RECORD, "nvfp4": dsv4_layout.NVFP4_RECORD}[record]
    gen = torch.Generator().manual_seed(5)
    caches = []
    for pages, page in ((2, 16), (3, 4)):
        cache = dsv4_pack.new_cache(pages, page, record=rec)
        rows = torch.randn(pages * page, 512, generator=gen).to(torch.bfloat16)
        dsv4_pack.write(cache, rows, torch.arange(pages * page), page, record=rec)
        caches.append((cache, page, pages * page))
    q = torch.randn(3, HEADS, 512, generator=gen).to(torch.bfloat16)
    swa_idx = torch.randint(-1, 36, (3, 8), generator=gen)  # -1 and past the 32 slots
    comp_idx = torch.randint(0, 12, (3, 5), generator=gen, dtype=torch.int32)
    comp_len = torch.tensor([5, 0, 3], dtype=torch.int32)
    sinks = torch.tensor([0.0, -math.inf, 2.0])
    parts = [(caches[0][0], swa_idx, None, caches[0][1]), (caches[1][0], comp_idx, comp_len, caches[1][1])]
    out, lse = dsv4_sparse_attention(q, parts, sinks, record)

    gathered, ids = [], torch.full((3, 13), -1)
    for t in range(3):
        named = [(0, int(i)) for i in swa_idx[t] if 0 <= int(i) < caches[0][2]]
        named += [(1, int(i)) for i in comp_idx[t, : int(comp_len[t])]]
        for j, (part, slot) in enumerate(named):
            ids[t, j] = len(gathered)
            cache, page, _ = caches[part]
            gathered.append(layout_oracle.dsv4_oracle_row(cache, slot, page, record))
    keys = torch.tensor(gathered, dtype=torch.float64)
    want_out, want_lse = sparse_attention(q, keys, ids, DSV4_SCALE, sink=sinks)
    torch.testing.assert_close(out, want_out, atol=1e-13, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-13, rtol=0)
    assert out.abs().sum() > 0
