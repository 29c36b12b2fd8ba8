"""The combine past 32 split partials, and DeepSeek-V4's sink on the unsplit path (issue 42, item 6).

The one combine (kernels/shared/combine.py) merges 32 splits a step with a running maximum. Every
DeepSeek-V4 plan at one token takes more than 32 ranges (C4A 40, C128A 192), so the rescale of the
accumulated sum and output by ``exp2(old max - new max)`` between steps is a production path. Here
each family's kernels are forced past one step and past two, each with a partial last step
(40 = 32 + 8 and 72 = 32 + 32 + 8 splits), and compared with float64 attention over the
dequantized rows (tests/support/oracle.py over tests/support/layout_oracle.py's byte readers) at the
kernel's declared bound (exact class: cos_diff <= 5e-6, relRMS <= 0.3 %):

* ``peaked``: q ~ N(0, 1) with DeepSeek-V3.2's softmax scale 0.135 (docs/facts.md, the peaked
  regime), each token's candidates ordered by rising score, so the combine's later steps raise
  the running maximum (checked on the float64 scores before the kernel runs: every head's best
  split lies past the first step, above that step's best by a margin, some head's in the last);
* ``flat``: q = randn / 10 at the model's own scale (FlashInfer's grid), candidates in random order.

DeepSeek-V4 runs on both records (584-byte fp8, 384-byte NVFP4) with a finite sink per head placed
near the head's LSE, so ``1 / (1 + exp(sink - lse))`` is between about 0.25 and 0.75: a sink applied
twice, never, or against a wrong LSE moves the output far past the bound. The unsplit DeepSeek-V4
program (one range: the sink folded into its own softmax denominator) is held to the same truth.

Small on purpose (the interpreter is slow): one query token, four heads, one range a step of the
kernel (32 candidates a DSA split, 16 a DeepSeek-V4 range).
"""

from __future__ import annotations

import functools

import pytest
import torch

from support import layout_oracle
from support.kernel_checks import DEVICE
from support.oracle import sparse_attention
from mla_sm120_plugin.dispatch import catalog
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsa import layout as dsa_layout
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa import triton_fast as tf
from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout
from mla_sm120_plugin.kernels.dsv4 import pack as dsv4_pack
from mla_sm120_plugin.kernels.shared.launch_plan import COMBINE_SPLIT_BLOCK
from mla_sm120_plugin.tools.accuracy_cases import PEAKED_SM_SCALE, regime_case

COMBINE_STEP = 32  # splits the combine merges a step (kernels/shared/combine.py)
assert COMBINE_SPLIT_BLOCK == COMBINE_STEP, "choose SPLITS again: each must span > 1 step, the last partial"
SPLITS = (40, 72)  # one full step + 8, two full steps + 8
REGIMES = ("peaked", "flat")
HEADS = 4
# In a peaked case every head's running maximum rises by at least this much (natural log) after
# the combine's first step: dropping the rescale over-weights that step's splits by >= e^MARGIN.
MARGIN = 1.0
SINK_OFFSETS = torch.tensor([-1.0, 0.5, 0.0, 1.0], dtype=torch.float64)  # sink - lse, a head

DSA_KERNELS = {
    "exact": (tk._run, catalog.TRITON_SPEC),
    "fast": (tf._run, catalog.TRITON_FAST_SPEC),
}


def _split_lse(scores: torch.Tensor, width: int) -> torch.Tensor:
    """[H, n] float64 scores -> [H, S] logsumexp of each ``width``-candidate range (the last one
    shorter), what each split's partial LSE is in exact arithmetic."""
    return torch.stack([torch.logsumexp(scores[:, lo:lo + width], dim=-1)
                        for lo in range(0, scores.shape[1], width)], dim=1)


def _assert_peak_is_late(split_lse: torch.Tensor, num_splits: int) -> None:
    """The case makes the combine's running maximum move after its first step: every head's best
    split lies past the first 32, above the first step's best by :data:`MARGIN`, and some head's
    in the last (partial) step."""
    assert split_lse.shape[1] == num_splits, (split_lse.shape, num_splits)
    last_start = (num_splits - 1) // COMBINE_STEP * COMBINE_STEP
    assert last_start >= COMBINE_STEP and num_splits % COMBINE_STEP, "a partial last step after a full one"
    best = split_lse.argmax(dim=1)
    rise = split_lse.amax(dim=1) - split_lse[:, :COMBINE_STEP].amax(dim=1)
    assert bool((best >= COMBINE_STEP).all()) and bool((best >= last_start).any()), best.tolist()
    assert bool((rise >= MARGIN).all()), rise.tolist()


def _check(got: torch.Tensor, want: torch.Tensor, bound, what: str):
    acc = measure(got, want)
    over = bound.violations(acc)
    assert not over, f"{what}: {acc.summary()}; over the bound: {over}"
    return acc


# ---------------------------------------------------------------- the DSA kernels (exact and fast)

def _dsa_case(regime: str, num_splits: int):
    """fp8_ds_mla, one token, ``num_splits`` splits of one 32-candidate step each, the last one 12
    short; peaked: candidates ordered by rising float64 score (the max over heads)."""
    kv_layout = dsa_layout.FP8_DS_MLA
    topk = num_splits * tk.BLOCK_K - 20
    case = regime_case(regime, kv_layout, tokens=1, heads=HEADS, topk=topk, pages=4, seed=num_splits)
    keys = layout_oracle.decode_cache(case.kv_cache, kv_layout)
    indices = case.indices
    if regime == "peaked":
        scores = case.sm_scale * (case.q[0].double() @ keys[indices[0].long()].T)  # [H, topk]
        indices = indices[:, scores.amax(dim=0).argsort()].contiguous()
        scores = case.sm_scale * (case.q[0].double() @ keys[indices[0].long()].T)
        _assert_peak_is_late(_split_lse(scores, tk.BLOCK_K), num_splits)
    want, lse = sparse_attention(case.q, keys, indices, case.sm_scale)
    return case, indices, keys, want, lse


# Every (split count, regime) for the exact kernel; the fast kernel (the same combine, fp32 partials
# too, and the interpreter's slowest: 3-9 s a case here) skips flat at 72, the case that moves the
# running maximum least.
DSA_CASES = [(kernel, splits, regime) for kernel in sorted(DSA_KERNELS) for splits in SPLITS for regime in REGIMES
             if (kernel, splits, regime) != ("fast", 72, "flat")]


@pytest.mark.parametrize("kernel, num_splits, regime", DSA_CASES, ids=["-".join(map(str, c)) for c in DSA_CASES])
def test_dsa_combine_of_more_than_32_splits(kernel, num_splits, regime):
    """Forced ``num_splits`` splits (one block step each) through the shared combine, output and
    natural-log LSE, against float64 at the kernel's declared bound (a sink on the peaked cases)."""
    run, spec = DSA_KERNELS[kernel]
    case, indices, keys, want, want_lse = _dsa_case(regime, num_splits)
    sink = None
    if regime == "peaked":  # near each head's LSE: a factor 1 / (1 + e^-offset) far from 1
        sink = (want_lse[0] + SINK_OFFSETS).float()
        want, _ = sparse_attention(case.q, keys, indices, case.sm_scale, sink=sink)
    cfg = tk.LaunchConfig(tk.BLOCK_H, tk.BLOCK_K, num_splits, 1, tk.NUM_WARPS, tk.NUM_STAGES)
    assert (num_splits - 1) * tk.BLOCK_K < indices.shape[1] < num_splits * tk.BLOCK_K
    out, lse = run(case.q.to(DEVICE), case.kv_cache.to(DEVICE), indices.to(DEVICE), sm_scale=case.sm_scale,
                   kv_layout=case.kv_layout, topk_length=None, sink=None if sink is None else sink.to(DEVICE),
                   out=None, return_lse=True, lse_base="e", config=cfg)
    _check(out, want, spec.accuracy, f"{kernel} {num_splits} splits {regime}")
    # The LSE the combine stores (the running max plus log of the rescaled total), before the sink.
    assert torch.allclose(lse.cpu().double(), want_lse, rtol=0, atol=1e-4), (lse, want_lse)


# ---------------------------------------------------------------- DeepSeek-V4 (triton_dsv4, both records)

RECORDS = {"fp8": dsv4_layout.FP8_RECORD, "nvfp4": dsv4_layout.NVFP4_RECORD}
PAGE = 64  # both caches' page size
PAGES = 2  # 128 slots a cache
WINDOW = 128  # the window's index row (DeepSeek-V4's sliding window)
DSV4_SCALE = 512**-0.5  # the model's softmax scale


@functools.lru_cache(maxsize=None)
def _dsv4_cache(record_name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-major cache of ``PAGES`` x ``PAGE`` random bf16 rows written by the packer, and every
    slot's 512 values read back from its bytes by the oracle ([slots, 512] float64)."""
    record = RECORDS[record_name]
    buf = dsv4_pack.new_cache(PAGES, PAGE, record=record)
    rows = torch.randn(PAGES * PAGE, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    dsv4_pack.write(buf, rows, torch.arange(PAGES * PAGE), PAGE, record=record)
    keys = layout_oracle.dsv4_oracle_rows(buf, range(PAGES * PAGE), PAGE, record_name)
    return buf, keys


def _engine_view(buf: torch.Tensor, record) -> torch.Tensor:
    """The engines' NHD view of a page-major pool: [pages, P, 1, record bytes]."""
    return buf[:, :PAGE * record.token_bytes].view(buf.shape[0], PAGE, 1, record.token_bytes)


def _dsv4_case(record_name: str, regime: str, compressed: int, seed: int):
    """One token, ``HEADS`` heads, a 128-wide window row and a ``compressed``-wide compressed row,
    every id valid. peaked: q ~ N(0, 1) at scale 0.135, the window row drawn from the lower-scoring
    half of its cache, each row ordered by rising score (the compressed row, read after the
    window's, holds the best candidates at its end); flat: q / 10 at 512^-0.5, random ids.
    Returns the call's pieces, the float64 scores in the kernel's candidate order and the rows."""
    swa, swa_keys = _dsv4_cache(record_name, 1)
    comp, comp_keys = _dsv4_cache(record_name, 2)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, 512, generator=gen)
    scale = PEAKED_SM_SCALE if regime == "peaked" else DSV4_SCALE
    if regime == "flat":
        q /= 10
    q = q.to(torch.bfloat16)
    swa_idx = torch.randint(0, PAGES * PAGE, (1, WINDOW), generator=gen, dtype=torch.int32)
    comp_idx = torch.randint(0, PAGES * PAGE, (1, compressed), generator=gen, dtype=torch.int32)

    def scores_of(keys, idx):
        return scale * (q[0].double() @ keys[idx[0].long()].T)  # [H, n]

    if regime == "peaked":
        # the window row from the window cache's lower-scoring half, then both rows by rising score
        every = torch.arange(PAGES * PAGE, dtype=torch.int32)[None]
        low = scores_of(swa_keys, every).amax(dim=0).argsort()[:PAGES * PAGE // 2].to(torch.int32)
        swa_idx = low[torch.randint(0, low.numel(), (1, WINDOW), generator=gen)]
        swa_idx = swa_idx[:, scores_of(swa_keys, swa_idx).amax(dim=0).argsort()].contiguous()
        comp_idx = comp_idx[:, scores_of(comp_keys, comp_idx).amax(dim=0).argsort()].contiguous()
    scores = torch.cat([scores_of(swa_keys, swa_idx), scores_of(comp_keys, comp_idx)], dim=1)
    rows = torch.cat([swa_keys[swa_idx[0].long()], comp_keys[comp_idx[0].long()]])
    return (q, swa, swa_idx, comp, comp_idx, scale), scores, rows


def _dsv4_oracle(call, rows: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over the call's candidate rows (``rows``, in the kernel's order) with the sink
    logit in the denominator only: out [1, H, 512], natural-log lse [1, H] (the sink left out)."""
    q, scale = call[0], call[5]
    return sparse_attention(q, rows, torch.arange(rows.shape[0])[None], scale, sink=sinks)


def _dsv4_truth(call, rows: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    return _dsv4_oracle(call, rows, sinks)[0]


def _dsv4_sinks(call, rows: torch.Tensor) -> torch.Tensor:
    """A finite sink a head, at the head's LSE plus :data:`SINK_OFFSETS` (fp32, as the engines pass)."""
    lse = _dsv4_oracle(call, rows, None)[1][0]
    return (lse + SINK_OFFSETS[:lse.shape[0]]).float()


def _run_dsv4(record_name: str, call, sinks: torch.Tensor | None, num_splits: int) -> torch.Tensor:
    q, swa, swa_idx, comp, comp_idx, scale = call
    record = RECORDS[record_name]
    from mla_sm120_plugin.dispatch.dsv4 import triton_dsv4

    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    triton_dsv4(q.to(DEVICE), _engine_view(swa, record).to(DEVICE), None, swa_idx.unsqueeze(1).to(DEVICE),
                _engine_view(comp, record).to(DEVICE), out, bmm1_scale=scale,
                sinks=None if sinks is None else sinks.to(DEVICE), kv_layout="NHD",
                extra_sparse_indices=comp_idx.unsqueeze(1).to(DEVICE), kv_cache_format=record_name,
                num_splits=num_splits)
    return out


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("record_name", list(RECORDS))
def test_dsv4_combine_of_more_than_32_ranges(record_name, num_splits, regime, monkeypatch):
    """triton_dsv4 forced into ``num_splits`` ranges of one 16-candidate step (the window row, then
    a compressed row 12 short of the last step: 40 ranges is C4A's T=1 plan, 128 + 500 candidates),
    a finite sink near each head's LSE, against float64 at the exact class."""
    monkeypatch.delenv("MLA_SM120_SPLITS", raising=False)
    block_n = 16  # kernels/dsv4/plan.py's block shape, both records
    compressed = num_splits * block_n - WINDOW - 12
    call, scores, rows = _dsv4_case(record_name, regime, compressed, seed=num_splits + len(regime))
    if regime == "peaked":
        _assert_peak_is_late(_split_lse(scores, block_n), num_splits)
    sinks = _dsv4_sinks(call, rows)
    out = _run_dsv4(record_name, call, sinks, num_splits)
    _check(out, _dsv4_truth(call, rows, sinks), catalog.TRITON_DSV4_SPEC.accuracy,
           f"dsv4 {record_name} {num_splits} ranges {regime}")


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("record_name", list(RECORDS))
def test_dsv4_unsplit_with_a_finite_sink(record_name, regime, monkeypatch):
    """One range (the FINAL program: the sink's mass added to its own denominator), a sink near each
    head's LSE on both records: one sink, applied once, against float64 at the exact class."""
    monkeypatch.delenv("MLA_SM120_SPLITS", raising=False)
    call, _, rows = _dsv4_case(record_name, regime, 100, seed=7 + len(regime))
    sinks = _dsv4_sinks(call, rows)
    assert bool((sinks != 0).all()) and bool(sinks.isfinite().all())
    out = _run_dsv4(record_name, call, sinks, 1)
    want = _dsv4_truth(call, rows, sinks)
    _check(out, want, catalog.TRITON_DSV4_SPEC.accuracy, f"dsv4 {record_name} unsplit {regime}")
    # the comparison can fail: without its sink the same output is far from the truth
    assert EXACT_CLASS_BOUND.violations(measure(out, _dsv4_truth(call, rows, None)))
