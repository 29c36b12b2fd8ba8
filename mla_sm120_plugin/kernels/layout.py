"""KV-cache layouts, described to the byte once; everything else refers here.

``fp8_ds_mla`` (656 bytes a token)::

    [  0, 512)  latent ("nope") as float8_e4m3fn, four 128-wide tiles
    [512, 528)  four float32 scales, one per tile: value = fp8 * scale
    [528, 656)  RoPE part, 64 x bfloat16, not quantized

``bf16`` (1152 bytes a token): the 576-wide latent+rope as bfloat16.

Pages hold :data:`PAGE_SIZE` tokens. This module is pure Python so that the
selection and the CLI can use it without importing torch; the torch code that
packs and unpacks these bytes is in :mod:`mla_sm120_plugin.kernels.pack`.
"""

from __future__ import annotations

KV_LORA_RANK = 512  # latent width, also the output (V) width
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM  # 576: q/k head width

FP8_TILE = 128
FP8_NUM_TILES = KV_LORA_RANK // FP8_TILE  # 4
FP8_E4M3_MAX = 448.0
POW2_SCALE_FLOOR = 1e-4  # pow2 scales: 2 ** ceil(log2(max(amax / 448, floor)))

FP8_NOPE_OFFSET = 0
FP8_SCALE_OFFSET = KV_LORA_RANK  # 512
FP8_SCALE_BYTES = 4 * FP8_NUM_TILES  # 16
FP8_ROPE_OFFSET = FP8_SCALE_OFFSET + FP8_SCALE_BYTES  # 528
FP8_ROPE_BYTES = 2 * ROPE_DIM  # 128
FP8_DS_MLA_TOKEN_BYTES = FP8_ROPE_OFFSET + FP8_ROPE_BYTES  # 656

BF16_TOKEN_ELEMS = HEAD_DIM  # 576
BF16_TOKEN_BYTES = 2 * HEAD_DIM  # 1152

PAGE_SIZE = 64  # tokens a page; FlashInfer's SM120 kernels read only this

FP8_DS_MLA = "fp8_ds_mla"
BF16 = "bf16"
KV_LAYOUTS = (FP8_DS_MLA, BF16)
TOKEN_BYTES = {FP8_DS_MLA: FP8_DS_MLA_TOKEN_BYTES, BF16: BF16_TOKEN_BYTES}

SCALE_POW2 = "pow2"
SCALE_ARBITRARY = "arbitrary"
SCALE_FORMATS = (SCALE_POW2, SCALE_ARBITRARY)
