"""The FlashInfer binding's own work, checked on any machine: everything but ``wrapper.run``.

FlashInfer's SM120 kernels run only on SM12x, but what the binding does around them is Python on
tensor metadata and elementwise torch: its input refusals, the rewrite of out-of-range ids to -1
(FlashInfer reads any id >= 0), dense lengths, the LSE base, and the correction that takes the
sink back out of the LSE FlashInfer reports. ``prepare_call(require_cuda=False)`` runs all of it on
CPU tensors; the expected values here come from the formulas in docs/facts.md (#sparse-mla-semantics, #flashinfer-sm120-sparse-mla), not from the
binding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("flashinfer.mla", reason="the binding's envelope reads the installed flashinfer (the vllm or "
                                             "flashinfer extra); the GPU machine has none")

from mla_sm120_plugin.errors import KernelInputError  # noqa: E402
from mla_sm120_plugin.dispatch import flashinfer as fi  # noqa: E402
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import pack  # noqa: E402

PAGES = 4
SLOTS = PAGES * layout.PAGE_SIZE


def _tensors(tokens=3, heads=16, topk=128):
    q = torch.zeros(tokens, heads, layout.HEAD_DIM, dtype=torch.bfloat16)
    kv = pack.make_cache(PAGES, layout.FP8_DS_MLA)
    indices = torch.randint(0, SLOTS, (tokens, topk), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    return q, kv, indices


def _prepare(q, kv, indices, **kwargs):
    kwargs.setdefault("scale_format", "arbitrary")
    return fi.prepare_call(q, kv, indices, sm_scale=0.07, kv_layout=layout.FP8_DS_MLA, require_cuda=False, **kwargs)


def test_out_of_range_ids_reach_flashinfer_as_minus_one():
    q, kv, indices = _tensors()
    indices[0, :4] = torch.tensor([-1, SLOTS, SLOTS + 1000, SLOTS - 1], dtype=torch.int32)
    call = _prepare(q, kv, indices)
    sent = call.kwargs["indices"]
    assert sent[0, :4].tolist() == [-1, -1, -1, SLOTS - 1]
    in_range = indices < SLOTS
    assert torch.equal(sent[in_range], indices[in_range]) and torch.all(sent[~in_range] == -1)


def test_a_flat_cache_reaches_flashinfer_as_64_row_pages():
    q, kv, indices = _tensors()
    call = _prepare(q, kv.view(SLOTS, -1), indices)
    sent = call.kwargs["kv_cache"]
    assert tuple(sent.shape) == (PAGES, layout.PAGE_SIZE, layout.FP8_DS_MLA_TOKEN_BYTES)
    assert sent.data_ptr() == kv.data_ptr()


def test_lengths_are_dense_int32_and_the_lse_base_is_asked_natively():
    q, kv, indices = _tensors()
    strided = torch.tensor([5, 0, 9, 0, 128, 0], dtype=torch.int32)[::2]  # a view FlashInfer cannot index
    call = _prepare(q, kv, indices, topk_length=strided, return_lse=True, lse_base="2")
    assert call.kwargs["topk_length"].is_contiguous() and call.kwargs["topk_length"].tolist() == [5, 9, 128]
    assert call.kwargs["lse_scale"] == 1.0  # FlashInfer's own base 2
    assert _prepare(q, kv, indices, return_lse=True).kwargs["lse_scale"] == pytest.approx(math.log(2))
    # With a sink too: the asked base comes out of the kernel (the sink is taken out in that base).
    for base, scale in (("2", 1.0), ("e", math.log(2))):
        for folded in (False, True):
            sunk = _prepare(q, kv, indices, return_lse=True, lse_base=base, sink=torch.zeros(16), lse_with_sink=folded)
            assert sunk.kwargs["lse_scale"] == pytest.approx(scale) and sunk.kwargs["attn_sink"] is not None


@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_the_sink_is_taken_back_out_of_flashinfers_lse(lse_base):
    """FlashInfer reports lse' = log(exp(lse) + exp(sink)) in the asked base; the contract's sink-free lse takes
    the sink back out, and a caller asking for the sink in (lse_with_sink) gets FlashInfer's own value."""
    gen = torch.Generator().manual_seed(1)
    lse = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 3
    lse[2] = -math.inf  # a row with no valid slot
    sink = torch.tensor([-2.0, 0.0, 1.5, 6.0], dtype=torch.float64)
    per_nat = 1.0 if lse_base == "e" else 1 / math.log(2)
    folded = torch.logaddexp(lse, sink[None, :]) * per_nat  # what FlashInfer writes in the asked base
    q, kv, indices = _tensors(tokens=5, heads=4)
    call = _prepare(q, kv, indices, return_lse=True, lse_base=lse_base, sink=sink.float())
    call.native_lse.copy_(folded)  # as wrapper.run would leave it
    _, got = call.result()
    want = lse * per_nat
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), ~finite)
    # lse = lse' + log(1 - exp(sink - lse')) amplifies lse'`s fp32 rounding by d lse / d lse' =
    # 1 + exp(sink - lse): a sink far above the scores costs digits (0.3 % here at sink - lse = 10).
    amplification = 1 + torch.exp(sink[None, :] - lse)
    bound = (4 * 2.0**-24 * (folded.abs() + 1) + fi.SINK_NOISE * sink.abs().clamp(min=1)[None, :]) * amplification
    err = (got.double() - want).abs()
    assert torch.all(err[finite] <= bound[finite] + 1e-6), (err[finite].max(), bound[finite].min())
    asked_in = _prepare(q, kv, indices, return_lse=True, lse_base=lse_base, sink=sink.float(), lse_with_sink=True)
    asked_in.native_lse.copy_(folded)
    assert torch.equal(asked_in.result()[1], asked_in.native_lse)


def _flashinfer_lse(sink2: np.ndarray, row_gap_nats: float, lse_scale: np.float32) -> np.ndarray:
    """FlashInfer 0.7.2-0.7.4's final LSE for heads whose keys carry e^-gap of the sink's mass (gap = inf: an
    empty row), in its own fp32 order (mla/_sparse_mla_sm120 decode merge): the sink's base-2 logit
    ``sink * log2(e)`` in fp32 joins the splits' max, ``total = exp2(lse2 - max) + exp2(sink2 - max)``,
    ``lse2 = log2(total) + max``, then times ``lse_scale``; an empty row's is ``sink2 * lse_scale``."""
    if math.isinf(row_gap_nats):
        return (sink2 * lse_scale).astype(np.float32)
    row2 = (sink2 - np.float32(row_gap_nats * math.log2(math.e))).astype(np.float32)
    top = np.maximum(row2, sink2)
    total = (np.exp2(row2 - top) + np.exp2(sink2 - top)).astype(np.float32)
    return ((np.log2(total) + top).astype(np.float32) * lse_scale).astype(np.float32)


@pytest.mark.parametrize("lse_base", ["e", "2"])
@pytest.mark.parametrize("gap", [math.inf, 40.0, 20.0, 12.0, 8.0, 2.0, 0.0, -3.0])
def test_flashinfers_documented_lse_never_gives_nan_and_folds_back(lse_base, gap):
    """issue 50: FlashInfer's own arithmetic (fp32, its documented order) for sinks over [-8, 8] and rows that
    are empty or carry e^-40 .. e^3 of the sink's mass: the sink-free LSE is never NaN, is -inf for an empty
    row, folds back to the reported value within 1e-5 nats, and where the row's own mass stands above the
    noise it is float64's within the stated bound."""
    sinks = np.linspace(-8.0, 8.0, 20_001, dtype=np.float32)
    sink2 = (sinks * np.float32(math.log2(math.e))).astype(np.float32)  # in FlashInfer, in fp32
    scale = np.float32(1.0 if lse_base == "2" else math.log(2))
    reported = torch.from_numpy(_flashinfer_lse(sink2, gap, scale))[None, :]  # [1, H]
    sink = torch.from_numpy(sinks)
    got = fi.sink_free_lse(reported, sink, lse_base)
    assert not torch.isnan(got).any()
    per_nat = 1.0 if lse_base == "e" else 1 / math.log(2)
    nats = got.double() / per_nat
    if math.isinf(gap):
        assert torch.isneginf(got).all()
    folded_back = torch.logaddexp(nats, sink.double()[None, :])
    assert (folded_back - reported.double() / per_nat).abs().max() <= 1e-5
    truth = sink.double() - gap  # the row's own sink-free LSE, float64
    mass = 1 / (1 + math.exp(gap))  # the row's share of the reported total
    noise = fi.SINK_NOISE * sink.double().abs().clamp(min=1)
    # the reported value's own error: FlashInfer's fp32 ops and the caller's fp32 conversions, a few ulp
    ulp = 8 * 2.0**-24 * (reported.double().abs() / per_nat + 1)
    kept = torch.isfinite(nats)
    assert torch.all((nats - truth).abs()[kept] <= ((ulp + noise) / mass)[kept] + 1e-6)
    if mass > 4 * float(noise.max() + ulp.max()):  # above the noise: every row keeps its own LSE
        assert kept.all()


def test_without_a_sink_the_lse_is_flashinfers():
    q, kv, indices = _tensors(tokens=2, heads=4)
    call = _prepare(q, kv, indices, return_lse=True)
    call.native_lse.copy_(torch.tensor([[1.0, 2.0, -math.inf, 0.5], [3.0, 4.0, 5.0, 6.0]]))
    assert torch.equal(call.result()[1], call.native_lse)


def test_no_tokens_launch_nothing():
    q, kv, indices = _tensors(tokens=0)
    call = _prepare(q, kv, indices, return_lse=True)
    assert call.kwargs is None
    out, lse = call.result()
    assert out.shape == (0, 16, layout.KV_LORA_RANK) and lse.shape == (0, 16)


BAD = [
    ("q", lambda q, kv, i: (q[..., :512], kv, i), {}, "q (3, 16, 512)"),
    ("q dtype", lambda q, kv, i: (q.float(), kv, i), {}, "torch.float32"),
    ("kv dtype", lambda q, kv, i: (q, kv.view(torch.int8), i), {}, "kv_cache"),
    ("kv rows", lambda q, kv, i: (q, kv[..., :600], i), {}, "rows of 656 bytes (fp8_ds_mla)"),
    ("kv misaligned", lambda q, kv, i: (q, kv.view(-1)[8:8 + 41984 * 3].view(3, 64, 656), i), {}, "address % 16"),
    ("kv 5-D", lambda q, kv, i: (q, kv.view(2, 2, 1, 64, 656), i), {}, "kv_cache shape (2, 2, 1, 64, 656)"),
    ("flat, not whole pages", lambda q, kv, i: (q, kv.view(SLOTS, -1)[:100], i), {}, "whole"),
    ("indices dtype", lambda q, kv, i: (q, kv, i.long()), {}, "indices (3, 128) torch.int64"),
    ("indices rows", lambda q, kv, i: (q, kv, i[:2]), {}, "[3, topk]"),
    ("lengths", lambda q, kv, i: (q, kv, i), {"topk_length": torch.zeros(2, dtype=torch.int32)}, "topk_length (2,)"),
    ("sink", lambda q, kv, i: (q, kv, i), {"sink": torch.zeros(3)}, "sink (3,)"),
    ("out", lambda q, kv, i: (q, kv, i), {"out": torch.zeros(3, 16, 512)}, "out (3, 16, 512) torch.float32"),
    ("lse base", lambda q, kv, i: (q, kv, i), {"lse_base": "10"}, "lse_base='10'"),
    ("sm_scale", lambda q, kv, i: (q, kv, i), {"sm_scale": torch.tensor(0.1)}, "sm_scale of type Tensor"),
    ("envelope", lambda q, kv, i: (q.repeat(30, 1, 1)[:, :4], kv, i.repeat(30, 1)), {}, "num_heads=4"),
    ("page gaps in prefill",
     lambda q, kv, i: (q.repeat(30, 1, 1), torch.zeros(PAGES, 41984 + 64, dtype=torch.uint8)[:, :41984].view(PAGES, 64, 656),
                       i.repeat(30, 1)), {}, "page-strided"),
]


@pytest.mark.parametrize("name, bend, extra, needle", BAD, ids=[b[0] for b in BAD])
def test_each_bad_input_is_refused_naming_it(name, bend, extra, needle):
    q, kv, indices = bend(*_tensors())
    kwargs = dict(sm_scale=0.07, kv_layout=layout.FP8_DS_MLA, scale_format="arbitrary", require_cuda=False)
    kwargs.update(extra)
    with pytest.raises(KernelInputError) as err:
        fi.prepare_call(q, kv, indices, **kwargs)
    message = str(err.value)
    assert needle in message, message
    assert "given: flashinfer_sparse_mla: " in message and "\nsupported: " in message and "\nfix: " in message


def test_cpu_tensors_are_refused_where_a_gpu_is_required():
    q, kv, indices = _tensors()
    with pytest.raises(KernelInputError, match="on a CUDA device"):
        fi.check_inputs(q, kv, indices)
