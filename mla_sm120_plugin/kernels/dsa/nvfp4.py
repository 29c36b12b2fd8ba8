"""The ``nvfp4_ds_mla`` row (352 bytes, :data:`.layout.NVFP4_DSA`) in torch: vLLM's writer and its inverse.

vLLM 0.33.0 fills this cache in ``models/deepseek_v32/common/kernels.py`` (``_fused_norm_rope_kernel``,
``MLA_CACHE_NVFP4``); :func:`pack_rows` reproduces that writer's arithmetic, step for step, in fp32:

1. ``amax`` of each 16-value block of the latent (fp32);
2. ``sf = e4m3(max(amax * fp32(1/6), 2**-9))``: a multiply by the fp32 constant 1/6 (not a
   division; the PTX is ``mul.f32 amax, 0f3E2AAAAB``), then ``cvt.rn.satfinite.e4m3x2.f32``:
   round to nearest even, saturating at 448;
3. ``q = x * (1 / sf)``: the reciprocal in fp32 (Triton's ``/`` is ``div.full.f32``, which ptxas
   lowers to ``MUFU.RCP`` for sm_120a; we take the correctly rounded reciprocal, equal wherever
   ``MUFU.RCP`` rounds correctly: the only inputs are the 126 positive e4m3 values, 8 mantissas);
4. ``cvt.rn.satfinite.e2m1x2.f32``: round to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6},
   saturating at 6, the sign kept (a negative value that rounds to 0 is stored as -0, code 8);
5. the rope: ``cvt.rn.satfinite.e4m3`` of each value, no scale.

The writer's e2m1 instruction does not run on this machine's CPU (nor on sm_90a): the tests check
this packer against the formula written again with integer arithmetic (tests/layout_oracle.py).

A stored value is ``e2m1 * sf``: at most 2 x 4 significant bits, so it is exact in fp32 and in
bfloat16, which is how the kernels read it.
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.kernels.dsa import layout

# e2m1 code -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Code boundaries of round-to-nearest-even over the magnitudes above: a magnitude past each one
# adds 1 to the code. At a tie the even code (mantissa bit 0) wins, so a tie stays below the
# boundary when the lower code is even (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4) and goes up when
# the upper is (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4): strict ">" for the first kind, ">=" for the other.
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)

_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # the writer's fp32 constant 0x3E2AAAAB


def scale_byte(block: int, num_scales: int = layout.KV_LORA_RANK // layout.NVFP4_BLOCK) -> int:
    """Where block ``block``'s scale is stored among the row's scale bytes: ``8 * (s & 3) + (s >> 2)``
    for 32 scales (a 4 x 8 transpose, so one FlashMLA thread's 8 scales are contiguous)."""
    rows = layout.NVFP4_SCALE_PERMUTE_ROWS
    return (num_scales // rows) * (block % rows) + block // rows


def _scale_positions(num_scales: int, device) -> torch.Tensor:
    """[num_scales] int64: the stored byte of each block's scale (:func:`scale_byte`)."""
    return torch.tensor([scale_byte(s, num_scales) for s in range(num_scales)], dtype=torch.int64, device=device)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e2m1 codes like ``cvt.rn.satfinite.e2m1x2.f32``: nearest, ties to even,
    saturating at +-6, sign kept. NaN is not handled (the writer is never given one).

    q: [...], float32
    returns: [...], uint8 codes 0..15
    """
    mag = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for edge in _STRICT:
        code += (mag > edge).to(torch.uint8)
    for edge in _INCLUSIVE:
        code += (mag >= edge).to(torch.uint8)
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def _e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn like ``cvt.rn.satfinite.e4m3x2.f32``: nearest even, +-448 past the range
    (torch's own cast gives NaN there)."""
    return x.clamp(-layout.FP8_E4M3_MAX, layout.FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def block_scales(latent: torch.Tensor) -> torch.Tensor:
    """The writer's e4m3 scale of each 16-value block.

    latent: [N, 512], float32
    returns: [N, 32], float8_e4m3fn
    """
    n, width = latent.shape
    amax = latent.reshape(n, width // layout.NVFP4_BLOCK, layout.NVFP4_BLOCK).abs().amax(dim=-1)  # [N, 32]
    ratio = torch.clamp(amax * _ONE_SIXTH.to(latent.device), min=layout.NVFP4_SCALE_FLOOR)
    return _e4m3_satfinite(ratio)


def pack_rows(latent: torch.Tensor, lay: layout.CacheLayout) -> torch.Tensor:
    """Rows of ``lay`` (an nvfp4 layout) from checked tokens, as vLLM's writer stores them.

    latent: [N, lay.head_dim], bfloat16 or float32 (512 latent, then 64 rope)
    returns: [N, lay.row], uint8
    """
    n = latent.shape[0]
    x = latent.float()
    nope = x[:, : lay.latent]  # [N, 512]
    sf = block_scales(nope)  # [N, 32] e4m3
    recip = torch.reciprocal(sf.float())  # [N, 32] fp32
    q = (nope.reshape(n, lay.num_scales, -1) * recip[:, :, None]).reshape(n, lay.latent)  # [N, 512]
    codes = e2m1_codes(q)  # [N, 512]
    packed = torch.zeros(n, lay.row, dtype=torch.uint8, device=latent.device)  # [N, 352]
    packed[:, : lay.latent_bytes] = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even element in the low nibble
    if lay.rope:
        packed[:, lay.rope_offset : lay.rope_offset + lay.rope] = _e4m3_satfinite(x[:, lay.latent :]).view(torch.uint8)
    scales = torch.empty(n, lay.num_scales, dtype=torch.uint8, device=latent.device)  # [N, 32], stored order
    scales[:, _scale_positions(lay.num_scales, latent.device)] = sf.view(torch.uint8)
    packed[:, lay.scale_offset : lay.scale_offset + lay.scale_bytes] = scales
    return packed


def dequantize_rows(rows: torch.Tensor, lay: layout.CacheLayout) -> torch.Tensor:
    """Rows of ``lay`` (an nvfp4 layout) as fp32 values: ``e2m1 * scale`` (exact), the e4m3 rope widened.

    rows: [..., lay.row], uint8, any strides
    returns: [..., lay.head_dim], float32
    """
    lead = rows.shape[:-1]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=rows.device)  # [16]
    packed = rows[..., : lay.latent_bytes].long()  # [..., 256]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, lay.latent)  # [..., 512]
    stored = rows[..., lay.scale_offset : lay.scale_offset + lay.scale_bytes]  # [..., 32], permuted
    sf = stored[..., _scale_positions(lay.num_scales, rows.device)].contiguous().view(torch.float8_e4m3fn).float()
    values = torch.empty(*lead, lay.head_dim, dtype=torch.float32, device=rows.device)  # [..., 576]
    block = lay.latent_format.block
    values[..., : lay.latent] = (table[codes].unflatten(-1, (lay.num_scales, block)) * sf[..., None]).flatten(-2)
    if lay.rope:
        rope = rows[..., lay.rope_offset : lay.rope_offset + lay.rope].contiguous()
        values[..., lay.latent :] = rope.view(torch.float8_e4m3fn).float()
    return values
