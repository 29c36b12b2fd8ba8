"""The number formats both families' caches store, in torch: e2m1 (fp4) codes and values, e4m3 with saturation.

e2m1 is 4 bits: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; the eight
magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and code 8 is -0. e4m3 here is ``float8_e4m3fn`` (OCP):
largest finite value 448, no infinities. The PTX conversions the engines' writers use
(``cvt.rn.satfinite.e2m1x2.f32``, ``cvt.rn.satfinite.e4m3x2.f32``) round to nearest even and
saturate at the largest finite value; the functions below do the same on any device.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value

# e2m1 code -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Code boundaries of round-to-nearest-even over the magnitudes above: a magnitude past each one
# adds 1 to the code. At a tie the even code (mantissa bit 0) wins, so a tie stays below the
# boundary when the lower code is even (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4) and goes up when
# the upper is (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4): strict ">" for the first kind, ">=" for the other.
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e2m1 codes like ``cvt.rn.satfinite.e2m1x2.f32``: nearest, ties to even,
    saturating at +-6, sign kept (a negative value that rounds to 0 is -0, code 8). NaN is not
    handled (the writers are never given one).

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


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn like ``cvt.rn.satfinite.e4m3x2.f32``: nearest even, +-448 past the range
    (torch's own cast gives NaN there)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
