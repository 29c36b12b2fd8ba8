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
    # With a sink the binding asks for natural log and converts after taking the sink out.
    sunk = _prepare(q, kv, indices, return_lse=True, lse_base="2", sink=torch.zeros(16))
    assert sunk.kwargs["lse_scale"] == pytest.approx(math.log(2))


@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_the_sink_is_taken_back_out_of_flashinfers_lse(lse_base):
    """FlashInfer reports lse' = log(exp(lse) + exp(sink)); the contract's lse excludes the sink."""
    gen = torch.Generator().manual_seed(1)
    lse = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 3
    lse[2] = -math.inf  # a row with no valid slot
    sink = torch.tensor([-2.0, 0.0, 1.5, 6.0], dtype=torch.float64)
    folded = torch.logaddexp(lse, sink[None, :])  # what FlashInfer writes (natural log asked)
    q, kv, indices = _tensors(tokens=5, heads=4)
    call = _prepare(q, kv, indices, return_lse=True, lse_base=lse_base, sink=sink.float())
    call.native_lse.copy_(folded)  # as wrapper.run would leave it
    _, got = call.result()
    want = lse if lse_base == "e" else lse / math.log(2)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), ~finite)
    # lse = lse' + log(1 - exp(sink - lse')) amplifies lse'`s fp32 rounding by d lse / d lse' =
    # 1 + exp(sink - lse): a sink far above the scores costs digits (0.3 % here at sink - lse = 10).
    amplification = 1 + torch.exp(sink[None, :] - lse)
    bound = 4 * 2.0**-24 * (folded.abs() + 1) * amplification / (1 if lse_base == "e" else math.log(2))
    err = (got.double() - want).abs()
    assert torch.all(err[finite] <= bound[finite] + 1e-6), (err[finite].max(), bound[finite].min())


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
