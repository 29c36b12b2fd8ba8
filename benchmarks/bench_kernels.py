"""Kernel benchmarks as JSON: ``python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda]``.

``--device cuda`` (default when a GPU is present): :func:`mla_sm120_plugin.kernels.bench.run_gpu_benchmarks`
(eager and CUDA-graph time, GB/s and TFLOP/s against ceilings measured in the same run), the same
report as ``mla-sm120 bench``. ``--device cpu``: the torch reference's time and memory against a
naive full gather (:mod:`cpu_memory`, beside this file). What each number measures is in the
output's ``measures`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--plot", default=None, help="GPU only: also draw the results to this PNG")
    parser.add_argument("--output", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_memory import run_cpu_benchmarks

        report = run_cpu_benchmarks(quick=args.quick)
    else:
        from mla_sm120_plugin.kernels.bench import plot, run_gpu_benchmarks

        report = run_gpu_benchmarks(device=device, quick=args.quick)
        if args.plot:
            plot(report, args.plot)
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
