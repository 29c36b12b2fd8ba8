"""Byte-level checks of the fp8_ds_mla / bf16 packers and the paged-cache writer (the rope-less
layouts' bytes: test_nope.py)."""

from __future__ import annotations

import functools
import math
import struct

import numpy
import pytest
import torch

from support import layout_oracle
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsa import layout, pack

@pytest.fixture
def make_case(make_case):
    """Packing is torch code tested on the CPU."""
    return functools.partial(make_case, device="cpu")


TILE = layout.FP8_TILE


def _latent(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, layout.HEAD_DIM, generator=gen)
    # Tile i of row r scaled by 4**i * 10**(r % 5 - 2): scales spread over many octaves.
    gains = (4.0 ** torch.arange(layout.FP8_NUM_TILES)).repeat_interleave(TILE)
    x[:, : layout.KV_LORA_RANK] *= gains * (10.0 ** (torch.arange(n) % 5 - 2))[:, None]
    return x.to(torch.bfloat16)


def _scales(packed: torch.Tensor) -> torch.Tensor:
    return packed[:, layout.FP8_SCALE_OFFSET : layout.FP8_ROPE_OFFSET].contiguous().view(torch.float32)


def _tile_amax(latent: torch.Tensor) -> torch.Tensor:
    return latent[:, : layout.KV_LORA_RANK].float().reshape(-1, layout.FP8_NUM_TILES, TILE).abs().amax(-1)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_tile_bytes_are_the_nearest_fp8_of_value_over_own_scale(scale_format):
    """Read back by the independent decoder (tests/support/layout_oracle.py): each latent byte is the e4m3
    value nearest to x / its tile's stored scale (ties to even, saturating at 448), the quotient
    taken in float32 as the packer documents."""
    latent = _latent(6)
    packed = pack.quantize_fp8_ds_mla(latent, scale_format)
    assert packed.dtype == torch.uint8 and packed.shape == (6, layout.FP8_DS_MLA_TOKEN_BYTES)
    raw = packed.numpy().tobytes()
    for r in range(6):
        row = raw[r * 656:(r + 1) * 656]
        scales = struct.unpack("<4f", row[512:528])
        for i in range(512):
            quotient = float(numpy.float32(float(latent[r, i])) / numpy.float32(scales[i // TILE]))
            want = layout_oracle.nearest_e4m3(quotient)
            assert layout_oracle.e4m3fn(row[i]) == want, (r, i)


def test_pow2_scales_are_smallest_power_of_two_covering_amax():
    latent = _latent(10)
    latent[3, TILE : 2 * TILE] = 1e-7  # below the 1e-4 * 448 floor
    scales = _scales(pack.quantize_fp8_ds_mla(latent, layout.SCALE_POW2)).double()
    exponents = torch.log2(scales)
    assert torch.equal(exponents, exponents.round()), "pow2 scales must be exact powers of two"
    ratio = (_tile_amax(latent) / layout.FP8_E4M3_MAX).double().clamp(min=layout.POW2_SCALE_FLOOR)
    assert torch.all(scales >= ratio) and torch.all(scales / 2 < ratio)
    assert scales[3, 1].item() == 2.0 ** math.ceil(math.log2(layout.POW2_SCALE_FLOOR))


def test_pow2_scale_of_exact_power_of_two_is_not_doubled():
    latent = torch.zeros(1, layout.HEAD_DIM)
    latent[0, : layout.KV_LORA_RANK] = 448.0 * 2.0**-3  # amax / 448 is exactly 2**-3
    assert _scales(pack.quantize_fp8_ds_mla(latent, layout.SCALE_POW2))[0, 0].item() == 2.0**-3


def test_arbitrary_scales_are_amax_over_448_and_zero_tile_gets_documented_scale():
    latent = _latent(10)
    latent[2, 2 * TILE : 3 * TILE] = 0
    packed = pack.quantize_fp8_ds_mla(latent, layout.SCALE_ARBITRARY)
    scales = _scales(packed)
    expected = _tile_amax(latent) / layout.FP8_E4M3_MAX
    expected[2, 2] = pack.ZERO_TILE_SCALE
    assert torch.equal(scales, expected)
    zero_tile = packed[2, 2 * TILE : 3 * TILE]
    assert torch.all(zero_tile.view(torch.float8_e4m3fn).float() == 0)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_rope_bytes_are_the_bf16_input_bit_for_bit(src_dtype):
    latent = _latent(7).to(src_dtype)
    packed = pack.quantize_fp8_ds_mla(latent, layout.SCALE_ARBITRARY)
    rope_bits = packed[:, layout.FP8_ROPE_OFFSET :].contiguous().view(torch.int16)
    expected = latent[:, layout.KV_LORA_RANK :].to(torch.bfloat16).contiguous().view(torch.int16)
    assert torch.equal(rope_bits, expected)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_round_trip_within_e4m3_rounding(scale_format):
    # e4m3 keeps 3 mantissa bits: round-to-nearest errs by at most 2**-4 of the value for normals,
    # and by half the smallest subnormal step (2**-10 * scale) below 2**-6 * scale.
    latent = _latent(20)
    packed = pack.quantize_fp8_ds_mla(latent, scale_format)
    back = pack.dequantize_fp8_ds_mla(packed)
    assert back.dtype == torch.float32 and back.shape == (20, layout.HEAD_DIM)
    x = latent.float()
    scale = _scales(packed).repeat_interleave(TILE, dim=1)  # [N, 512]
    err = (back[:, : layout.KV_LORA_RANK] - x[:, : layout.KV_LORA_RANK]).abs()
    bound = 2.0**-4 * x[:, : layout.KV_LORA_RANK].abs() + 2.0**-10 * scale
    assert torch.all(err <= bound * (1 + 1e-6))
    assert torch.equal(back[:, layout.KV_LORA_RANK :], x[:, layout.KV_LORA_RANK :])
    # The values are the bytes' values, as a decoder written from the layout reads them (exact in
    # float64; the packer's fp32 product rounds once).
    torch.testing.assert_close(back.double(), layout_oracle.decode_cache(packed, layout.FP8_DS_MLA),
                               rtol=2.0**-24, atol=0)
    # Dequantizing a [P, page, 656] view gives the same values.
    assert torch.equal(pack.dequantize_fp8_ds_mla(packed.view(4, 5, -1)).view(20, -1), back)


def test_pack_bf16_rounds_to_bf16():
    x = torch.randn(3, layout.HEAD_DIM)
    packed = pack.pack_bf16(x)
    assert packed.dtype == torch.bfloat16 and packed.shape == (3, layout.BF16_TOKEN_ELEMS)
    assert torch.equal(packed, x.to(torch.bfloat16))


def test_bad_inputs_raise_kernel_input_error():
    with pytest.raises(KernelInputError, match="latent shape"):
        pack.quantize_fp8_ds_mla(torch.zeros(2, 512), layout.SCALE_POW2)
    with pytest.raises(KernelInputError, match="scale_format"):
        pack.quantize_fp8_ds_mla(torch.zeros(2, layout.HEAD_DIM), "e8m0")
    with pytest.raises(KernelInputError, match="kv_layout"):
        pack.make_cache(1, "fp8")


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
@pytest.mark.parametrize("page_pad", [0, 32])
def test_write_to_cache_puts_each_token_at_its_page_and_row(kv_layout, page_pad, make_paged_cache):
    page_size, num_pages = 8, 4
    cache = make_paged_cache(num_pages, kv_layout, page_size, page_pad)
    latent = _latent(4)[:, : layout.get(kv_layout).head_dim]  # the rope-less layouts take the latent alone
    tokens = pack.pack(latent, kv_layout, "pow2")
    slots = torch.tensor([0, 13, -1, 31])  # page 0 row 0, page 1 row 5, padding, page 3 row 7
    pack.write_to_cache(cache, tokens, slots, page_size)
    assert torch.equal(cache[0, 0], tokens[0])
    assert torch.equal(cache[1, 5], tokens[1])
    assert torch.equal(cache[3, 7], tokens[3])
    written = torch.zeros(num_pages, page_size, dtype=torch.bool)
    written[0, 0] = written[1, 5] = written[3, 7] = True
    assert torch.all(cache[~written] == 0), "the -1 slot or a wrong slot was written"
    if page_pad:  # the padding between pages stays untouched
        base = torch.as_strided(cache, (num_pages, page_pad), (cache.stride(0), 1), page_size * cache.shape[2])
        assert torch.all(base == 0)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        pack.write_to_cache(cache, tokens[:1], torch.tensor([num_pages * page_size]), page_size)


def test_flat_view_is_a_view_when_pages_are_packed_and_a_copy_when_strided(make_paged_cache):
    cache = make_paged_cache(3, layout.FP8_DS_MLA, 8, 0)
    flat = pack.flat_view(cache)
    assert flat.shape == (24, layout.FP8_DS_MLA_TOKEN_BYTES) and flat.data_ptr() == cache.data_ptr()
    flat[9, 0] = 7
    assert cache[1, 1, 0].item() == 7

    strided = make_paged_cache(3, layout.FP8_DS_MLA, 8, 16)
    strided[2, 3, 5] = 9
    flat = pack.flat_view(strided)
    assert flat.shape == (24, layout.FP8_DS_MLA_TOKEN_BYTES) and flat[19, 5].item() == 9
    assert flat.untyped_storage().data_ptr() != strided.untyped_storage().data_ptr()
