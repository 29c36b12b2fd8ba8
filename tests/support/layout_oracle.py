"""An independent reader of the cache bytes: the tests' ground truth for what a cached row holds.

Float64 attention over the rows it reads is :mod:`support.oracle` (one function for every test).

Written from docs/facts.md (DSA cache layouts, sparse-MLA semantics, rope-less layouts) alone, with Python's ``struct`` and integer arithmetic: no torch
fp8 dtype, no ``view(torch.float32)``, nothing of ``mla_sm120_plugin.kernels`` (not even
``layout``'s numbers). A kernel, the packer or the torch reference that reads a byte wrong
disagrees with it.

fp8_ds_mla, 656 bytes a token: [0, 512) the latent as float8 e4m3fn in four 128-wide tiles;
[512, 528) four little-endian float32 scales, value = fp8 * scale of its tile; [528, 656) the
64-wide rope as little-endian bfloat16. bf16: 576 bfloat16 values.

The rope-less rows of GLM-5.3-Flash (qk_rope_head_dim 0; a token is its 512 latent values):
fp8_ds_mla_nope, 656 bytes (vLLM): [0, 512) fp8 latent, [512, 528) four float32 scales, [528, 656)
reserved, written as zeros and never a value; fp8_nope, 528 bytes (SGLang): the same first 528
bytes, rows back to back; bf16_nope: 512 bfloat16 values.

nvfp4_ds_mla, 352 bytes (vLLM 0.33's flashmla_sparse.py docstring and its DSA writer,
models/deepseek_v32/common/kernels.py, MLA_CACHE_NVFP4): [0, 256) 512 e2m1 values two a byte, the
even element in the low nibble; [256, 320) 64 e4m3fn rope values, unscaled; [320, 352) 32 e4m3fn
scales, one per 16 latent values, the scale of block s at byte 320 + 8 * (s & 3) + (s >> 2).
:func:`encode_nvfp4_row` is that writer's formula, value by value in Python floats: the writer
itself (a Triton kernel with PTX ``cvt.rn.satfinite.e2m1x2.f32``) needs an sm_100a/sm_120a GPU.
"""

from __future__ import annotations

import math
import struct

import torch

LATENT, ROPE, TILE = 512, 64, 128
ROW_BYTES = 656
SCALES_AT, ROPE_AT = 512, 528
RESERVED_AT = 528  # fp8_ds_mla_nope: [528, 656) reserved

# name: (bytes a row, rope width, fp8 latent)
ROWS = {
    "fp8_ds_mla": (656, ROPE, True),
    "fp8_ds_mla_nope": (656, 0, True),
    "fp8_nope": (528, 0, True),
    "nvfp4_ds_mla": (352, ROPE, False),
    "bf16": (2 * (LATENT + ROPE), ROPE, False),
    "bf16_nope": (2 * LATENT, 0, False),
}


def e4m3fn(byte: int) -> float:
    """The value of one float8 e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
    infinities, exponent 15 with mantissa 7 is NaN, exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3FN = [e4m3fn(b) for b in range(256)]
_FINITE = [(value, byte) for byte, value in enumerate(E4M3FN) if not math.isnan(value)]


def bf16(bits: int) -> float:
    """A bfloat16's value: the top half of a float32."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def nearest_e4m3(x: float) -> float:
    """Round-to-nearest-even onto e4m3fn, saturating at +-448 (what a correct quantizer stores)."""
    x = max(-448.0, min(448.0, x))
    return min(_FINITE, key=lambda vb: (abs(vb[0] - x), vb[1] & 1))[0]  # a tie goes to the even mantissa


NVFP4 = "nvfp4_ds_mla"
FP4_ROPE_AT, FP4_SCALES_AT, FP4_BLOCK = 256, 320, 16


def e2m1(code: int) -> float:
    """The value of one e2m1 nibble: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


E2M1 = [e2m1(c) for c in range(16)]


def f32(x: float) -> float:
    """``x`` rounded to float32 (nearest even), as the GPU's fp32 arithmetic stores a result."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_byte(x: float) -> int:
    """``cvt.rn.satfinite.e4m3``: the byte of the nearest e4m3fn value (ties to the even mantissa),
    +-448 past the range."""
    x = max(-448.0, min(448.0, x))
    return min(_FINITE, key=lambda vb: (abs(vb[0] - x), vb[1] & 1, vb[1] >> 7 != (math.copysign(1.0, x) < 0)))[1]


def e2m1_code(x: float) -> int:
    """``cvt.rn.satfinite.e2m1``: the nibble of the nearest e2m1 magnitude (ties to the even
    mantissa), 6 past the range, and x's sign bit (so -0.0 and small negatives give -0, code 8)."""
    mag = min(abs(x), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c & 1))
    return code | (8 if math.copysign(1.0, x) < 0 else 0)


def scale_at(block: int) -> int:
    """The byte of block ``block``'s scale in an nvfp4_ds_mla row."""
    return FP4_SCALES_AT + 8 * (block & 3) + (block >> 2)


def encode_nvfp4_row(values: list[float]) -> bytes:
    """vLLM's writer for one token (576 float32-representable values: 512 latent, 64 rope), from its
    formula: per 16 values ``sf = e4m3(max(f32(amax * f32(1/6)), 2**-9))``, ``q = f32(x * f32(1/sf))``,
    nibble = e2m1(q); rope = e4m3(x)."""
    assert len(values) == LATENT + ROPE
    row = bytearray(352)
    one_sixth = f32(1.0 / 6.0)
    for block in range(LATENT // FP4_BLOCK):
        chunk = values[block * FP4_BLOCK:(block + 1) * FP4_BLOCK]
        amax = max(abs(v) for v in chunk)
        scale_byte = e4m3_byte(max(f32(amax * one_sixth), 2.0**-9))
        row[scale_at(block)] = scale_byte
        recip = f32(1.0 / E4M3FN[scale_byte])
        for i, v in enumerate(chunk):
            element = block * FP4_BLOCK + i
            row[element // 2] |= e2m1_code(f32(v * recip)) << (4 * (element % 2))
    for i, v in enumerate(values[LATENT:]):
        row[FP4_ROPE_AT + i] = e4m3_byte(v)
    return bytes(row)


def decode_row(row: bytes, layout: str) -> list[float]:
    """One cached token as its values: 512 latent, then the rope where the layout has one (576)."""
    width, rope, fp8 = ROWS[layout]
    assert len(row) == width, (layout, len(row))
    if layout == NVFP4:
        latent = [E2M1[(row[i // 2] >> (4 * (i % 2))) & 0xF] * E4M3FN[row[scale_at(i // FP4_BLOCK)]]
                  for i in range(LATENT)]
        return latent + [E4M3FN[b] for b in row[FP4_ROPE_AT:FP4_ROPE_AT + rope]]
    if fp8:
        scales = struct.unpack("<4f", row[SCALES_AT:SCALES_AT + 16])
        latent = [E4M3FN[row[i]] * scales[i // TILE] for i in range(LATENT)]
        rope_at = SCALES_AT + 16
        return latent + [bf16(b) for b in struct.unpack(f"<{rope}H", row[rope_at:rope_at + 2 * rope])]
    return [bf16(b) for b in struct.unpack(f"<{LATENT + rope}H", row)]


def raw_rows(kv_cache: torch.Tensor) -> list[bytes]:
    """Every slot's row of a paged (any page stride) or flat cache, as its bytes."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1]).cpu()  # a copy for page-strided views
    raw = rows.contiguous().view(torch.uint8).numpy().tobytes()
    width = len(raw) // max(rows.shape[0], 1)
    return [raw[i * width:(i + 1) * width] for i in range(rows.shape[0])]


def reserved_bytes(row: bytes, layout: str) -> bytes:
    """The bytes of a row that carry no value (fp8_ds_mla_nope's [528, 656); empty otherwise)."""
    return row[RESERVED_AT:] if layout == "fp8_ds_mla_nope" else b""


def decode_cache(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """Every slot of a paged (any page stride) or flat cache, decoded: [num_slots, 576] float64
    (512 for a rope-less layout)."""
    return torch.tensor([decode_row(row, layout) for row in raw_rows(kv_cache)], dtype=torch.float64)


# DeepSeek-V4's 584-byte page-major record (docs/facts.md#deepseek-v4): data rows [P x 576], then scale rows [P x 8].
_DSV4_DATA, _DSV4_SCALES, _DSV4_NOPE = 576, 8, 448


# The NVFP4 record (FlashInfer's kv_cache_format="nvfp4"): data rows [P x 352] = 224 bytes of e2m1
# pairs (even index in the low nibble) + 64 bf16; scale rows [P x 32] = 28 e4m3 scales + 4 zero bytes.
_NVFP4_DATA, _NVFP4_SCALES, _NVFP4_NOPE_BYTES, _NVFP4_GROUP = 352, 32, 224, 16


def dsv4_oracle_row(cache: torch.Tensor, slot: int, page_size: int, record: str = "fp8") -> list[float]:
    """Slot ``slot``'s 512 values, read from the bytes (``record``: "fp8", the 584-byte record, or
    "nvfp4", the 384-byte one)."""
    return _dsv4_row(cache.reshape(-1).tolist(), cache.shape[1], slot, page_size, record)


def dsv4_oracle_rows(cache: torch.Tensor, slots, page_size: int, record: str = "fp8") -> torch.Tensor:
    """The slots ``slots``' values, read from the bytes as :func:`dsv4_oracle_row` reads one (the
    cache's bytes listed once): [len(slots), 512] float64."""
    raw, stride = cache.reshape(-1).tolist(), cache.shape[1]
    return torch.tensor([_dsv4_row(raw, stride, int(s), page_size, record) for s in slots],
                        dtype=torch.float64).reshape(-1, _DSV4_NOPE + 64)


def _dsv4_row(raw: list[int], stride: int, slot: int, page_size: int, record: str) -> list[float]:
    page, row = divmod(slot, page_size)
    if record == "nvfp4":
        data_at = page * stride + row * _NVFP4_DATA
        scale_at = page * stride + page_size * _NVFP4_DATA + row * _NVFP4_SCALES
        nope = [e2m1((raw[data_at + i // 2] >> (4 * (i % 2))) & 0xF) * E4M3FN[raw[scale_at + i // _NVFP4_GROUP]]
                for i in range(_DSV4_NOPE)]
        rope_at = data_at + _NVFP4_NOPE_BYTES
    else:
        data_at = page * stride + row * _DSV4_DATA
        scale_at = page * stride + page_size * _DSV4_DATA + row * _DSV4_SCALES
        nope = [e4m3fn(raw[data_at + i]) * 2.0 ** (raw[scale_at + i // 64] - 127) for i in range(_DSV4_NOPE)]
        rope_at = data_at + _DSV4_NOPE
    rope = [bf16(struct.unpack_from("<H", bytes(raw[rope_at + 2 * i: rope_at + 2 * i + 2]))[0]) for i in range(64)]
    return nope + rope


def encode_dsv4_nvfp4_row(values: list[float]) -> tuple[bytes, bytes]:
    """FlashInfer's documented NVFP4 writer for one 512-value row (float32-representable values), in
    Python floats: per 16 NoPE values ``sf = e4m3(f32(amax * f32(1/6)))`` (saturating, no floor),
    ``q = f32(x * f32(1/sf))`` (0 when sf is 0), nibble = e2m1(q), even index low; the rope as bf16
    bits (the values are bf16 already); 4 zero bytes after the 28 scales. Returns (data, scales)."""
    assert len(values) == 512
    data, scales = bytearray(_NVFP4_DATA), bytearray(_NVFP4_SCALES)
    one_sixth = f32(1.0 / 6.0)
    for group in range(_DSV4_NOPE // _NVFP4_GROUP):
        chunk = values[group * _NVFP4_GROUP:(group + 1) * _NVFP4_GROUP]
        byte = e4m3_byte(f32(max(abs(v) for v in chunk) * one_sixth))
        scales[group] = byte
        recip = 0.0 if E4M3FN[byte] == 0 else f32(1.0 / E4M3FN[byte])
        for i, v in enumerate(chunk):
            element = group * _NVFP4_GROUP + i
            data[element // 2] |= e2m1_code(f32(v * recip)) << (4 * (element % 2))
    for i, v in enumerate(values[_DSV4_NOPE:]):
        bits = struct.unpack("<I", struct.pack("<f", v))[0] >> 16
        data[_NVFP4_NOPE_BYTES + 2 * i: _NVFP4_NOPE_BYTES + 2 * i + 2] = struct.pack("<H", bits)
    return bytes(data), bytes(scales)


def dsv4_roped_bf16(row: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's KV rope (docs/facts.md#deepseek-v4: GPT-J pairs over the last 64 values, in fp32), then bf16:
    ``row`` [512] fp32, ``cos`` / ``sin`` [32] -> [512] bfloat16 (the NoPE values only rounded)."""
    out = row.float().clone()
    even, odd = row[448::2].float(), row[449::2].float()
    cos, sin = cos.float(), sin.float()
    out[448::2] = even * cos - odd * sin
    out[449::2] = odd * cos + even * sin
    return out.to(torch.bfloat16)


def dsv4_compressed_row(kv: list[torch.Tensor | None], score: list[torch.Tensor | None], weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """One compressed entry in float64: the states' per-value softmax over ``score`` weighting ``kv``
    (None: a state before position 0, left out), summed, then RMS-normed with ``weight``: [512] fp32."""
    kept = [i for i, k in enumerate(kv) if k is not None]
    k = torch.stack([kv[i].double() for i in kept])
    s = torch.stack([score[i].double() for i in kept])
    c = (k * torch.softmax(s, dim=0)).sum(0)
    return (c * torch.rsqrt(c.square().mean() + eps) * weight.double()).float()


def dsv4_nvfp4_entry(cache: torch.Tensor, slot: int, page_size: int) -> tuple[bytes, bytes]:
    """(data, scale) bytes of ``slot`` in a [pages, page_stride] (or any page-major view) 384-byte cache."""
    flat = cache.reshape(cache.shape[0], -1)
    page, row = divmod(slot, page_size)
    data = flat[page, row * _NVFP4_DATA:(row + 1) * _NVFP4_DATA]
    at = page_size * _NVFP4_DATA + row * _NVFP4_SCALES
    return bytes(data.tolist()), bytes(flat[page, at:at + _NVFP4_SCALES].tolist())
