"""Host-side helpers every kernel module uses; pure Python (no torch, no triton), so importing it is free."""

from __future__ import annotations

import math
import os

LOG2E = math.log2(math.e)  # the kernels keep scores in base 2 (exp2): s * LOG2E
LN2 = math.log(2.0)  # a base-2 LSE times LN2 is the natural-log one


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. (``triton.cdiv`` is a jit-callable: ~5 us a call on the host, in a
    path that runs every forward.)"""
    return -(-a // b)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
