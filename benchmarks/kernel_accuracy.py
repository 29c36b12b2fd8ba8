"""Each kernel's own error, in FlashMLA's metrics, against float64 attention over the dequantized rows.

For every kernel the plugin ships that runs here (the torch reference; the Triton kernels, on a CUDA
GPU or, without one, under Triton's interpreter, which runs their GPU numerics) and every cache
layout it reads, in the regimes of mla_sm120_plugin.tools.accuracy_cases (flat, peaked, outlier
channels, few candidates): cos_diff, relRMS and max error (mla_sm120_plugin.kernels.accuracy), the
worst over the seeds, beside the bound the kernel declares. The cache's own rounding is not in
these numbers (benchmarks/nvfp4_accuracy.py measures that).

    python benchmarks/kernel_accuracy.py [--json] [--seeds 2] [--topk 256] [--heads 16]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

from mla_sm120_plugin.dispatch import catalog  # noqa: E402
from mla_sm120_plugin.kernels.accuracy import measure  # noqa: E402
from mla_sm120_plugin.kernels.dsa import layout, pack  # noqa: E402
from mla_sm120_plugin.kernels.dsa import triton as tk  # noqa: E402
from mla_sm120_plugin.kernels.dsa import triton_fast as tf  # noqa: E402
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla  # noqa: E402
from mla_sm120_plugin.tools.accuracy_cases import REGIMES, regime_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {  # name -> (function, spec)
    catalog.TORCH: (torch_sparse_mla, catalog.TORCH_SPEC),
    catalog.TRITON: (tk.triton_sparse_mla, catalog.TRITON_SPEC),
    catalog.TRITON_FAST: (tf.triton_sparse_mla_fast, catalog.TRITON_FAST_SPEC),
}


def truth(case) -> torch.Tensor:
    """float64 attention over the rows as the cache dequantizes them: [T, H, 512]."""
    keys = pack.dequantize(pack.flat_view(case.kv_cache), case.kv_layout).double()  # [S, D]
    out = torch.zeros(*case.q.shape[:2], layout.KV_LORA_RANK, dtype=torch.float64)
    for t in range(case.q.shape[0]):
        ids = case.indices[t][(case.indices[t] >= 0) & (case.indices[t] < keys.shape[0])].long()
        if ids.numel():
            s = case.sm_scale * (case.q[t].double() @ keys[ids].T)  # [H, n]
            out[t] = torch.softmax(s, dim=-1) @ keys[ids, : layout.KV_LORA_RANK]
    return out


def run(seeds: int, topk: int, heads: int) -> dict:
    rows = []
    for name, (fn, spec) in KERNELS.items():
        for kv_layout in sorted(spec.kv_cache_dtypes):
            for regime in REGIMES:
                worst = None
                for seed in range(seeds):
                    case = regime_case(regime, kv_layout, heads=heads, topk=topk, pages=max(4, 2 * topk // 64),
                                       seed=seed)
                    got = fn(case.q.to(DEVICE), case.kv_cache.to(DEVICE), case.indices.to(DEVICE),
                             sm_scale=case.sm_scale, kv_layout=kv_layout)
                    acc = measure(got, truth(case))
                    worst = acc if worst is None else type(acc)(max(worst.cos_diff, acc.cos_diff),
                                                                max(worst.rel_rms, acc.rel_rms),
                                                                max(worst.max_rel, acc.max_rel))
                rows.append(dict(kernel=name, kv_layout=kv_layout, regime=regime, cos_diff=worst.cos_diff,
                                 rel_rms=worst.rel_rms, max_rel=worst.max_rel, precision=spec.precision,
                                 within_bound=not spec.accuracy.violations(worst)))
    return dict(device=DEVICE, interpreter=DEVICE == "cpu", seeds=seeds, topk=topk, heads=heads, rows=rows,
                bounds={name: dict(cos_diff=spec.accuracy.cos_diff, rel_rms=spec.accuracy.rel_rms,
                                   max_rel=spec.accuracy.max_rel) for name, (_, spec) in KERNELS.items()})


def markdown(report: dict) -> str:
    """Per kernel and layout, the worst regime's numbers (and which regime)."""
    lines = ["| kernel (class) | KV cache | cos_diff | relRMS | max error | worst regime | within its bound |",
             "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in report["rows"]:
        groups.setdefault((row["kernel"], row["kv_layout"]), []).append(row)
    for (kernel, kv_layout), rows in groups.items():
        worst = max(rows, key=lambda r: r["rel_rms"])
        lines.append(f"| {kernel} ({worst['precision']}) | {kv_layout} | {max(r['cos_diff'] for r in rows):.2e} | "
                     f"{max(r['rel_rms'] for r in rows):.3%} | {max(r['max_rel'] for r in rows):.3%} | "
                     f"{worst['regime']} | {'yes' if all(r['within_bound'] for r in rows) else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    report = run(args.seeds, args.topk, args.heads)
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return 0 if all(row["within_bound"] for row in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
