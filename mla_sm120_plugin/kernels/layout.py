"""KV-cache layouts, described to the byte once; everything else refers here.

A layout is data (:class:`CacheLayout`): its widths, its bytes, and which engine writes it. The
kernels, the packer, the reference and the engine adapters read widths and offsets from it, never
from a constant that assumes a rope part.

``fp8_ds_mla`` (656 bytes a token; vLLM's name, SGLang's ``fp8_e4m3`` for DSA models)::

    [  0, 512)  latent ("nope") as float8_e4m3fn, four 128-wide tiles
    [512, 528)  four float32 scales, one per tile: value = fp8 * scale
    [528, 656)  RoPE part, 64 x bfloat16, not quantized

``fp8_ds_mla_nope`` (656 bytes; vLLM's fp8_ds_mla row for a rope-less model, GLM-5.3-Flash)::

    [  0, 512)  latent as float8_e4m3fn, four 128-wide tiles
    [512, 528)  four float32 scales
    [528, 656)  reserved: written as zeros, never read

``fp8_nope`` (528 bytes; SGLang's packed fp8 row for a rope-less model): the first 528 bytes of
``fp8_ds_mla_nope``, rows back to back.

``bf16`` (1152 bytes: the 576-wide latent + rope as bfloat16) and ``bf16_nope`` (1024 bytes: the
512-wide latent).

Pages hold :data:`PAGE_SIZE` tokens. This module is pure Python so that the selection and the CLI
can use it without importing torch; the torch code that packs and unpacks these bytes is in
:mod:`mla_sm120_plugin.kernels.pack`.
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
class CacheLayout:
    """One KV-cache row format.

    :param name: the kernels' name for it (``kv_layout=``).
    :param latent: latent width (values), also the output (V) width.
    :param rope: rope width (values); 0 for rope-less (NoPE) models.
    :param fp8: the latent is float8_e4m3fn in 128-wide tiles with one fp32 scale each, the scales
        right after the latent; else every value is bfloat16.
    :param row: elements of the cache's dtype one token occupies (bytes for fp8 rows).
    :param written_by: which engine and writer fills it.
    """

    name: str
    latent: int
    rope: int
    fp8: bool
    row: int
    written_by: str

    @property
    def head_dim(self) -> int:
        """q and key width: latent plus rope."""
        return self.latent + self.rope

    @property
    def element(self) -> str:
        """The cache tensor's dtype: ``"uint8"`` (fp8 rows as bytes) or ``"bfloat16"``."""
        return UINT8 if self.fp8 else BFLOAT16

    @property
    def token_bytes(self) -> int:
        return self.row if self.fp8 else 2 * self.row

    @property
    def scale_offset(self) -> int:
        """Byte offset of the four fp32 tile scales (fp8 rows)."""
        return self.latent

    @property
    def rope_offset(self) -> int:
        """Where the rope starts: a byte offset in fp8 rows (bf16 values), an element offset in bf16 rows."""
        return self.latent + 4 * (self.latent // FP8_TILE) if self.fp8 else self.latent

    @property
    def used(self) -> int:
        """Elements of a row that carry data (the rest, if any, is reserved and never read)."""
        return self.rope_offset + (2 * self.rope if self.fp8 else self.rope)

    def __post_init__(self) -> None:
        if self.latent % FP8_TILE or self.rope < 0 or self.row < self.used:
            raise ValueError(f"CacheLayout {self.name!r}: latent {self.latent}, rope {self.rope}, row {self.row} "
                             f"do not fit ({self.used} elements used)")


DSA = CacheLayout("fp8_ds_mla", KV_LORA_RANK, ROPE_DIM, True, FP8_DS_MLA_TOKEN_BYTES,
                  "vLLM's DSA writer and SGLang's quantize_k_cache (fp8_e4m3)")
DSA_NOPE = CacheLayout("fp8_ds_mla_nope", KV_LORA_RANK, 0, True, FP8_DS_MLA_TOKEN_BYTES,
                       "vLLM's concat_and_cache_mla for a rope-less model (fp8_ds_mla); bytes 528-656 reserved")
FP8_PACKED_NOPE = CacheLayout("fp8_nope", KV_LORA_RANK, 0, True, FP8_ROPE_OFFSET,
                              "SGLang's packed fp8 row for a rope-less model (fp8_e4m3)")
BF16_DSA = CacheLayout("bf16", KV_LORA_RANK, ROPE_DIM, False, HEAD_DIM, "the engines' bf16 cache")
BF16_NOPE_LAYOUT = CacheLayout("bf16_nope", KV_LORA_RANK, 0, False, KV_LORA_RANK,
                               "the engines' bf16 cache for a rope-less model")

LAYOUTS: dict[str, CacheLayout] = {lay.name: lay for lay in (DSA, DSA_NOPE, FP8_PACKED_NOPE, BF16_DSA, BF16_NOPE_LAYOUT)}

FP8_DS_MLA = DSA.name
FP8_DS_MLA_NOPE = DSA_NOPE.name
FP8_NOPE = FP8_PACKED_NOPE.name
BF16 = BF16_DSA.name
BF16_NOPE = BF16_NOPE_LAYOUT.name
KV_LAYOUTS = tuple(LAYOUTS)
FP8_LAYOUTS = tuple(name for name, lay in LAYOUTS.items() if lay.fp8)
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
