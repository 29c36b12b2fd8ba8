"""Triton parts both kernel families use: the launch record and the ``@triton.jit`` numerics helpers.

Under ``TRITON_INTERPRET=1`` kernels run on numpy. Loads, stores and casts of bfloat16 work there,
but a ``tl.dot`` on bfloat16 operands multiplies raw bits, and the fp32 -> bfloat16 cast truncates
where a GPU rounds to nearest even. :func:`dot` and :func:`store_rounded` take care of both, so the
CPU tests run the numerics a GPU has: a kernel passes ``DOT_BF16=False`` to :func:`dot` when it is
interpreted. See docs/kernels.md, section ``kernels/shared/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from mla_sm120_plugin.kernels.shared.host import LOG2E

LOG2E_K: tl.constexpr = tl.constexpr(LOG2E)  # log2(e), visible inside kernels


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: what a kernel's entry runs and what the compile gate compiles.

    kernel: the ``@triton.jit`` function
    grid: programs along each grid axis
    args: the positional (runtime) arguments
    constexprs: the constexpr keyword arguments
    num_warps: warps a program runs
    num_stages: software-pipelining depth
    describe: the variant as the compile report names it (dtypes and constexpr values)
    maxnreg: register cap for ptxas, or None
    """

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    describe: dict
    maxnreg: int | None = None

    def run(self) -> None:
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages, **extra)


@triton.jit
def round_bf16(x):
    """``x`` (fp32) rounded to the nearest bfloat16, ties to even, as fp32 (finite inputs; an
    overflow rounds to inf as a cast would). A GPU's fp32 -> bf16 cast rounds so, the interpreter's
    truncates (up to one bf16 ulp, ~0.2 % of the output's RMS): rounding here first makes the cast
    exact on both."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, DOT_BF16: tl.constexpr):
    """fp32-accumulated a @ b with bf16 operands: with ``DOT_BF16`` (a GPU) the operands are cast
    (round to nearest even) and multiplied by the tensor cores; without (the interpreter, whose bf16
    dot multiplies raw bits) they are rounded the same way (:func:`round_bf16`; a bf16 operand is
    already) and multiplied in fp32, which is the same result (bf16 x bf16 products are exact in
    fp32)."""
    if DOT_BF16:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        else:
            a = round_bf16(a.to(tl.float32))
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
        else:
            b = round_bf16(b.to(tl.float32))
        c = tl.dot(a, b, out_dtype=tl.float32)
    return c


@triton.jit
def dot_f16(a, b, DOT_BF16: tl.constexpr):
    """fp32-accumulated a @ b with f16 operands (for values exact in f16: every product is then
    exact in fp32): on a GPU (``DOT_BF16``) the tensor cores' f16 MMA, at the bf16 rate; under the
    interpreter the operands rounded to f16 and multiplied in fp32."""
    if DOT_BF16:
        c = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        c = tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), out_dtype=tl.float32)
    return c


@triton.jit
def store_rounded(ptrs, x, mask):
    """Store fp32 ``x`` in the pointer's dtype, a bfloat16 destination rounded to nearest even."""
    out_ty = ptrs.dtype.element_ty
    if out_ty == tl.bfloat16:
        x = round_bf16(x)
    tl.store(ptrs, x.to(out_ty), mask=mask)


@triton.jit
def e2m1(code):
    """e2m1 codes (int32 0..15) as fp32, by their bit fields: sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent e > 0 is ``2**(e - 1) * (1 + m / 2)``, e = 0 is ``m / 2`` (``m * (126 << 23)``
    is 0.5's bits). Exact, no table."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(code):
    """``2 ** (code - 127)`` as fp32 for an integer biased exponent (a UE8M0 / e8m0 byte, or an int32
    ``1 <= code <= 254``), built from the bits: exact. Code 0 reads 0 (no writer stores it)."""
    return (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)
