"""An independent reader of the cache bytes, and attention in float64: the tests' ground truth.

Written from FACTS.md §3 and §4 alone, with Python's ``struct`` and integer arithmetic: no torch fp8
dtype, no ``view(torch.float32)``, nothing of ``mla_sm120_plugin.kernels.pack`` or ``reference``.
A kernel, the packer or the torch reference that reads a byte wrong disagrees with it.

fp8_ds_mla, 656 bytes a token: [0, 512) the latent as float8 e4m3fn in four 128-wide tiles;
[512, 528) four little-endian float32 scales, value = fp8 * scale of its tile; [528, 656) the
64-wide rope as little-endian bfloat16. bf16: 576 bfloat16 values.
"""

from __future__ import annotations

import math
import struct

import torch

LATENT, ROPE, TILE = 512, 64, 128
ROW_BYTES = 656
SCALES_AT, ROPE_AT = 512, 528


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


def decode_row(row: bytes, layout: str) -> list[float]:
    """One cached token as its 576 values."""
    if layout == "fp8_ds_mla":
        assert len(row) == ROW_BYTES
        scales = struct.unpack("<4f", row[SCALES_AT:ROPE_AT])
        latent = [E4M3FN[row[i]] * scales[i // TILE] for i in range(LATENT)]
        rope = [bf16(b) for b in struct.unpack(f"<{ROPE}H", row[ROPE_AT:ROW_BYTES])]
        return latent + rope
    assert len(row) == 2 * (LATENT + ROPE)
    return [bf16(b) for b in struct.unpack(f"<{LATENT + ROPE}H", row)]


def decode_cache(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """Every slot of a paged (any page stride) or flat cache, decoded: [num_slots, 576] float64."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1]).cpu()  # a copy for page-strided views
    raw = rows.contiguous().view(torch.uint8).numpy().tobytes()
    width = ROW_BYTES if layout == "fp8_ds_mla" else 2 * (LATENT + ROPE)
    values = [decode_row(raw[i * width:(i + 1) * width], layout) for i in range(rows.shape[0])]
    return torch.tensor(values, dtype=torch.float64)


def attention(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, sm_scale: float,
              topk_length: torch.Tensor | None = None, sink: torch.Tensor | None = None):
    """FACTS §4 in float64, token by token and head by head over each token's valid candidates.

    keys: [num_slots, 576] float64 (:func:`decode_cache`). Returns out [T, H, 512] and the natural-log
    lse [T, H] (-inf and out 0 for a token with no valid candidate); duplicates count twice; a sink
    scales out by 1 / (1 + exp(sink - lse)) and leaves lse alone.
    """
    num_slots = keys.shape[0]
    tokens, heads = q.shape[:2]
    out = torch.zeros(tokens, heads, LATENT, dtype=torch.float64)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64)
    for t in range(tokens):
        limit = indices.shape[1] if topk_length is None else min(int(topk_length[t]), indices.shape[1])
        ids = [int(i) for i in indices[t, :limit] if 0 <= int(i) < num_slots]
        if not ids:
            continue
        k = keys[ids]  # [n, 576]
        s = sm_scale * (q[t].double() @ k.T)  # [H, n]
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ k[:, :LATENT]
        if sink is not None:
            out[t] /= (1 + torch.exp(sink.double() - lse[t]))[:, None]
    return out, lse
