"""A kernel that the interpreter runs and a compiler rejects; prints the compile gate's row (JSON).

Run without TRITON_INTERPRET (a compiled-mode process): the bug class that hid the bf16-q failure,
a helper whose constexpr branches return different dtypes.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from mla_sm120_plugin.tools import compile_gate
from mla_sm120_plugin.kernels.shared.triton import Launch


@triton.jit
def _pick(x, FLAG: tl.constexpr):
    if FLAG:
        return x.to(tl.float32)
    return x


@triton.jit
def _returns_two_dtypes(x_ptr, FLAG: tl.constexpr):
    offs = tl.arange(0, 16)
    tl.store(x_ptr + offs, _pick(tl.load(x_ptr + offs), FLAG))


if __name__ == "__main__":
    launch = Launch(kernel=_returns_two_dtypes, grid=(1,),
                    args=(torch.empty(16, dtype=torch.int16),), constexprs=dict(FLAG=True),
                    num_warps=4, num_stages=1, describe=dict(kernel="probe"))
    print(json.dumps(compile_gate.compile_launch(launch, 120)))
