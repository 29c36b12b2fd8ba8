"""The torch reference against the tests' float64 oracle, and its masking and memory contracts.

The oracle (tests/support/oracle.py, itself held to a dense formula by tests/unit/test_oracle.py) reads
the cache through tests/support/layout_oracle.py (struct and integer arithmetic from the byte layout),
not through the packer's dequantizer the reference itself uses.
"""

from __future__ import annotations

import functools

import math

import pytest
import torch
from cpu_memory import LiveTensorPeak  # benchmarks/ is on pytest's pythonpath

from support import layout_oracle
from support.kernel_checks import BF16_ULP, scaled_atol
from support.oracle import sparse_attention
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.kernels.dsa.reference import bytes_per_token, tokens_per_chunk, torch_sparse_mla

# The reference computes in fp32, the dense formula in float64, from the same cache bytes: the
# difference is fp32 rounding over 576-wide dots and up to topk-term sums, which grows with
# the values' magnitude (measured 1.2e-6 of it, thread-count dependent), so the tolerance is a
# fraction of the largest |value| (support.kernel_checks.scaled_atol), not an absolute number.
REF_REL_TOL = 1e-5


@pytest.fixture
def make_case(make_case):
    """The reference's own tests run on the CPU, against float64 math (the GPU runs compare kernels to it)."""
    return functools.partial(make_case, device="cpu")


def oracle(q, kv_cache, indices, sm_scale, kv_layout, topk_length=None, sink=None):
    """The tests' float64 attention (tests/support/oracle.py) over the rows the bytes hold, read by
    tests/support/layout_oracle.py: (out, natural-log lse without the sink)."""
    keys = layout_oracle.decode_cache(kv_cache, kv_layout)  # [S, 576] float64
    return sparse_attention(q, keys, indices, sm_scale, topk_length=topk_length, sink=sink)


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_matches_the_oracle(make_case, kv_layout, scale_format):
    case = make_case(kv_layout=kv_layout, scale_format=scale_format, num_tokens=6, num_heads=5, topk=90,
                     q_dtype=torch.float32)
    out, lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                kv_layout=kv_layout, return_lse=True)
    ref_out, ref_lse = oracle(case.q, case.kv_cache, case.indices, case.sm_scale, kv_layout)
    assert out.shape == (6, 5, layout.KV_LORA_RANK) and out.dtype == torch.float32
    assert lse.shape == (6, 5) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=scaled_atol(ref_out, REF_REL_TOL), rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=scaled_atol(ref_lse, REF_REL_TOL), rtol=0)


def test_bf16_q_gives_bf16_out_rounded_from_fp32(make_case):
    case = make_case(num_heads=3)
    out = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                           kv_layout=case.kv_layout)
    exact, _ = oracle(case.q, case.kv_cache, case.indices, case.sm_scale, case.kv_layout)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of an fp32 result: within half a bf16 ulp of it, plus fp32's own error.
    torch.testing.assert_close(out.double(), exact, atol=scaled_atol(exact, REF_REL_TOL), rtol=BF16_ULP / 2)


def test_all_invalid_row_gives_zero_and_minus_inf(make_case):
    case = make_case(num_tokens=3)
    case.indices[1] = -1
    case.indices[2] = case.num_slots  # every id out of range
    out, lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                kv_layout=case.kv_layout, return_lse=True,
                                sink=torch.zeros(case.q.shape[1]))
    assert torch.all(out[1:] == 0) and torch.all(lse[1:] == -math.inf)
    assert torch.all(torch.isfinite(lse[0])) and torch.any(out[0] != 0)


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_invalid_slots_are_never_read(make_case, kv_layout):
    """Every slot not validly referenced holds NaN bytes, slot 0 (the stand-in) included."""
    case = make_case(kv_layout=kv_layout, num_tokens=4, topk=40, invalid_fraction=0.4)
    idx = case.indices.long()
    referenced = torch.zeros(case.num_slots, dtype=torch.bool)
    ok = (idx >= 0) & (idx < case.num_slots)
    referenced[idx[ok]] = True
    referenced[0] = False
    case.indices[idx == 0] = -1
    poisoned = case.kv_cache.clone()
    rows = poisoned.view(-1, poisoned.shape[-1])[~referenced]
    if layout.get(kv_layout).fp8:
        rows[:, : layout.KV_LORA_RANK] = 0x7F  # fp8 e4m3 NaN
        rows[:, layout.FP8_SCALE_OFFSET : layout.FP8_ROPE_OFFSET] = 0xFF  # fp32 NaN
    elif layout.get(kv_layout).nvfp4:
        rows[:, 256:] = 0x7F  # e4m3 NaN: every rope value and every block scale (e2m1 has no NaN)
    else:
        rows[:] = float("nan")
    poisoned.view(-1, poisoned.shape[-1])[~referenced] = rows
    out, lse = torch_sparse_mla(case.q, poisoned, case.indices, sm_scale=case.sm_scale,
                                kv_layout=kv_layout, return_lse=True)
    clean = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale, kv_layout=kv_layout)
    assert torch.all(torch.isfinite(out)) and not torch.any(torch.isnan(lse))
    assert torch.equal(out, clean)


def test_topk_length_masks_the_tail(make_case):
    case = make_case(num_tokens=4, topk=50, invalid_fraction=0.0, q_dtype=torch.float32)
    lengths = torch.tensor([50, 17, 0, 80], dtype=torch.int32)  # full, prefix, none, longer than topk
    out, lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                kv_layout=case.kv_layout, topk_length=lengths, return_lse=True)
    ref_out, ref_lse = oracle(case.q, case.kv_cache, case.indices, case.sm_scale, case.kv_layout, topk_length=lengths)
    torch.testing.assert_close(out.double(), ref_out, atol=scaled_atol(ref_out, REF_REL_TOL), rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.all(torch.isneginf(lse[2]))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=scaled_atol(ref_lse[finite], REF_REL_TOL),
                               rtol=0)
    # 80 > top-k 50 is clamped: the same as the whole row.
    full, _ = oracle(case.q[3:], case.kv_cache, case.indices[3:], case.sm_scale, case.kv_layout)
    torch.testing.assert_close(out[3:].double(), full, atol=scaled_atol(full, REF_REL_TOL), rtol=0)


def test_sink_and_lse_base(make_case):
    case = make_case(num_tokens=5, num_heads=4, q_dtype=torch.float32)
    sink = torch.tensor([-1.0, 0.0, 2.5, 30.0])
    out, lse_e = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                  kv_layout=case.kv_layout, sink=sink, return_lse=True)
    plain, lse_plain = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                        kv_layout=case.kv_layout, return_lse=True)
    _, lse_2 = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                kv_layout=case.kv_layout, return_lse=True, lse_base="2")
    ref_out, _ = oracle(case.q, case.kv_cache, case.indices, case.sm_scale, case.kv_layout, sink=sink)
    torch.testing.assert_close(out.double(), ref_out, atol=scaled_atol(ref_out, REF_REL_TOL), rtol=0)
    expected = plain * torch.sigmoid(lse_plain - sink)[..., None]  # 1/(1+exp(sink-lse))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(lse_e, lse_plain), "the sink must not change lse"
    torch.testing.assert_close(lse_2, lse_e * math.log2(math.e), atol=1e-5, rtol=0)


def test_out_buffer_and_page_strided_and_flat_caches(make_case):
    case = make_case(page_pad=48, num_tokens=3)
    out = torch.full((3, 16, layout.KV_LORA_RANK), 7.0, dtype=torch.bfloat16)
    got = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                           kv_layout=case.kv_layout, out=out)
    assert got is out
    packed = case.kv_cache.contiguous()
    flat = pack.flat_view(packed)
    for cache in (packed, flat):
        again = torch_sparse_mla(case.q, cache, case.indices, sm_scale=case.sm_scale, kv_layout=case.kv_layout)
        assert torch.equal(again, out)


def test_chunking_is_invisible(make_case):
    # Chunks change only the batch size of the fp32 matmuls; CPU BLAS may then sum in another
    # order, so results agree to fp32 rounding rather than bit for bit.
    case = make_case(num_tokens=11, num_heads=6, topk=70, q_dtype=torch.float32)
    one, lse_one = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                    kv_layout=case.kv_layout, return_lse=True, max_chunk_bytes=1 << 40)
    per_token = bytes_per_token(6, 70, case.kv_layout)
    for chunk in (1, 3, 4):
        out, lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                    kv_layout=case.kv_layout, return_lse=True,
                                    max_chunk_bytes=chunk * per_token)
        torch.testing.assert_close(out, one, atol=1e-4, rtol=1e-5, msg=f"chunk of {chunk} tokens")
        torch.testing.assert_close(lse, lse_one, atol=1e-5, rtol=1e-6, msg=f"chunk of {chunk} tokens")


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_chunk_size_respects_bound(kv_layout):
    for heads, topk in [(1, 1), (16, 2048), (128, 2048), (64, 512)]:
        per_token = bytes_per_token(heads, topk, kv_layout)
        for bound in (per_token // 2, per_token, 10 * per_token + 1, 1 << 30):
            chunk = tokens_per_chunk(heads, topk, kv_layout, bound)
            assert chunk >= 1
            assert chunk * per_token <= max(bound, per_token)
            assert (chunk + 1) * per_token > bound, "chunks should use the budget they are given"


def test_measured_peak_stays_under_bound(make_case):
    # LiveTensorPeak counts op-created tensors alive at once; scratch inside a single op is not
    # seen, which the bound covers with margin (see bytes_per_token).
    case = make_case(num_tokens=24, num_heads=16, topk=256)
    out = torch.empty(24, 16, layout.KV_LORA_RANK, dtype=torch.bfloat16)
    inputs = [case.q, case.kv_cache, case.indices, out]
    per_token = bytes_per_token(16, 256, case.kv_layout)
    bound = 4 * per_token

    def peak(max_chunk_bytes: int) -> int:
        with LiveTensorPeak(inputs) as mode:
            torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                             kv_layout=case.kv_layout, out=out, max_chunk_bytes=max_chunk_bytes)
        return mode.peak

    lse_bytes = 24 * 16 * 4  # the [T, H] lse buffer, allocated once
    assert peak(bound) <= bound + lse_bytes
    # The same measurement sees a full gather blow through that bound: the check can fail.
    assert peak(1 << 40) > 3 * bound
