"""KV-cache layouts, described to the byte once; everything else refers here.

A layout is data (:class:`CacheLayout`): its widths, its bytes, and which engine writes it. The
kernels, the packer, the reference and the engine adapters read widths and offsets from it, never
from a constant that assumes a rope part. The layouts (each one's bytes are stated beside its
definition below):

- ``fp8_ds_mla`` (656 bytes: fp8 latent, four fp32 scales, bf16 rope);
- ``fp8_ds_mla_nope`` (656 bytes, rope-less: the last 128 reserved) and ``fp8_nope`` (528 bytes);
- ``nvfp4_ds_mla`` (352 bytes: e2m1 latent, e4m3 rope, e4m3 block scales);
- ``bf16`` (576 bfloat16 values) and ``bf16_nope`` (512).

Pages hold :data:`PAGE_SIZE` tokens. Pure Python, so that the selection and the CLI can use it
without importing torch; the torch code that packs and unpacks these bytes is
:mod:`mla_sm120_plugin.kernels.dsa.pack`. Where the numbers come from: docs/facts.md, section
"DSA cache layouts".
"""

from __future__ import annotations

from dataclasses import dataclass

KV_LORA_RANK = 512  # latent width, also the output (V) width
ROPE_DIM = 64  # the DSA models' rope width (GLM-5, DeepSeek-V3.2); rope-less layouts have 0
HEAD_DIM = KV_LORA_RANK + ROPE_DIM  # 576: q/k head width of the DSA layouts

FP8_TILE = 128
FP8_NUM_TILES = KV_LORA_RANK // FP8_TILE  # 4
FP8_E4M3_MAX = 448.0
POW2_SCALE_FLOOR = 1e-4  # pow2 scales: 2 ** ceil(log2(max(amax / 448, floor)))

# nvfp4_ds_mla (vLLM's fused_norm_rope writer, MLA_CACHE_NVFP4): e2m1 latent in 16-value blocks,
# one e4m3 scale each, e4m3(max(amax * fp32(1/6), 2 ** -9)); scales stored in a 4 x 8 transpose.
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
NVFP4_SCALE_FLOOR = 2.0**-9
NVFP4_SCALE_PERMUTE_ROWS = 4  # scale s at 8 * (s % 4) + s // 4 (for 32 scales: 8 = 32 // 4)
NVFP4_DS_MLA_TOKEN_BYTES = KV_LORA_RANK // 2 + ROPE_DIM + KV_LORA_RANK // NVFP4_BLOCK  # 352

FP8_NOPE_OFFSET = 0
FP8_SCALE_OFFSET = KV_LORA_RANK  # 512
FP8_SCALE_BYTES = 4 * FP8_NUM_TILES  # 16
FP8_ROPE_OFFSET = FP8_SCALE_OFFSET + FP8_SCALE_BYTES  # 528
FP8_ROPE_BYTES = 2 * ROPE_DIM  # 128
FP8_DS_MLA_TOKEN_BYTES = FP8_ROPE_OFFSET + FP8_ROPE_BYTES  # 656

BF16_TOKEN_ELEMS = HEAD_DIM  # 576
BF16_TOKEN_BYTES = 2 * HEAD_DIM  # 1152

PAGE_SIZE = 64  # tokens a page; FlashInfer's SM120 kernels are built for 64-row pages

UINT8 = "uint8"
BFLOAT16 = "bfloat16"


@dataclass(frozen=True)
class LatentFormat:
    """How a layout stores its latent (and, with it, its scales and rope).

    :param name: ``"fp8"``, ``"e2m1"`` or ``"bf16"``.
    :param value_bits: bits one latent value takes.
    :param block: latent values sharing one scale (0: no scales).
    :param scale_bytes: bytes one scale takes (4: float32, 1: float8_e4m3fn).
    :param rope_bytes: bytes one rope value takes (2: bfloat16, 1: float8_e4m3fn, unscaled).
    :param scales_after_rope: the scales follow the rope (nvfp4) rather than the latent (fp8).
    """

    name: str
    value_bits: int
    block: int
    scale_bytes: int
    rope_bytes: int
    scales_after_rope: bool


FP8_LATENT = LatentFormat("fp8", 8, FP8_TILE, 4, 2, False)
E2M1_LATENT = LatentFormat("e2m1", 4, NVFP4_BLOCK, 1, 1, True)
BF16_LATENT = LatentFormat("bf16", 16, 0, 0, 2, False)
LATENT_FORMATS = {f.name: f for f in (FP8_LATENT, E2M1_LATENT, BF16_LATENT)}


@dataclass(frozen=True)
class CacheLayout:
    """One KV-cache row format.

    :param name: the kernels' name for it (``kv_layout=``).
    :param latent: latent width (values), also the output (V) width.
    :param rope: rope width (values); 0 for rope-less (NoPE) models.
    :param latent_format: :class:`LatentFormat`: ``fp8`` (float8_e4m3fn in 128-wide tiles, one fp32
        scale each right after the latent, bf16 rope), ``e2m1`` (fp4 two a byte, one e4m3 scale per
        16 values after an e4m3 rope) or ``bf16`` (every value bfloat16).
    :param row: elements of the cache's dtype one token occupies (bytes for uint8 rows).
    :param written_by: which engine and writer fills it.
    """

    name: str
    latent: int
    rope: int
    latent_format: LatentFormat
    row: int
    written_by: str

    @property
    def fp8(self) -> bool:
        """The latent is float8_e4m3fn with fp32 tile scales (``fp8_ds_mla``, its rope-less kin)."""
        return self.latent_format is FP8_LATENT

    @property
    def nvfp4(self) -> bool:
        """The latent is e2m1 with e4m3 block scales (``nvfp4_ds_mla``)."""
        return self.latent_format is E2M1_LATENT

    @property
    def quantized(self) -> bool:
        """Rows are bytes (a uint8 cache) holding a scaled latent: fp8 or e2m1."""
        return self.latent_format is not BF16_LATENT

    @property
    def num_scales(self) -> int:
        """Scales a row holds (0 for bf16 rows)."""
        return self.latent // self.latent_format.block if self.quantized else 0

    @property
    def latent_bytes(self) -> int:
        return self.latent * self.latent_format.value_bits // 8

    @property
    def head_dim(self) -> int:
        """q and key width: latent plus rope."""
        return self.latent + self.rope

    @property
    def element(self) -> str:
        """The cache tensor's dtype: ``"uint8"`` (quantized rows as bytes) or ``"bfloat16"``."""
        return UINT8 if self.quantized else BFLOAT16

    @property
    def token_bytes(self) -> int:
        return self.row if self.quantized else 2 * self.row

    @property
    def scale_bytes(self) -> int:
        """Bytes of a row's scales (16 for fp8 rows, 32 for nvfp4, 0 for bf16)."""
        return self.num_scales * self.latent_format.scale_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales: right after the latent (fp8 rows), after the rope (nvfp4)."""
        if self.latent_format.scales_after_rope:
            return self.latent_bytes + self.rope * self.latent_format.rope_bytes
        return self.latent

    @property
    def rope_offset(self) -> int:
        """Where the rope starts: a byte offset in uint8 rows, an element offset in bf16 rows."""
        if not self.quantized:
            return self.latent
        if self.latent_format.scales_after_rope:
            return self.latent_bytes
        return self.latent_bytes + self.scale_bytes

    @property
    def used(self) -> int:
        """Elements of a row that carry data (the rest, if any, is reserved and never read)."""
        if not self.quantized:
            return self.rope_offset + self.rope
        return max(self.rope_offset + self.rope * self.latent_format.rope_bytes, self.scale_offset + self.scale_bytes)

    def __post_init__(self) -> None:
        block = self.latent_format.block or FP8_TILE
        if self.latent % FP8_TILE or self.latent % block or self.rope < 0 or self.row < self.used:
            raise ValueError(f"CacheLayout {self.name!r}: latent {self.latent}, rope {self.rope}, row {self.row} "
                             f"do not fit ({self.used} elements used)")


# fp8_ds_mla, 656 bytes a token (vLLM's name; SGLang's fp8_e4m3 for DSA models):
#   [  0, 512)  latent ("nope") as float8_e4m3fn, four 128-wide tiles
#   [512, 528)  four float32 scales, one per tile: value = fp8 * scale
#   [528, 656)  RoPE part, 64 x bfloat16, not quantized
DSA = CacheLayout("fp8_ds_mla", KV_LORA_RANK, ROPE_DIM, FP8_LATENT, FP8_DS_MLA_TOKEN_BYTES,
                  "vLLM's DSA writer and SGLang's quantize_k_cache (fp8_e4m3)")
# fp8_ds_mla_nope, 656 bytes (vLLM's fp8_ds_mla row for a rope-less model, GLM-5.3-Flash):
#   [  0, 512)  latent as float8_e4m3fn, four 128-wide tiles
#   [512, 528)  four float32 scales
#   [528, 656)  reserved: written as zeros, never read
DSA_NOPE = CacheLayout("fp8_ds_mla_nope", KV_LORA_RANK, 0, FP8_LATENT, FP8_DS_MLA_TOKEN_BYTES,
                       "vLLM's concat_and_cache_mla for a rope-less model (fp8_ds_mla); bytes 528-656 reserved")
# fp8_nope, 528 bytes (SGLang's packed fp8 row for a rope-less model): the first 528 bytes of
# fp8_ds_mla_nope, rows back to back.
FP8_PACKED_NOPE = CacheLayout("fp8_nope", KV_LORA_RANK, 0, FP8_LATENT, FP8_ROPE_OFFSET,
                              "SGLang's packed fp8 row for a rope-less model (fp8_e4m3)")
# nvfp4_ds_mla, 352 bytes (vLLM's name; only vLLM's DSA writer fills it):
#   [  0, 256)  latent as 512 e2m1 (fp4) values, two a byte, the even element in the low nibble
#   [256, 320)  RoPE part, 64 x float8_e4m3fn, unscaled
#   [320, 352)  32 float8_e4m3fn block scales, one per 16 latent values (value = e2m1 * scale),
#               permuted: the scale of block s is byte 320 + 8 * (s & 3) + (s >> 2)
NVFP4_DSA = CacheLayout("nvfp4_ds_mla", KV_LORA_RANK, ROPE_DIM, E2M1_LATENT, NVFP4_DS_MLA_TOKEN_BYTES,
                        "vLLM's DSA writer (fused_norm_rope, MLA_CACHE_NVFP4); no SGLang writer")
# bf16: 1152 bytes, the 576-wide latent + rope as bfloat16; bf16_nope: 1024 bytes, the 512-wide latent.
BF16_DSA = CacheLayout("bf16", KV_LORA_RANK, ROPE_DIM, BF16_LATENT, HEAD_DIM, "the engines' bf16 cache")
BF16_NOPE_LAYOUT = CacheLayout("bf16_nope", KV_LORA_RANK, 0, BF16_LATENT, KV_LORA_RANK,
                               "the engines' bf16 cache for a rope-less model")

LAYOUTS: dict[str, CacheLayout] = {lay.name: lay for lay in (DSA, DSA_NOPE, FP8_PACKED_NOPE, NVFP4_DSA, BF16_DSA,
                                                                BF16_NOPE_LAYOUT)}

FP8_DS_MLA = DSA.name
FP8_DS_MLA_NOPE = DSA_NOPE.name
FP8_NOPE = FP8_PACKED_NOPE.name
NVFP4_DS_MLA = NVFP4_DSA.name
BF16 = BF16_DSA.name
BF16_NOPE = BF16_NOPE_LAYOUT.name
KV_LAYOUTS = tuple(LAYOUTS)
FP8_LAYOUTS = tuple(name for name, lay in LAYOUTS.items() if lay.fp8)  # fp8 latent (the fast kernel's)
NVFP4_LAYOUTS = tuple(name for name, lay in LAYOUTS.items() if lay.nvfp4)
TOKEN_BYTES = {name: lay.token_bytes for name, lay in LAYOUTS.items()}

SCALE_POW2 = "pow2"
SCALE_ARBITRARY = "arbitrary"
SCALE_FORMATS = (SCALE_POW2, SCALE_ARBITRARY)


def get(name: str) -> CacheLayout:
    """The layout called ``name``.

    :raises KeyError: naming the known layouts.
    """
    try:
        return LAYOUTS[name]
    except KeyError:
        raise KeyError(f"kv_layout {name!r}: known layouts are {list(LAYOUTS)}") from None
