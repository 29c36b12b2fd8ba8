"""DeepSeek-V4's 384-byte NVFP4 record (FlashInfer's ``kv_cache_format="nvfp4"``): the packer against
FlashInfer's documented writer formula written again value by value in Python floats
(tests/support/layout_oracle.py ``encode_dsv4_nvfp4_row``: FlashInfer's writers are CUDA-only), the
dequantization against a reader of the bytes, and the torch reference on NVFP4 caches against the
float64 oracle. Edge values: all-zero groups, ties of the e2m1 rounding, saturation, tiny amax
(a scale that rounds to 0 or to an e4m3 subnormal), negative zero, the 4 zero footer bytes."""

from __future__ import annotations

import pytest
import torch

from support.layout_oracle import dsv4_oracle_row, encode_dsv4_nvfp4_row
from support.oracle import dsv4_sparse_attention
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack
from mla_sm120_plugin.kernels.dsv4.reference import dsv4_attention_reference

REC = layout.NVFP4_RECORD


def test_the_record_is_384_bytes_page_major_and_holds_152_percent_of_the_tokens():
    assert (REC.token_bytes, REC.data_bytes, REC.scale_bytes, REC.num_scales, REC.nope_bytes) == (384, 352, 32, 28, 224)
    assert REC.scale_offset(65, 64, 24576) == 24576 + 64 * 352 + 32
    assert round(layout.FP8_RECORD.token_bytes / REC.token_bytes, 2) == 1.52
    assert layout.FLASHINFER_FORMAT[layout.NVFP4_DSV4] == "nvfp4"  # FlashInfer's kv_cache_format for it


def _edge_rows() -> torch.Tensor:
    rows = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 3
    rows[0, :16] = 0.0  # an all-zero group: scale 0, codes 0
    rows[0, 16:32] = -0.0  # negative zeros: scale 0, sign kept (code 8), as cvt.rn.satfinite does
    rows[1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # ties at scale 1
    rows[1, 16:32] = torch.tensor([1e-4] * 15 + [-1e-4])  # amax / 6 rounds to an e4m3 subnormal
    rows[1, 32:48] = torch.tensor([1e-5] * 16)  # ... or to 0: codes 0
    rows[2, :16] = torch.tensor([448.0 * 6 * 4] + [1.0] * 15)  # amax / 6 past e4m3's 448: saturated scale
    rows[3, 448:] = torch.linspace(-70000, 70000, 64)  # rope as bf16, any magnitude
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("case", ["edges", "random", "large"])
def test_the_packer_is_flashinfers_formula_byte_for_byte(case):
    rows = {"edges": _edge_rows(), "random": torch.randn(8, 512, generator=torch.Generator().manual_seed(1)),
            "large": torch.randn(4, 512, generator=torch.Generator().manual_seed(2)) * 1e4}[case].to(torch.bfloat16)
    data, scales = pack.quantize_nvfp4(rows)
    for r in range(rows.shape[0]):
        want_data, want_scales = encode_dsv4_nvfp4_row(rows[r].float().tolist())
        assert bytes(data[r].tolist()) == want_data, r
        assert bytes(scales[r].tolist()) == want_scales, r
    assert bool((scales[:, 28:] == 0).all())


@pytest.mark.parametrize("page_size, pad", [(64, 0), (2, 16), (256, 0)])
def test_write_and_gather_read_the_bytes_as_the_oracle_does(page_size, pad):
    pages = max(2, -(-70 // page_size))
    cache = pack.new_cache(pages, page_size, page_stride=REC.page_bytes(page_size) + pad, record=REC)
    rows = torch.randn(pages * page_size, 512, generator=torch.Generator().manual_seed(page_size)).to(torch.bfloat16)
    slots = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(3))
    pack.write(cache, rows, slots, page_size, REC)
    for s in (0, 1, page_size - 1, pages * page_size - 1):
        got = pack.gather(cache, torch.tensor([s]), page_size, REC)[0].tolist()
        assert got == dsv4_oracle_row(cache, s, page_size, "nvfp4"), s


def test_the_reference_on_nvfp4_caches_matches_the_float64_oracle():
    gen = torch.Generator().manual_seed(5)
    swa = pack.new_cache(2, 64, record=REC)
    comp = pack.new_cache(40, 2, record=REC)
    pack.write(swa, torch.randn(128, 512, generator=gen).to(torch.bfloat16), torch.arange(128), 64, REC)
    pack.write(comp, torch.randn(80, 512, generator=gen).to(torch.bfloat16), torch.arange(80), 2, REC)
    q = (torch.randn(3, 8, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(0, 128, (3, 20), generator=gen, dtype=torch.int32)
    swa_idx[0, :2] = torch.tensor([-1, 128])
    comp_idx = torch.randint(0, 80, (3, 12), generator=gen, dtype=torch.int32)
    swa_len, comp_len = torch.tensor([20, 5, 0], dtype=torch.int32), torch.tensor([12, 12, 0], dtype=torch.int32)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0, 0.0, 30.0, -3.0, 1.0])
    out = dsv4_attention_reference(q, swa, swa_idx, 64, sm_scale=512**-0.5, swa_lengths=swa_len, extra_cache=comp,
                                   extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=2, sinks=sinks,
                                   record=REC)
    want, _ = dsv4_sparse_attention(q, [(swa, swa_idx, swa_len, 64), (comp, comp_idx, comp_len, 2)], sinks, "nvfp4")
    assert EXACT_CLASS_BOUND.violations(measure(out, want)) == []
    assert bool((out[2] == 0).all())


def _fp4_case(heads, window_page, extra_page, seed):
    gen = torch.Generator().manual_seed(seed)
    swa = pack.new_cache(max(2, -(-96 // window_page)), window_page, record=REC)
    comp = pack.new_cache(max(2, -(-80 // extra_page)), extra_page, record=REC)
    for cache, page in ((swa, window_page), (comp, extra_page)):
        n = cache.shape[0] * page
        pack.write(cache, torch.randn(n, 512, generator=gen).to(torch.bfloat16), torch.arange(n), page, REC)
    q = (torch.randn(3, heads, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(0, swa.shape[0] * window_page, (3, 24), generator=gen, dtype=torch.int32)
    swa_idx[0, :2] = torch.tensor([-1, swa.shape[0] * window_page])  # -1 and out of range: masked
    comp_idx = torch.randint(0, comp.shape[0] * extra_page, (3, 16), generator=gen, dtype=torch.int32)
    lens = (torch.tensor([24, 5, 0], dtype=torch.int32), torch.tensor([16, 16, 0], dtype=torch.int32))
    sinks = torch.randn(heads, generator=gen)
    sinks[::3] = float("-inf")
    return q, swa, swa_idx, comp, comp_idx, lens, sinks


@pytest.mark.parametrize("heads, window_page, extra_page, which", [
    (8, 64, 2, "both"), (16, 64, 64, "window"), (24, 256, 64, "both"), (128, 32, 128, "both")])
def test_the_triton_kernel_reads_the_nvfp4_record_as_the_float64_oracle(heads, window_page, extra_page, which):
    from mla_sm120_plugin.kernels.dsv4.triton import dsv4_attention

    q, swa, swa_idx, comp, comp_idx, (swa_len, comp_len), sinks = _fp4_case(heads, window_page, extra_page, heads)
    extra = dict(extra_cache=comp, extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=extra_page)
    out = dsv4_attention(q, swa, swa_idx, window_page, sm_scale=512**-0.5, swa_lengths=swa_len, sinks=sinks,
                         record=REC, **(extra if which == "both" else {}))
    parts = [(swa, swa_idx, swa_len, window_page)] + ([(comp, comp_idx, comp_len, extra_page)] if which == "both" else [])
    want, _ = dsv4_sparse_attention(q, parts, sinks, "nvfp4")
    assert EXACT_CLASS_BOUND.violations(measure(out, want)) == []
    assert bool((out[2] == 0).all())
