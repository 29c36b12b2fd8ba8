"""Cost of our vllm.general_plugins entry point, against a bare `load_general_plugins()`.

Each run is a fresh interpreter that imports vLLM first (as every vLLM process has), then times
`load_general_plugins()` and counts the modules it imported. Baseline: the same with
VLLM_PLUGINS naming no plugin; ours: VLLM_PLUGINS=mla_sm120. Prints JSON.

    python benchmarks/bench_register.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import vllm.plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
before = set(sys.modules)
t0 = time.perf_counter()
vllm.plugins.load_general_plugins()
dt = time.perf_counter() - t0
new = sorted(set(sys.modules) - before)
print(json.dumps({"ms": dt * 1e3, "new_modules": new, "custom": E.CUSTOM.is_overridden()}))
"""


def _one(plugins: str) -> dict:
    env = dict(os.environ, VLLM_PLUGINS=plugins, VLLM_LOGGING_LEVEL="ERROR")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    result = {}
    for label, plugins in (("bare", "no_such_plugin"), ("mla_sm120", "mla_sm120")):
        runs = [_one(plugins) for _ in range(args.runs)]
        heavy = sorted({m for r in runs for m in r["new_modules"] if m.split(".")[0] in ("torch", "triton", "flashinfer")})
        result[label] = {
            "median_ms": round(statistics.median(r["ms"] for r in runs), 3),
            "max_ms": round(max(r["ms"] for r in runs), 3),
            "new_modules": len(runs[-1]["new_modules"]),
            "new_module_names": runs[-1]["new_modules"],
            "new_heavy_modules": heavy,
            "custom_registered": runs[-1]["custom"],
        }
    result["ratio_ms"] = round(result["mla_sm120"]["median_ms"] / max(result["bare"]["median_ms"], 1e-3), 2)
    result["extra_ms"] = round(result["mla_sm120"]["median_ms"] - result["bare"]["median_ms"], 3)
    print(json.dumps({"benchmark": "register", "runs": args.runs, **result}, indent=2))


if __name__ == "__main__":
    main()
