"""Host-side helpers every kernel module uses; pure Python (no torch, no triton), so importing it is free."""

from __future__ import annotations

import math
import os

LOG2E = math.log2(math.e)  # the kernels keep scores in base 2 (exp2): s * LOG2E
LN2 = math.log(2.0)  # a base-2 LSE times LN2 is the natural-log one

# What a kernel's final store writes as the LSE (its ``write_lse`` argument, a runtime int): nothing,
# the sink-free ``logsumexp(s)``, or the same with the sink counted as one more term of the softmax
# denominator, ``log(exp(lse) + exp(sink))`` (a head with nothing valid: the sink itself).
LSE_NONE, LSE_PLAIN, LSE_WITH_SINK = 0, 1, 2


def lse_mode(wanted: bool, with_sink: bool) -> int:
    """The ``write_lse`` value of a call: :data:`LSE_NONE` unless the LSE is ``wanted``, then
    :data:`LSE_WITH_SINK` or :data:`LSE_PLAIN`."""
    return LSE_NONE if not wanted else LSE_WITH_SINK if with_sink else LSE_PLAIN


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. (``triton.cdiv`` is a jit-callable: ~5 us a call on the host, in a
    path that runs every forward.)"""
    return -(-a // b)


def page_divisor(page_size: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``slot * magic >> shift == slot // page_size`` for every slot in
    ``[0, 2**31)``: ``shift = 31 + ceil(log2 page_size)``, ``magic = ceil(2**shift / page_size)``
    (every kernel finds a slot's page by this multiply-shift, where a runtime integer division costs
    registers).

    Exact: with ``magic * page_size = 2**shift + e``, ``0 <= e < page_size <= 2**(shift - 31)``,
    the product overshoots ``slot / page_size`` by ``slot * e / (page_size * 2**shift) < 1 /
    page_size``, less than the distance to the next integer; and ``slot * magic < 2**63``.
    """
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
