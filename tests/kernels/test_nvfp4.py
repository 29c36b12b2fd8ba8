"""nvfp4_ds_mla (352-byte rows): the packer against vLLM's writer formula written again in
tests/support/layout_oracle.py (Python floats and bit fields; vLLM's writer needs an sm_100a/sm_120a GPU for
its ``cvt.rn.satfinite.e2m1x2.f32``, so it cannot run here), the dequantizer and the torch reference
against the oracle's decoder and float64 attention."""

from __future__ import annotations

import functools

import pytest
import torch

from support import layout_oracle
from support.kernel_checks import KERNEL_REL_TOL
from support.oracle import sparse_attention
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla

NV = layout.NVFP4_DS_MLA
BLOCK = 16


@pytest.fixture
def nv_case(make_case):
    """nvfp4 cases on the test device (the CPU here: Triton under its interpreter), fp32 q."""
    return functools.partial(make_case, kv_layout=NV, q_dtype=torch.float32)


def _oracle_bytes(latent: torch.Tensor) -> list[bytes]:
    return [layout_oracle.encode_nvfp4_row([float(v) for v in row]) for row in latent.float()]


def _rows(packed: torch.Tensor) -> list[bytes]:
    return [bytes(row.tolist()) for row in packed]


def _edge_rows() -> torch.Tensor:
    """Rows whose blocks hit every rounding and range edge of the writer (fp32 values)."""
    rows = torch.zeros(4, layout.HEAD_DIM)
    blocks = rows[:, : layout.KV_LORA_RANK].view(4, 32, BLOCK)
    # Block 0: all zeros (amax 0: the 2**-9 floor scale). Block 1: -0.0 everywhere (code 8).
    blocks[:, 1] = -0.0
    # Blocks 2-3: amax 6 -> sf 1 exactly, so x / sf sits on every e2m1 tie, both signs.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    blocks[:, 2, :8], blocks[:, 2, 8:] = ties, -ties
    blocks[:, 3, :8], blocks[:, 3, 8:] = ties.flip(0), -ties.flip(0)
    # Block 4: amax 6.4 -> 6.4 * fp32(1/6) = 1.0667 rounds to sf 1.0, so 6.4 saturates to 6.
    blocks[:, 4] = torch.linspace(-6.4, 6.4, BLOCK)
    # Block 5: amax below 6 * 2**-9 (the floor), values rounding to 0, 0.5 and ties of the floor scale.
    blocks[:, 5] = torch.tensor([2.0**-9 * v for v in (0.2, 0.25, 0.3, 0.5, 0.75, 1, 1.25, 1.75, 2.5, 3.5, 5, -0.1,
                                                        -0.25, -0.75, -2.5, 1e-30)])
    # Block 6: huge amax (scale saturates at 448: values past 6 * 448 saturate to 6).
    blocks[:, 6] = torch.linspace(-5000.0, 5000.0, BLOCK)
    # Block 7: tiny negatives that round to -0, beside a positive amax.
    blocks[:, 7] = torch.tensor([1.0] + [-1e-3] * 15)
    # Block 8: an amax whose scale the writer's multiply by fp32(1/6) rounds to e4m3 0.3125 where a
    # division by 6 would give 0.28125 (found by scanning fp32 neighbours of 6 x each e4m3 midpoint).
    blocks[:, 8] = torch.linspace(-1.0, 1.0, BLOCK) * 1.7812498807907104
    # Blocks 9..31: random, each block its own magnitude (scales over many octaves).
    gen = torch.Generator().manual_seed(5)
    gains = 2.0 ** torch.randint(-12, 10, (4, 23, 1), generator=gen).float()
    blocks[:, 9:] = torch.randn(4, 23, BLOCK, generator=gen) * gains
    # Rope: e4m3 ties, saturation past 448, -0.0, tiny values.
    rope = rows[:, layout.KV_LORA_RANK :]
    rope[:, :8] = torch.tensor([1.0625, 1.1875, 500.0, -1000.0, -0.0, 2.0**-10, 464.0, -2.0**-12])
    rope[:, 8:] = torch.randn(4, layout.ROPE_DIM - 8, generator=gen) * 3
    return rows


def test_packer_is_vllms_writer_on_edge_values():
    """Zeros, -0, every e2m1 tie, saturation at 6 * sf, amax under the 2**-9 floor, a saturated scale,
    the rope's e4m3 ties and saturation: byte for byte the writer's formula."""
    rows = _edge_rows()
    assert _rows(pack.pack(rows, NV)) == _oracle_bytes(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packer_is_vllms_writer_on_random_tokens(dtype):
    gen = torch.Generator().manual_seed(11)
    latent = torch.randn(12, layout.HEAD_DIM, generator=gen) * (10.0 ** torch.randint(-4, 4, (12, 1), generator=gen))
    latent = latent.to(dtype)
    assert _rows(pack.pack(latent, NV)) == _oracle_bytes(latent)


def test_nibble_order_and_scale_permutation():
    """Element 2i in the low nibble of byte i; block s's scale at byte 320 + 8 * (s & 3) + (s >> 2)."""
    latent = torch.zeros(1, layout.HEAD_DIM)
    for s in range(32):
        # Block s: amax 6 * 2**(s - 23), so its scale is the exact e4m3 value 2**(s - 23) (2**-9 at
        # s = 14 up to 2**8; below s = 14, the 2**-9 floor).
        latent[0, s * BLOCK] = 0.5 * 2.0 ** (s - 23)  # code 1 in the low nibble
        latent[0, s * BLOCK + 1] = 6.0 * 2.0 ** (s - 23)  # code 7 in the high nibble
    row = pack.pack(latent, NV)[0].tolist()
    for s in range(32):
        scale = layout_oracle.E4M3FN[row[320 + 8 * (s & 3) + (s >> 2)]]
        assert scale == max(2.0 ** (s - 23), 2.0**-9), s
        if s >= 14:
            assert row[s * BLOCK // 2] == 0x71, s
    assert row[320:352:8] == [0x01, 0x01, 0x01, 0x01]  # blocks 0, 4, 8, 12: the floor 2**-9, e4m3 0x01


def test_dequantize_matches_the_oracle_decoder():
    rows = pack.pack(_edge_rows(), NV)
    got = pack.dequantize(rows, NV).double()
    want = torch.tensor([layout_oracle.decode_row(r, NV) for r in _rows(rows)], dtype=torch.float64)
    assert torch.equal(got, want)
    # A page-strided view decodes the same.
    cache = torch.zeros(2, 3 * layout.NVFP4_DS_MLA_TOKEN_BYTES + 16, dtype=torch.uint8)
    view = cache.as_strided((2, 2, 352), (cache.stride(0), 352, 1))
    view.copy_(rows.view(2, 2, 352))
    assert torch.equal(pack.dequantize(view, NV).double().reshape(4, -1), want)


def test_layout_numbers():
    lay = layout.get(NV)
    assert (lay.token_bytes, lay.rope_offset, lay.scale_offset, lay.used, lay.num_scales, lay.element) == (
        352, 256, 320, 352, 32, "uint8")
    assert not lay.fp8 and lay.nvfp4 and NV not in layout.FP8_LAYOUTS
    assert layout.TOKEN_BYTES[layout.FP8_DS_MLA] / layout.TOKEN_BYTES[NV] == pytest.approx(1.8636, abs=1e-4)


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(KernelInputError, match="(?s)given.*latent shape.*supported.*576"):
        pack.pack(torch.zeros(2, 512), NV)
    with pytest.raises(KernelInputError, match="rows dtype"):
        pack.dequantize(torch.zeros(2, 352, dtype=torch.bfloat16), NV)
    with pytest.raises(KernelInputError, match="nvfp4_ds_mla"):
        pack.dequantize(torch.zeros(2, 656, dtype=torch.uint8), NV)


# Adversarial cases: -1 and out-of-range ids (the builder's 20 % junk), duplicates, short topk_length,
# top-k 37 and 2048, heads 4/5/16/64, page-strided caches.
REFERENCE_CASES = {
    "h4_topk37": dict(num_heads=4, topk=37),
    "h5_strided": dict(num_heads=5, topk=64, page_pad=48),
    "h16_dups": dict(num_heads=16, topk=64, duplicates=True),
    "h64_short": dict(num_heads=64, topk=96, short=True),
    "h4_topk2048": dict(num_heads=4, topk=2048, num_pages=40, num_tokens=2),
}


def _adversarial(nv_case, name):
    opts = dict(REFERENCE_CASES[name])
    dups, short = opts.pop("duplicates", False), opts.pop("short", False)
    case = nv_case(**opts)
    if dups:
        case.indices[:, 1::2] = case.indices[:, 0::2]
    topk_length = None
    if short:
        topk_length = torch.tensor([0, 1, 37, 96][: case.q.shape[0]], dtype=torch.int32, device=case.q.device)
    return case, topk_length


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_kernels_match_float64_attention_over_the_oracles_rows(nv_case, name, kernel):
    """The torch reference and the exact Triton kernel (split-K decode path, forced, so partials and
    the combine run) against float64 attention over the rows the oracle decodes. Tolerance:
    :data:`support.kernel_checks.KERNEL_REL_TOL` of the output's magnitude for the Triton kernel (its dot operands
    are bf16, on a GPU and in the interpreter alike: the dequantized keys and values are exact in
    bf16, e2m1 x e4m3 having at most 5 significant bits, so only q's and the probabilities' rounding
    remains, as for every other layout), 2e-5 for the reference (fp32 dots)."""
    case, topk_length = _adversarial(nv_case, name)
    keys = layout_oracle.decode_cache(case.kv_cache, NV)
    want, want_lse = sparse_attention(case.q, keys, case.indices, case.sm_scale, topk_length=topk_length)
    args = dict(sm_scale=case.sm_scale, kv_layout=NV, topk_length=topk_length, return_lse=True)
    if kernel == "reference":
        if case.q.device.type != "cpu":
            pytest.skip("the reference's fp32 bound is checked on the CPU")
        got, lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, **args)
        rel = 2e-5
    else:
        blocks = -(-case.indices.shape[1] // tk.BLOCK_K)
        cfg = tk.LaunchConfig(tk.BLOCK_H, tk.BLOCK_K, min(blocks, 4), -(-blocks // min(blocks, 4)), tk.NUM_WARPS,
                              tk.NUM_STAGES)
        got, lse = tk._run(case.q, case.kv_cache, case.indices, sink=None, out=None, lse_base="e", config=cfg, **args)
        rel = KERNEL_REL_TOL
    got, lse = got.double().cpu(), lse.double().cpu()
    scale = want.abs().max().clamp(min=1.0)
    assert ((got - want).abs().max() / scale) <= rel
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], want_lse[finite], atol=100 * rel)


def test_cache_error_is_what_nvfp4_costs():
    """Quantization error of the dequantized latent: <= half an e2m1 step of the block's scale
    (relative to the block's amax: 1/6 at the coarsest step, 2 -> 3 -> 4 -> 6), never more."""
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(64, layout.HEAD_DIM, generator=gen)
    back = pack.dequantize(pack.pack(latent, NV), NV)
    blocks = latent[:, :512].reshape(64, 32, BLOCK)
    err = (back[:, :512].reshape(64, 32, BLOCK) - blocks).abs().amax(-1)
    amax = blocks.abs().amax(-1)
    assert torch.all(err <= amax / 6 * (1 + 1 / 16))  # half the widest step (4 -> 6) of a scale within 1/16
    rope = latent[:, 512:]
    assert torch.all((back[:, 512:] - rope).abs() <= rope.abs() * 2.0**-4 + 2.0**-10)  # e4m3: 3 mantissa bits
