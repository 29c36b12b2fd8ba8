"""Run the Triton kernel with every input placed against an unreadable page (a child process).

``python tests/kernels/guarded_call.py KV_LAYOUT NUM_SPLITS``: exits 0 when the output matches the
reference, 1 when it does not, and dies with SIGSEGV when any load reads past a tensor's storage.
A fresh interpreter, not a fork: forking a process whose torch thread pools are running can hang.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/kernels: the case builder

import torch  # noqa: E402

from conftest import build_case  # noqa: E402
from helpers import against_guard_page, assert_kernel_close  # noqa: E402
from mla_sm120_plugin.kernels import triton as tk  # noqa: E402
from mla_sm120_plugin.kernels.reference import torch_sparse_mla  # noqa: E402


def main(kv_layout: str, num_splits: int) -> int:
    case = build_case(kv_layout=kv_layout, num_tokens=4, num_heads=5, topk=100, device="cpu")
    case.indices[0, :3] = torch.tensor([case.num_slots - 1, case.num_slots, -1], dtype=torch.int32)
    extra = dict(topk_length=torch.tensor([100], dtype=torch.int32).expand(4), sink=torch.tensor([0.5]).expand(5))
    ref_out, ref_lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                        kv_layout=kv_layout, return_lse=True, **extra)
    blocks = -(-case.indices.shape[1] // tk.BLOCK_K)
    cfg = tk.LaunchConfig(tk.BLOCK_H, tk.BLOCK_K, num_splits, -(-blocks // num_splits), tk.NUM_WARPS, tk.NUM_STAGES)
    out, lse = tk._run(
        against_guard_page(case.q), against_guard_page(case.kv_cache), against_guard_page(case.indices),
        sm_scale=case.sm_scale, kv_layout=kv_layout, out=None, return_lse=True, lse_base="e", config=cfg,
        **{k: against_guard_page(v) for k, v in extra.items()},
    )
    assert_kernel_close(out, ref_out)
    assert_kernel_close(lse, ref_lse)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
