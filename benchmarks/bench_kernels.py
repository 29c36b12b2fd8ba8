"""Kernel benchmarks as JSON: ``python benchmarks/bench_kernels.py [--quick|--sweep] [--device cpu|cuda]``.

``--device cuda`` (default when a GPU is present): :func:`mla_sm120_plugin.tools.bench.run_gpu_benchmarks`
(eager and CUDA-graph time, GB/s and TFLOP/s against ceilings measured in the same run, for the
exact and fast Triton kernels and their candidate configurations), the same report as
``mla-sm120 bench``; the JSON is rewritten after every shape, so a run cut short keeps what it
measured. ``--sweep``: every shape, without the compile gate (benchmarks/device_run.sh).
``--dsv4``: the DeepSeek-V4 kernels instead (:mod:`mla_sm120_plugin.tools.bench_dsv4`: the Triton kernel
on its plan and unsplit, and FlashInfer's, at T 1/6/64 x heads 8-128 x C4A / C128A x both records).
``--device cpu``: the torch reference's time and memory against a naive full gather
(:mod:`cpu_memory`, beside this file). ``--traffic [FAMILY]``: the launch plans' modeled bytes
for the acceptance shapes and the configuration table (no GPU needed). What each number measures
is in the output's ``measures`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _write(report: dict, path: str | None) -> None:
    text = json.dumps(report, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    else:
        print(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--sweep", action="store_true", help="GPU: every shape, no compile report")
    parser.add_argument("--traffic", nargs="?", const="sm120", default=None, metavar="FAMILY",
                        help="print the traffic model and configuration table (sm120, sm121 or sm90) and exit")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--kv-layout", default="fp8_ds_mla",
                        help="GPU: the cache layout to time (fp8_ds_mla; GLM-5.3-Flash's fp8_ds_mla_nope / fp8_nope; "
                             "bf16; bf16_nope)")
    parser.add_argument("--dsv4", action="store_true", help="GPU: time the DeepSeek-V4 kernels instead")
    parser.add_argument("--plot", default=None, help="GPU only: also draw the results to this PNG")
    parser.add_argument("--output", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)

    if args.traffic:
        from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

        print(dsa_plan.format_report(args.traffic))
        for name in dsa_plan.KERNELS:
            print()
            print(dsa_plan.format_table(name, args.traffic))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_memory import run_cpu_benchmarks

        _write(run_cpu_benchmarks(quick=args.quick), args.output)
        return 0
    progress = (lambda partial: _write(partial, args.output)) if args.output else None
    if args.dsv4:
        from mla_sm120_plugin.tools import bench_dsv4

        _write(bench_dsv4.run(device=device, progress=progress), args.output)
        return 0
    from mla_sm120_plugin.tools.bench import plot, run_gpu_benchmarks

    report = run_gpu_benchmarks(device=device, quick=args.quick, compile_report=not args.sweep, progress=progress,
                                kv_layout=args.kv_layout)
    _write(report, args.output)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
