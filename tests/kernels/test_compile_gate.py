"""The compile gate: every Triton variant the dispatcher can launch compiles for sm_120a, sm_121a
and sm_90a on this CPU-only machine, without spills and within the shared memory of a block.

The interpreter runs kernels as Python (both branches of a constexpr ``if``, no register
allocation), so this is the test that sees what a real GPU would: compile errors, spills, shared
memory. Numbers come from the ptxas Triton bundles (``ptxas -v``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli
from mla_sm120_plugin.kernels import compile_gate
from mla_sm120_plugin.kernels import triton as tk


@pytest.fixture(scope="module", params=sorted(compile_gate.ARCHES))
def gate(request):
    return compile_gate.report(request.param)


def test_every_variant_compiles_without_spills_within_shared_memory(gate):
    failed = [(v["variant"], v["error"]) for v in gate["variants"] if not v["compiled"]]
    assert not failed, failed
    for v in gate["variants"]:
        assert v["spill_bytes"] == 0 and v["stack_bytes"] == 0, v
        assert 0 < v["registers"] <= 255, v
        assert v["shared_bytes"] <= gate["shared_limit_bytes"], v


def test_variants_cover_every_launch_the_dispatcher_makes(gate):
    texts = {v["variant"] for v in gate["variants"]}
    for cache in ("fp8_ds_mla", "bf16"):
        for out, final in (("bf16", 1), ("fp32", 1), ("fp32", 0)):
            for cfg in tk.launch_variants():
                if int(cfg.num_splits == 1) != final:
                    continue
                assert (f"kernel=sparse_mla q=bf16 cache={cache} out={out} final={final} block_h={cfg.block_h} "
                        f"block_k={cfg.block_k} warps={cfg.num_warps} stages={cfg.num_stages}") in texts
    for out in ("bf16", "fp32"):
        assert any(t.startswith(f"kernel=combine out={out} ") for t in texts), texts


def test_the_gate_reports_what_only_a_compiler_sees():
    """The bug class that hid the bf16 failure (a helper whose constexpr branches return different
    dtypes): the interpreter runs it, the gate reports a compile error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("probe_two_returns.py"))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["compiled"] is False and "return" in row["error"].lower(), row


def test_cli_compile_only_json():
    done = run_cli("bench", "--compile-only", "--arch", "121", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["arch"] == 121 and report["variants"]
    for v in report["variants"]:
        assert {"variant", "compiled", "registers", "spill_bytes", "shared_bytes", "error"} <= set(v)
        assert v["compiled"] and v["spill_bytes"] == 0 and v["shared_bytes"] <= 101_376


def test_cli_unknown_arch_is_refused():
    done = run_cli("bench", "--compile-only", "--arch", "75")
    assert done.returncode == 2
    assert "given: arch=75" in done.stderr and "fix:" in done.stderr
