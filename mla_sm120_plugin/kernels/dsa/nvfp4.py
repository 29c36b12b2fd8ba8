"""The ``nvfp4_ds_mla`` row (352 bytes, :data:`.layout.NVFP4_DSA`) in torch: vLLM's writer and its inverse.

:func:`pack_rows` reproduces, step for step in fp32, the writer vLLM fills this cache with
(``_fused_norm_rope_kernel``, ``MLA_CACHE_NVFP4``, in vLLM's
``models/deepseek_v32/common/kernels.py``, the same in 0.33 and 0.34):

1. ``amax`` of each 16-value block of the latent (fp32);
2. ``sf = e4m3(max(amax * fp32(1/6), 2**-9))``: a multiply by the fp32 constant 1/6, then
   ``cvt.rn.satfinite.e4m3x2.f32`` (nearest even, saturating at 448);
3. ``q = x * (1 / sf)``, the reciprocal in fp32;
4. ``cvt.rn.satfinite.e2m1x2.f32`` of ``q`` (:func:`~mla_sm120_plugin.kernels.shared.formats.e2m1_codes`);
5. the rope: ``cvt.rn.satfinite.e4m3`` of each value, no scale.

A stored value is ``e2m1 * sf``: at most 2 x 4 significant bits, exact in fp32 and in bfloat16,
which is how the kernels read it. Why each step is what it is: docs/kernels.md, section
``kernels/dsa/nvfp4.py``.
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.shared.formats import E2M1_VALUES, e2m1_codes, e4m3_satfinite

_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # the writer's fp32 constant 0x3E2AAAAB


def scale_byte(block: int, num_scales: int = layout.KV_LORA_RANK // layout.NVFP4_BLOCK) -> int:
    """Where block ``block``'s scale is stored among the row's scale bytes: ``8 * (s & 3) + (s >> 2)``
    for 32 scales (a 4 x 8 transpose, so one FlashMLA thread's 8 scales are contiguous)."""
    rows = layout.NVFP4_SCALE_PERMUTE_ROWS
    return (num_scales // rows) * (block % rows) + block // rows


def _scale_positions(num_scales: int, device) -> torch.Tensor:
    """[num_scales] int64: the stored byte of each block's scale (:func:`scale_byte`)."""
    return torch.tensor([scale_byte(s, num_scales) for s in range(num_scales)], dtype=torch.int64, device=device)


def block_scales(latent: torch.Tensor) -> torch.Tensor:
    """The writer's e4m3 scale of each 16-value block.

    latent: [N, 512], float32
    returns: [N, 32], float8_e4m3fn
    """
    n, width = latent.shape
    amax = latent.reshape(n, width // layout.NVFP4_BLOCK, layout.NVFP4_BLOCK).abs().amax(dim=-1)  # [N, 32]
    ratio = torch.clamp(amax * _ONE_SIXTH.to(latent.device), min=layout.NVFP4_SCALE_FLOOR)
    return e4m3_satfinite(ratio)


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
        packed[:, lay.rope_offset : lay.rope_offset + lay.rope] = e4m3_satfinite(x[:, lay.latent :]).view(torch.uint8)
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
