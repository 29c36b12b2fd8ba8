"""Kernel benchmarks as JSON: ``python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda]``.

A thin CLI over :func:`mla_sm120_plugin.kernels.bench.run_benchmarks`; what each number measures
is stated in that module and in the output's ``measures`` section.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device peak memory bandwidth in GB/s (overrides the built-in table)")
    parser.add_argument("--output", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)

    from mla_sm120_plugin.kernels.bench import run_benchmarks

    report = run_benchmarks(quick=args.quick, device=args.device, peak_gbps=args.peak_gbps)
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
