"""Selection cost: a whole `mla-sm120 check` in fresh processes, then plugin loading once and one
`select()` per context in this process.

Prints JSON. `cold_check`: wall time of `--processes` fresh
`python -m mla_sm120_plugin.cli check --model glm-5 --sm 12.1 --tp 16 --json` runs (interpreter
start, imports, registry, decision, output), their median over a 300 ms budget, and a bare
`python -c pass` measured alternately with them as the floor. `cases`: `budget_ratio` is the median
select time over 1 ms; below 1 is within it. A case's first call (`cold_us`) includes the cached
probes and envelopes.

    python benchmarks/bench_selection.py [--repeat 2000] [--processes 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.hooks.manager import build_registry
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import SelectionContext

CHECK_ARGS = ("check", "--model", "glm-5", "--sm", "12.1", "--tp", "16", "--json")
COLD_BUDGET_MS = 300.0

CASES = {
    "glm5_tp1_sm120_fp8": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 64, 2048, "12.0"),
    "glm5_tp16_sm121_fp8": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 4, 2048, "12.1"),
    "dsv32_tp8_sm120_bf16": ("DeepseekV32ForCausalLM", "bf16", 16, 2048, "12.0"),
    "glm5_tp4_sm120_topk1024": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 16, 1024, "12.0"),
    # A refusal is a decision too (SM90 is vLLM's own backends' job): its cost is timed the same way.
    "glm5_tp4_sm90_refused": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 16, 2048, "9.0"),
}


def _wall_ms(command: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1e3


def cold_check(processes: int) -> dict:
    """Wall time of fresh `check` processes and of bare interpreters, run alternately."""
    check = [sys.executable, "-m", "mla_sm120_plugin.cli", *CHECK_ARGS]
    bare = [sys.executable, "-c", "pass"]
    _wall_ms(check)  # warm the OS file cache and .pyc files; not counted
    check_ms, bare_ms = [], []
    for _ in range(processes):
        check_ms.append(_wall_ms(check))
        bare_ms.append(_wall_ms(bare))
    median = statistics.median(check_ms)
    return {
        "command": "python -m mla_sm120_plugin.cli " + " ".join(CHECK_ARGS),
        "processes": processes,
        "median_ms": round(median, 1),
        "min_ms": round(min(check_ms), 1),
        "max_ms": round(max(check_ms), 1),
        "budget_ms": COLD_BUDGET_MS,
        "budget_ratio": round(median / COLD_BUDGET_MS, 3),
        "python_pass_median_ms": round(statistics.median(bare_ms), 1),
        "over_python_pass_ms": round(median - statistics.median(bare_ms), 1),
    }


def _decide(ctx, registry):
    """The decision, or None where select() refuses (the refusal is part of what is timed)."""
    try:
        return select(ctx, registry=registry)
    except UnsupportedConfiguration:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=5, help="fresh `check` processes to time")
    args = parser.parse_args()

    cold = cold_check(args.processes)
    t0 = time.perf_counter()
    reg = build_registry()
    load_ms = (time.perf_counter() - t0) * 1e3
    results = {}
    for name, (arch, kv, heads, topk, sm) in CASES.items():
        ctx = SelectionContext(arch, kv, heads, topk, parse_device(sm, source="--sm"))
        t0 = time.perf_counter()
        decision = _decide(ctx, reg)
        cold_us = (time.perf_counter() - t0) * 1e6
        samples = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            _decide(ctx, reg)
            samples.append((time.perf_counter() - t0) * 1e6)
        median = statistics.median(samples)
        results[name] = {
            "decode": decision.decode if decision else None,
            "prefill": decision.prefill if decision else None,
            "refused": decision is None,
            "cold_us": round(cold_us, 1),
            "median_us": round(median, 2),
            "p99_us": round(sorted(samples)[int(0.99 * len(samples)) - 1], 2),
            "budget_ratio": round(median / 1000.0, 4),
        }
    report = {
        "benchmark": "selection",
        "cold_check": cold,
        "registry_load_ms": round(load_ms, 2),
        "repeat": args.repeat,
        "cases": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
