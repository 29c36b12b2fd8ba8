"""DeepSeek-V4's 584-byte record and its torch reference, against an oracle written from the bytes.

The oracle here reads a page-major cache with Python integers and ``struct`` (docs/facts.md#deepseek-v4: a page is
``[P x 576 data | P x 8 scales]``; data = 448 e4m3 NoPE bytes + 64 little-endian bf16 rope values;
scales = 7 UE8M0 bytes, value = fp8 * 2 ** (byte - 127), + 1 pad) and computes the attention in
float64 (sink in the denominator only, V = K, masked -1 / out-of-range / past-length slots, zeros
for a token with no candidate). The packer is held to vLLM's own writer
(``quantize_and_insert_k_cache``, a Triton kernel, run by Triton's interpreter) byte for byte.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from support.layout_oracle import bf16, dsv4_oracle_row as oracle_row, e4m3_byte, e4m3fn
from support.oracle import dsv4_sparse_attention
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack
from mla_sm120_plugin.kernels.dsv4.reference import dsv4_attention_reference

SCALE = 512**-0.5
DATA, SCALES, NOPE = 576, 8, 448


def _cache(num_pages, page_size, rows_scale=1.0, seed=0, stride_pad=0):
    gen = torch.Generator().manual_seed(seed)
    cache = pack.new_cache(num_pages, page_size, page_stride=layout.FP8_RECORD.page_bytes(page_size) + stride_pad)
    slots = torch.arange(num_pages * page_size)
    rows = (torch.randn(slots.numel(), 512, generator=gen) * rows_scale).to(torch.bfloat16)
    pack.write(cache, rows, slots, page_size)
    return cache, rows


def test_the_record_is_584_bytes_page_major():
    rec = layout.FP8_RECORD
    assert (rec.token_bytes, rec.data_bytes, rec.scale_bytes, rec.num_scales) == (584, 576, 8, 7)
    # vLLM's padded pages (kv_cache_interface page_size_padded): 64 -> 37440, 2 -> 1728, 32 -> 19008
    assert [rec.page_bytes(p) for p in (64, 2, 32, 128, 256)] == [37440, 1728, 19008, 74880, 149760]
    assert rec.data_offset(70, 64, 37440) == 37440 + 6 * 576
    assert rec.scale_offset(70, 64, 37440) == 37440 + 64 * 576 + 6 * 8


@pytest.mark.parametrize("page_size,pad", [(64, 0), (2, 0), (32, 16), (256, 0)])
def test_packer_and_gather_agree_with_the_oracle(page_size, pad):
    cache, rows = _cache(3, page_size, stride_pad=pad, seed=page_size)
    for slot in (0, page_size - 1, page_size, 3 * page_size - 1):
        want = torch.tensor(oracle_row(cache, slot, page_size), dtype=torch.float32)
        assert torch.equal(pack.gather(cache, torch.tensor([slot]), page_size)[0], want)
        # rope is stored unscaled, NoPE within an e4m3 step of its group's scale
        assert torch.equal(want[448:], rows[slot, 448:].float())
        err = (want[:448] - rows[slot, :448].float()).abs().reshape(7, 64).amax(-1)
        amax = rows[slot, :448].float().abs().reshape(7, 64).amax(-1)
        assert bool((err <= amax * 2.0**-3).all())


def test_scale_bytes_follow_the_writers_formula_at_the_edges():
    rows = torch.zeros(4, 512)
    rows[1, :64] = 448.0  # exactly a power-of-two ratio: 448/448 = 1 -> exponent 0 (byte 127)
    rows[2, :64] = 448.5  # just above: rounds up to 2 (byte 128)
    rows[3, :64] = 1e-6  # under the 1e-4 amax floor: exponent -22 like a zero group
    _, scales = pack.quantize(rows)
    assert scales[0].tolist() == [105] * 7 + [0]  # all-zero group: ceil(log2(1e-4 / 448)) = -22
    assert scales[1, 0] == 127 and scales[2, 0] == 128 and scales[3, 0] == 105
    assert bool((scales[:, 7] == 0).all())


def _vllm_writer_kernel():
    """vLLM 0.33's ``quantize_and_insert_k_kernel`` (its DeepSeek-V4 window-cache writer), taken from
    its source file and jitted by the real Triton: importing the vLLM module costs a minute here
    (it pulls in vLLM's warm-up machinery) and, with no GPU, vLLM hands it a placeholder Triton."""
    import ast
    import importlib.util
    from pathlib import Path

    import triton
    import triton.language as tl

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed in this environment")
    path = Path(spec.submodule_search_locations[0]) / "models/deepseek_v4/common/ops/cache_utils.py"
    source = path.read_text()
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "quantize_and_insert_k_kernel")
    namespace = {"triton": triton, "tl": tl}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["quantize_and_insert_k_kernel"]


def test_the_packer_is_vllms_writer_byte_for_byte():
    """vLLM's DeepSeek-V4 window-cache writer (interpreted on the CPU) and the packer, with the launch
    arguments of vLLM's ``quantize_and_insert_k_cache``: every scale, rope, pad and untouched byte
    equal. The e4m3 value bytes are held to the writer's formula with the GPU's cast
    (``cvt.rn.satfinite``: nearest, ties to even) instead: Triton 3.8's interpreter rounds a bf16 to
    e4m3 wrongly where rounding carries into the exponent (31.75 -> 16, 127.5 -> 64) and breaks ties
    away from zero, so its value bytes are not what a GPU stores."""
    kernel = _vllm_writer_kernel()
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(12, 512, generator=gen).to(torch.bfloat16)
    rows[0] = 0  # all-zero groups
    rows[1, :64] = 448.0  # an exact power-of-two ratio
    rows[2] *= 1e-3  # small groups
    rows[3, 64:128] *= 300  # a large one
    rows[4, :448] *= 1e-5  # under the amax floor
    page_size = 16
    slots = torch.randperm(48, generator=gen)[:12]
    slots[5] = -1  # skipped by the writer
    theirs = pack.new_cache(3, page_size)
    kernel[(12,)](rows, slots.to(torch.int64), theirs, 12, input_dim=512, fp8_dim=448, bf16_dim=64, scale_dim=8,
                  quant_block=64, cache_block_size=page_size, token_data_size=576, block_stride=theirs.stride(0),
                  fp8_max=448.0, n_quant_blocks=8)
    ours = pack.new_cache(3, page_size)
    keep = slots >= 0
    pack.write(ours, rows[keep], slots[keep], page_size)
    values = torch.zeros_like(ours, dtype=torch.bool)
    for slot in slots[keep].tolist():
        page, row = divmod(slot, page_size)
        values[page, row * DATA: row * DATA + NOPE] = True
    assert torch.equal(ours[~values], theirs[~values])
    byte_of: dict[float, int] = {}
    for row_values, slot in zip(rows[keep].float().tolist(), slots[keep].tolist()):
        page, row = divmod(slot, page_size)
        scale_bytes = ours[page, page_size * DATA + row * SCALES: page_size * DATA + row * SCALES + 7].tolist()
        want = []
        for i, x in enumerate(row_values[:NOPE]):
            scaled = x * 2.0 ** (127 - scale_bytes[i // 64])
            if scaled not in byte_of:
                byte_of[scaled] = e4m3_byte(scaled)
            want.append(byte_of[scaled])
        assert ours[page, row * DATA: row * DATA + NOPE].tolist() == want, slot


def _two_cache_case(tokens=5, heads=8, window=24, extra=40, window_page=64, extra_page=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    swa, _ = _cache(2, window_page, seed=seed)
    comp, _ = _cache(max(2, -(-96 // extra_page)), extra_page, seed=seed + 1)
    swa_cap, comp_cap = swa.shape[0] * window_page, comp.shape[0] * extra_page
    q = (torch.randn(tokens, heads, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(0, swa_cap, (tokens, window), generator=gen, dtype=torch.int32)
    comp_idx = torch.randint(0, comp_cap, (tokens, extra), generator=gen, dtype=torch.int32)
    swa_idx[0, ::3] = -1  # -1 padding
    comp_idx[1, ::4] = comp_cap + 7  # out of range: masked, never read
    swa_len = torch.randint(0, window + 1, (tokens,), generator=gen, dtype=torch.int32)
    comp_len = torch.randint(0, extra + 1, (tokens,), generator=gen, dtype=torch.int32)
    swa_len[2], comp_len[2] = 0, 0  # a token with no candidate at all: zeros
    comp_len[3] = 1 << 30  # a length past the row: the whole row
    return q, swa, swa_idx, swa_len, comp, comp_idx, comp_len


SINKS = {
    "none": None,
    "finite": torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0, 4.0, -0.5]),
    "-inf": torch.full((8,), float("-inf")),
    "+large": torch.full((8,), 30.0),  # the sink takes nearly all the mass
}


@pytest.mark.parametrize("sink", list(SINKS))
@pytest.mark.parametrize("which", ["both", "window", "compressed"])
def test_reference_matches_the_float64_oracle(sink, which):
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(seed=len(sink) + len(which))
    sinks = SINKS[sink]
    if which == "compressed":  # the window rows all padding: only the compressed cache attends
        swa_idx = torch.full_like(swa_idx, -1)
    kwargs = dict(sm_scale=SCALE, swa_lengths=swa_len, sinks=sinks)
    parts = [(swa, swa_idx, swa_len, 64)]
    if which != "window":
        kwargs.update(extra_cache=comp, extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=2)
        parts.append((comp, comp_idx, comp_len, 2))
    out = dsv4_attention_reference(q, swa, swa_idx, 64, **kwargs)
    want, _ = dsv4_sparse_attention(q, parts, sinks)
    assert torch.equal(out[2].float(), torch.zeros(8, 512)) or which == "window" and swa_len[2] > 0
    acc = measure(out, want)
    assert not EXACT_CLASS_BOUND.violations(acc), acc


@pytest.mark.parametrize("heads,window_page,extra_page", [(16, 32, 128), (32, 64, 64), (13, 256, 2)])
def test_reference_pages_and_head_counts(heads, window_page, extra_page):
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(
        tokens=4, heads=heads, window_page=window_page, extra_page=extra_page, seed=heads)
    out = dsv4_attention_reference(q, swa, swa_idx, window_page, sm_scale=SCALE, swa_lengths=swa_len,
                                   extra_cache=comp, extra_indices=comp_idx, extra_lengths=comp_len,
                                   extra_page_size=extra_page)
    want, _ = dsv4_sparse_attention(q, [(swa, swa_idx, swa_len, window_page), (comp, comp_idx, comp_len, extra_page)],
                                    None)
    assert not EXACT_CLASS_BOUND.violations(measure(out, want))


def test_a_wrong_page_size_is_caught_by_the_oracle():
    """The comparison can fail: a compressed cache of 2-entry pages read as 1-entry pages (each
    page's scale rows then sit elsewhere) is far outside the bound."""
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(seed=9)
    out = dsv4_attention_reference(q, swa, swa_idx, 64, sm_scale=SCALE, swa_lengths=swa_len, extra_cache=comp,
                                   extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=1)
    want, _ = dsv4_sparse_attention(q, [(swa, swa_idx, swa_len, 64), (comp, comp_idx, comp_len, 2)], None)
    assert EXACT_CLASS_BOUND.violations(measure(out, want))


@pytest.mark.parametrize("bad", ["q", "indices", "page", "sinks", "half"])
def test_bad_input_is_refused_naming_the_argument(bad):
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case()
    kwargs = dict(sm_scale=SCALE, swa_lengths=swa_len)
    args = [q, swa, swa_idx, 64]
    if bad == "q":
        args[0] = q[..., :500]
    elif bad == "indices":
        args[2] = swa_idx.float()
    elif bad == "page":
        args[3] = 4096
    elif bad == "sinks":
        kwargs["sinks"] = torch.zeros(3)
    else:
        kwargs["extra_cache"] = comp
    with pytest.raises(KernelInputError) as err:
        dsv4_attention_reference(*args, **kwargs)
    assert "given:" in str(err.value) and "fix:" in str(err.value)


# ---------------------------------------------------------------- the Triton kernel

triton_mod = pytest.importorskip("mla_sm120_plugin.kernels.dsv4.triton")


def _run_both(q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, window_page=64, extra_page=2, sinks=None,
              which="both"):
    kwargs = dict(sm_scale=SCALE, swa_lengths=swa_len, sinks=sinks)
    parts = [(swa, swa_idx, swa_len, window_page)]
    if which != "window":
        kwargs.update(extra_cache=comp, extra_indices=comp_idx, extra_lengths=comp_len, extra_page_size=extra_page)
        parts.append((comp, comp_idx, comp_len, extra_page))
    out = triton_mod.dsv4_attention(q, swa, swa_idx, window_page, **kwargs)
    return out, dsv4_sparse_attention(q, parts, sinks)[0]


@pytest.mark.parametrize("sink", list(SINKS))
@pytest.mark.parametrize("which", ["both", "window", "compressed"])
def test_triton_kernel_matches_the_float64_oracle(sink, which):
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(seed=len(sink) + len(which))
    if which == "compressed":
        swa_idx = torch.full_like(swa_idx, -1)
    out, want = _run_both(q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, sinks=SINKS[sink], which=which)
    assert out.dtype == torch.bfloat16 and torch.equal(out[2].float(), torch.zeros(8, 512)) or which == "window"
    acc = measure(out, want)
    assert not EXACT_CLASS_BOUND.violations(acc), acc


@pytest.mark.parametrize("heads,window_page,extra_page", [(16, 32, 128), (13, 256, 2), (64, 64, 64)])
def test_triton_kernel_pages_and_head_counts(heads, window_page, extra_page):
    case = _two_cache_case(tokens=4, heads=heads, window=40, extra=33, window_page=window_page,
                           extra_page=extra_page, seed=heads)
    out, want = _run_both(*case, window_page=window_page, extra_page=extra_page)
    assert not EXACT_CLASS_BOUND.violations(measure(out, want))


def test_triton_kernel_converts_wide_lengths_and_sinks():
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(seed=5)
    sinks = SINKS["finite"].double()
    lengths = comp_len.to(torch.int64)
    lengths[0] = 2**40  # past int32: the whole row
    out = triton_mod.dsv4_attention(q, swa, swa_idx, 64, sm_scale=SCALE, swa_lengths=swa_len.to(torch.int64),
                                    extra_cache=comp, extra_indices=comp_idx, extra_lengths=lengths,
                                    extra_page_size=2, sinks=sinks)
    want, _ = dsv4_sparse_attention(q, [(swa, swa_idx, swa_len, 64), (comp, comp_idx, lengths.clamp(max=2**31 - 1), 2)],
                                    sinks.float())
    assert not EXACT_CLASS_BOUND.violations(measure(out, want))


@pytest.mark.parametrize("bad", ["page", "indices64", "odd", "extra_alone", "sinks"])
def test_triton_kernel_refuses_bad_input(bad):
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case()
    kwargs = dict(sm_scale=SCALE)
    args = [q, swa, swa_idx, 64]
    if bad == "page":
        args[3] = 65
    elif bad == "indices64":
        args[2] = swa_idx.to(torch.int64)
    elif bad == "odd":
        args[1] = torch.zeros(2, swa.shape[1] + 1, dtype=torch.uint8)[:, 1:]
    elif bad == "extra_alone":
        kwargs["extra_indices"] = comp_idx
    else:
        kwargs["sinks"] = torch.zeros(9)
    with pytest.raises(KernelInputError) as err:
        triton_mod.dsv4_attention(*args, **kwargs)
    assert "given:" in str(err.value) and "fix:" in str(err.value)


def test_triton_kernel_clamps_lengths_to_the_rows_width():
    """Lengths above the row's width on index views whose buffers hold valid slots past it: only the
    row's own slots count (removing the in-kernel clamp reads the next ones and fails here)."""
    q, swa, swa_idx, swa_len, comp, comp_idx, comp_len = _two_cache_case(seed=11)
    wide_swa = torch.randint(0, 128, (swa_idx.shape[0], swa_idx.shape[1] + 16), dtype=torch.int32)
    wide_comp = torch.randint(0, 96, (comp_idx.shape[0], comp_idx.shape[1] + 16), dtype=torch.int32)
    view_swa, view_comp = wide_swa[:, :swa_idx.shape[1]], wide_comp[:, :comp_idx.shape[1]]
    over = torch.full_like(swa_len, swa_idx.shape[1] + 9), torch.full_like(comp_len, comp_idx.shape[1] + 16)
    out = triton_mod.dsv4_attention(q, swa, view_swa, 64, sm_scale=SCALE, swa_lengths=over[0], extra_cache=comp,
                                    extra_indices=view_comp, extra_lengths=over[1], extra_page_size=2)
    want, _ = dsv4_sparse_attention(q, [(swa, view_swa, None, 64), (comp, view_comp, None, 2)], None)
    assert not EXACT_CLASS_BOUND.violations(measure(out, want))
