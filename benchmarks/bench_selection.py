"""Selection cost: plugin loading once, then one `select()` per context.

Prints JSON. `budget_ratio` is median select time over 1 ms (the issue's bound); below 1 is
within it. The cold call includes the cached probes/envelopes (FlashInfer's table import).

    python benchmarks/bench_selection.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.hooks.manager import build_registry
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import SelectionContext

CASES = {
    "glm5_tp1_sm120_fp8": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 64, 2048, "12.0"),
    "glm5_tp16_sm121_fp8": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 4, 2048, "12.1"),
    "dsv32_tp8_sm120_bf16": ("DeepseekV32ForCausalLM", "bf16", 16, 2048, "12.0"),
    "glm5_tp4_sm90_topk1024": ("GlmMoeDsaForCausalLM", "fp8_ds_mla", 16, 1024, "9.0"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()

    t0 = time.perf_counter()
    reg = build_registry()
    load_ms = (time.perf_counter() - t0) * 1e3
    results = {}
    for name, (arch, kv, heads, topk, sm) in CASES.items():
        ctx = SelectionContext(arch, kv, heads, topk, parse_device(sm, source="--sm"))
        t0 = time.perf_counter()
        decision = select(ctx, registry=reg)
        cold_us = (time.perf_counter() - t0) * 1e6
        samples = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            select(ctx, registry=reg)
            samples.append((time.perf_counter() - t0) * 1e6)
        median = statistics.median(samples)
        results[name] = {
            "decode": decision.decode,
            "prefill": decision.prefill,
            "cold_us": round(cold_us, 1),
            "median_us": round(median, 2),
            "p99_us": round(sorted(samples)[int(0.99 * len(samples)) - 1], 2),
            "budget_ratio": round(median / 1000.0, 4),
        }
    print(json.dumps({"benchmark": "selection", "registry_load_ms": round(load_ms, 2), "repeat": args.repeat,
                      "cases": results}, indent=2))


if __name__ == "__main__":
    main()
