"""Run Triton kernels with every input placed against an unreadable page (a child process).

``python tests/kernels/guarded_call.py KERNELS KV_LAYOUT SPLITS``: KERNELS a comma-separated list of
``exact`` (triton_sparse_mla) and ``fast`` (triton_sparse_mla_fast), SPLITS a comma-separated list of
split counts (``1,4``), each pair run in turn in this one process (a process start costs more than a run).
Exits 0 when every output matches the reference (within the kernel's tolerance), 1 when one does
not, and dies with SIGSEGV when any load reads past a tensor's storage: the last slot of the cache
is a candidate, so a kernel that read more of a row than the layout has (a rope a rope-less row
lacks, the tail of a 656-byte row in a 528-byte one) faults.
A fresh interpreter, not a fork: forking a process whose torch thread pools are running can hang.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the support package

import torch  # noqa: E402

from support.kernel_cases import build_case  # noqa: E402
from support.kernel_checks import KERNEL_REL_TOL, against_guard_page, assert_kernel_close  # noqa: E402
from mla_sm120_plugin.kernels.dsa import triton as tk  # noqa: E402
from mla_sm120_plugin.kernels.dsa import triton_fast as tf  # noqa: E402
from mla_sm120_plugin.kernels.dsa import plan  # noqa: E402
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla  # noqa: E402

KERNELS = {"exact": (tk._run, plan.EXACT, KERNEL_REL_TOL), "fast": (tf._run, plan.FAST, tf.TOLERANCE)}


def main(kernels: list[str], kv_layout: str, splits: list[int]) -> int:
    case = build_case(kv_layout=kv_layout, num_tokens=4, num_heads=5, topk=100, device="cpu")
    case.indices[0, :3] = torch.tensor([case.num_slots - 1, case.num_slots, -1], dtype=torch.int32)
    extra = dict(topk_length=torch.tensor([100], dtype=torch.int32).expand(4), sink=torch.tensor([0.5]).expand(5))
    ref_out, ref_lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                        kv_layout=kv_layout, return_lse=True, **extra)
    guarded = dict(q=against_guard_page(case.q), kv_cache=against_guard_page(case.kv_cache),
                   indices=against_guard_page(case.indices), **{k: against_guard_page(v) for k, v in extra.items()})
    for (run, shape, rel), num_splits in ((KERNELS[k], n) for k in kernels for n in splits):
        blocks = -(-case.indices.shape[1] // shape.block_k)
        cfg = shape.config(num_splits, -(-blocks // num_splits))
        out, lse = run(guarded["q"], guarded["kv_cache"], guarded["indices"], sm_scale=case.sm_scale,
                       kv_layout=kv_layout, topk_length=guarded["topk_length"], sink=guarded["sink"], out=None,
                       return_lse=True, lse_base="e", config=cfg)
        assert_kernel_close(out, ref_out, rel)
        assert_kernel_close(lse, ref_lse, rel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(","), sys.argv[2], [int(s) for s in sys.argv[3].split(",")]))
