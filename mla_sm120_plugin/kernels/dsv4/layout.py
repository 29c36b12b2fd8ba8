"""DeepSeek-V4's KV records on SM12x, described to the byte once: the 584-byte fp8 one and the 384-byte NVFP4 one.

Every DeepSeek-V4 attention layer (V4-Flash, V4-Pro, V4.1-Flash and their drafts) caches one
512-wide row a token (or a compressed entry): 448 NoPE values and 64 RoPE values, and q, K and V
are that whole row. A record (:class:`Dsv4Record`) is stored **page-major**: a page of ``P``
entries holds ``P`` data rows, then ``P`` scale rows, then padding up to the page stride, so slot
``s`` (``page * P + row``, the ids the engines hand the kernels) has its data at
``page * page_stride + row * data_bytes`` and its scales at
``page * page_stride + P * data_bytes + row * scale_bytes``. The page stride is the cache tensor's
(an engine may place pages further apart than :meth:`Dsv4Record.page_bytes`). Each record's bytes
are stated beside its definition below.

Pure Python: the selection and the CLI read these numbers without torch. The torch code that packs
and unpacks the bytes is :mod:`mla_sm120_plugin.kernels.dsv4.pack`. The engines' page sizes and
writers: docs/facts.md, section "DeepSeek-V4".
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_DIM = 512  # q, K and V width: the whole row
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
SCALE_GROUP = 64  # NoPE values one UE8M0 exponent covers
NUM_SCALES = NOPE_DIM // SCALE_GROUP  # 7
SCALE_ROW_BYTES = 8  # 7 exponents + 1 pad byte
DATA_ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
TOKEN_BYTES = DATA_ROW_BYTES + SCALE_ROW_BYTES  # 584
PAGE_ALIGN = 576  # a page's bytes are rounded up to a multiple of this
E4M3_MAX = 448.0
UE8M0_BIAS = 127
AMAX_FLOOR = 1e-4  # the writers' floor on a group's amax: an all-zero group stores exponent -22

FP8_DSV4 = "fp8_dsv4"
NVFP4_DSV4 = "nvfp4_dsv4"
NVFP4_GROUP = 16  # NoPE values one e4m3 scale covers in the NVFP4 record
NVFP4_MAX = 6.0  # the largest e2m1 magnitude


@dataclass(frozen=True)
class Dsv4Record:
    """One DeepSeek-V4 cache record format (page-major: data rows, then scale rows).

    :param name: the plugin's name for it.
    :param token_bytes: bytes an entry takes in a page, before the page's padding.
    :param data_bytes: bytes of an entry's data row (quantized NoPE then bf16 rope).
    :param scale_bytes: bytes of an entry's scale row.
    :param nope: NoPE values (quantized).
    :param rope: RoPE values (bf16, after the NoPE bytes).
    :param scale_group: NoPE values one scale covers.
    :param page_align: a page's bytes are a multiple of this.
    :param written_by: which engine and writer fills it.
    :param nope_bits: bits a NoPE value takes (8: e4m3; 4: e2m1, two a byte, even index low).
    """

    name: str
    token_bytes: int
    data_bytes: int
    scale_bytes: int
    nope: int
    rope: int
    scale_group: int
    page_align: int
    written_by: str
    nope_bits: int = 8

    @property
    def head_dim(self) -> int:
        """q, K and V width."""
        return self.nope + self.rope

    @property
    def num_scales(self) -> int:
        return self.nope // self.scale_group

    @property
    def nope_bytes(self) -> int:
        """Bytes the quantized NoPE values take at the start of a data row."""
        return self.nope * self.nope_bits // 8

    def tokens_per_gib(self, ratio: int = 1) -> int:
        """Context tokens one GiB of a layer's cache holds at one entry per ``ratio`` tokens."""
        return (1 << 30) * ratio // self.token_bytes

    def page_bytes(self, page_size: int) -> int:
        """The least page stride for ``page_size`` entries (the engines' padded page)."""
        raw = page_size * self.token_bytes
        return -(-raw // self.page_align) * self.page_align

    def data_offset(self, slot: int, page_size: int, page_stride: int) -> int:
        """Byte offset of slot ``slot``'s data row in a cache of ``page_size``-entry pages."""
        page, row = divmod(slot, page_size)
        return page * page_stride + row * self.data_bytes

    def scale_offset(self, slot: int, page_size: int, page_stride: int) -> int:
        """Byte offset of slot ``slot``'s scale row."""
        page, row = divmod(slot, page_size)
        return page * page_stride + page_size * self.data_bytes + row * self.scale_bytes

    def __post_init__(self) -> None:
        if (self.data_bytes != self.nope_bytes + 2 * self.rope or self.token_bytes != self.data_bytes + self.scale_bytes
                or self.nope % self.scale_group or self.scale_bytes < self.num_scales):
            raise ValueError(f"Dsv4Record {self.name!r}: data {self.data_bytes}, scales {self.scale_bytes}, token "
                             f"{self.token_bytes} bytes do not hold {self.nope} + {self.rope} values")


# The 584-byte fp8 record (vLLM calls the cache fp8_ds_mla, SGLang fp8_e4m3; the plugin FP8_DSV4):
#   data row, 576 bytes:  [  0, 448) 448 NoPE values as float8_e4m3fn (OCP)
#                         [448, 576) 64 RoPE values as bfloat16 (already rotated, unscaled)
#   scale row, 8 bytes:   [0, 7) 7 UE8M0 exponents, one per 64 NoPE values: value = fp8 * 2 ** (byte - 127)
#                         [7] pad, written 0, never read
#   a page is P * 584 bytes rounded up to a multiple of 576.
# The writers store e = ceil(log2(max(amax, 1e-4) / 448)) per 64-value group and fp8(clamp(x / 2**e,
# +-448)); an all-zero group stores byte 105 (-22 + 127).
FP8_RECORD = Dsv4Record(FP8_DSV4, TOKEN_BYTES, DATA_ROW_BYTES, SCALE_ROW_BYTES, NOPE_DIM, ROPE_DIM, SCALE_GROUP,
                        PAGE_ALIGN, "vLLM's fused qnorm/rope/quant insert and its compressor (fp8_ds_mla); "
                        "SGLang's DeepSeek-V4 pool (fp8_e4m3)")

# FlashInfer 0.7.2's SM120/SM121 NVFP4 DeepSeek-V4 record (kv_cache_format="nvfp4"): 224 bytes of
# e2m1 NoPE (even index in the low nibble), 64 bf16 rope; 28 e4m3 scales, one per 16 NoPE values
# (e4m3(amax / 6), no power-of-two rounding), then 4 zero bytes. Page strides: multiples of 16.
NVFP4_RECORD = Dsv4Record(NVFP4_DSV4, 384, 352, 32, NOPE_DIM, ROPE_DIM, NVFP4_GROUP, 16,
                          "FlashInfer's nvfp4_quantize_append_sparse_mla_cache and its fused SM120 writers; no "
                          "engine release writes it", nope_bits=4)

# What the plan serves: the fp8 record (both engines write it), and the NVFP4 record in vLLM, whose
# DeepSeek-V4 layers the plugin's layer class writes it for (kernels/dsv4/nvfp4_writer.py).
RECORDS: dict[str, Dsv4Record] = {r.name: r for r in (FP8_RECORD, NVFP4_RECORD)}
ALL_RECORDS = RECORDS
# FlashInfer's name for each record (trtllm_batch_decode_sparse_mla_dsv4's kv_cache_format).
FLASHINFER_FORMAT: dict[str, str] = {FP8_DSV4: "fp8", NVFP4_DSV4: "nvfp4"}
