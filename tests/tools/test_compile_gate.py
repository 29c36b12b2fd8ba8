"""The compile gate: every Triton variant the dispatcher can launch compiles for sm_120a, sm_121a
and sm_90a on this CPU-only machine, without spills and within the shared memory of a block; the
fast fp8 variants run fp8 MMAs (QMMA) with two CTAs per SM on sm_120a/121a. Every cache layout is
in it, GLM-5.3-Flash's rope-less ones included (a variant's ``cache`` names every layout it serves:
the 656- and 528-byte rope-less fp8 rows are one compiled variant).

The interpreter runs kernels as Python (both branches of a constexpr ``if``, no register
allocation), so this is the test that sees what a real GPU would: compile errors, spills, shared
memory, the MMA instructions and occupancy. Numbers come from the tools Triton bundles (``ptxas
-v``, and ``cuobjdump -res-usage`` / ``nvdisasm`` on the cubin Triton built).
"""

from __future__ import annotations

import functools
import os
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.cli import clean_env, run_cli
from mla_sm120_plugin.tools import compile_gate
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.dsv4 import plan as dsv4_plan


# FlashInfer's import points Triton at a system ptxas (TRITON_PTXAS_BLACKWELL_PATH) when one of CUDA
# >= 13 is on PATH, and vLLM imports FlashInfer: the gate's verdict must not depend on that. Every
# gate below is compiled with both overrides pointing at a ptxas that answers `--version` like CUDA
# 13.0's and fails every compile. (A path that does not exist proves nothing: Triton falls back to
# its bundled ptxas for a tool it cannot run.)
_FAILING_PTXAS = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.48"; exit 0; fi
echo "failing ptxas: the compile gate must not use me" >&2
exit 1
"""


@functools.cache
def failing_ptxas_env() -> dict[str, str]:
    path = Path(tempfile.mkdtemp(prefix="mla-sm120-failing-ptxas-")) / "ptxas"
    path.write_text(_FAILING_PTXAS)
    path.chmod(0o755)
    return {"TRITON_PTXAS_BLACKWELL_PATH": str(path), "TRITON_PTXAS_PATH": str(path)}


# The arch whose gate is made by the CLI (`mla-sm120 bench --compile-only --arch 121 --json`, a fresh
# process, as a user runs it); the others by compile_gate.report in this process (which compiles in a
# child without TRITON_INTERPRET). Each arch is compiled once a run: the file's tests run on one
# xdist worker (nox runs pytest with --dist loadfile), which memoizes each arch's report.
CLI_ARCH = 121


@functools.cache
def _gate_report(arch: int) -> dict:
    """One compile of ``arch`` a worker process: memoized here, not by a module-scoped fixture, which
    pytest tears down and rebuilds whenever xdist interleaves tests of different arches."""
    if arch == CLI_ARCH:
        # A whole arch compiles in ~3 minutes on 2 busy cores; the guard leaves room for a loaded machine.
        done = run_cli("bench", "--compile-only", "--arch", str(arch), "--json", env=failing_ptxas_env(), timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in failing_ptxas_env().items():
            mp.setenv(key, value)
        return compile_gate.report(arch)


@pytest.fixture(params=sorted(compile_gate.ARCHES))
def gate(request):
    return _gate_report(request.param)


def test_every_variant_compiles_without_spills_within_shared_memory(gate):
    failed = [(v["variant"], v["error"]) for v in gate["variants"] if not v["compiled"]]
    assert not failed, failed
    for v in gate["variants"]:
        served_here = all(gate["arch"] in compile_gate.SERVED_ONLY_ON.get(c, (gate["arch"],))
                          for c in v.get("cache", "").split("+"))
        if served_here:  # nvfp4_ds_mla spills on sm_90a, where the plugin never serves it
            assert v["spill_bytes"] == 0 and v["stack_bytes"] == 0 and v["local_bytes"] == 0, v
        assert 0 < v["registers"] <= 255 and v["cubin_registers"] == v["registers"], v
        assert v["shared_bytes"] <= gate["shared_limit_bytes"], v
        assert v["ctas_per_sm"] >= 1 and v["ctas_limited_by"], v
    assert gate["gate_passed"], gate["gate_failures"]


def _caches(v) -> list[str]:
    """The layouts a variant serves (``fp8_ds_mla_nope+fp8_nope``: one compiled code for both)."""
    return v["cache"].split("+")


def _fast(gate):
    rows = [v for v in gate["variants"] if v["kernel"] == compile_gate.FAST_KERNEL]
    # final bf16/fp32 out and split, for the DSA rows and for the rope-less rows (one code for both)
    assert len(rows) == 6, [v["variant"] for v in gate["variants"]]
    assert sorted({c for v in rows for c in _caches(v)}) == sorted(layout.FP8_LAYOUTS)
    return rows


# SASS block-scaled fp8 MMAs in a fast variant: the four 128-wide latent tiles' score and value dots,
# each as a hi and a lo part (the single-e4m3 kernel had 24).
FAST_QMMA_COUNT = 48


def _check_fast_rows(gate, rows):
    for v in rows:
        kinds = set(v["mma"])
        if gate["arch"] in compile_gate.FP8_MMA_ARCHES:
            # Every latent dot is the block-scaled fp8 MMA (full rate on GeForce); only the rope dot
            # is bf16, and a rope-less variant has none.
            assert {k for k in kinds if k.startswith("QMMA")} == {compile_gate.FP8_MMA_KIND}, v["mma"]
            assert v["mma"][compile_gate.FP8_MMA_KIND] == FAST_QMMA_COUNT, v["mma"]
            rope = any(layout.get(c).rope for c in _caches(v))
            assert any(k.startswith("HMMA") for k in kinds) == rope, v["mma"]
            assert v["ctas_per_sm"] >= compile_gate.fast_ctas_per_sm(gate["arch"]) >= 1, v
            assert v["spill_bytes"] == v["stack_bytes"] == v["local_bytes"] == 0, v
        else:  # sm_90a has no fp8 mma.sync: Triton widens the fp8 operands (emulated, same values)
            assert not any(k.startswith("QMMA") for k in kinds) and any(k.startswith("HMMA") for k in kinds), v
        # Rows are gathered by asynchronous copies into shared memory, issued a step ahead.
        assert any(k.startswith("LDGSTS") and k.endswith((".64", ".128")) for k in v["global_loads"]), v


def test_fast_variants_run_block_scaled_fp8_mmas_at_the_planned_occupancy(gate):
    _check_fast_rows(gate, _fast(gate))


def test_fast_variants_pass_under_a_cuda_13_system_ptxas_too(gate):
    """FlashInfer's import points Triton at a system ptxas of CUDA >= 13 when one is on PATH; the
    fast variants are compiled with it (or pip's nvidia-cuda-nvcc one) too, and hold the same rules."""
    if gate["arch"] not in compile_gate.FP8_MMA_ARCHES:
        assert gate["system_ptxas"] is None and gate["system_ptxas_variants"] == []
        return
    other = gate["system_ptxas"]
    assert other is not None, "no CUDA >= 13 ptxas here: the vLLM environment installs nvidia-cuda-nvcc"
    assert int(other["release"].split(".")[0]) >= 13 and other["path"] != compile_gate._bundled_tool("ptxas")
    rows = gate["system_ptxas_variants"]
    assert [v["variant"] for v in rows] == [v["variant"] for v in _fast(gate)]
    _check_fast_rows(gate, rows)


def test_system_ptxas_is_found_by_flashinfers_rule(tmp_path, monkeypatch):
    """``ptxas`` on PATH of release >= 13 first (what FlashInfer's import selects), an older one never."""
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.7, V13.7.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    compile_gate.system_ptxas.cache_clear()
    try:
        found = compile_gate.system_ptxas()
        assert found == dict(path=str(fake.resolve()), release="13.7",
                             found_by="ptxas on PATH (what FlashInfer's import selects)")
        fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V12.9.86'\n")
        compile_gate.system_ptxas.cache_clear()
        assert (compile_gate.system_ptxas() or {}).get("path") != str(fake.resolve())
    finally:
        compile_gate.system_ptxas.cache_clear()


def test_exact_variants_use_bf16_mmas(gate):
    for v in gate["variants"]:
        if v["kernel"] == "sparse_mla":
            assert set(v["mma"]) == {"HMMA.16816.F32.BF16"}, v


def test_the_plan_assumes_no_more_ctas_per_sm_than_compiled(gate):
    """The configuration tables size their waves with each kernel's CTAs per SM: never more than the
    compiler's (the DeepSeek-V4 kernel's per record, split and unsplit)."""
    family = plan.gpu_family(gate["arch"] // 10, gate["arch"] % 10)
    for kernel, shape in (("sparse_mla", plan.EXACT), (compile_gate.FAST_KERNEL, plan.FAST)):
        rows = [v for v in gate["variants"]
                if v["kernel"] == kernel and (kernel != "sparse_mla" or layout.get(_caches(v)[0]).fp8)]
        assert rows and min(v["ctas_per_sm"] for v in rows) >= shape.ctas_per_sm[family], rows
    for record, shape in dsv4_plan.SHAPES.items():
        rows = [v for v in gate["variants"] if v["kernel"] == compile_gate.DSV4_KERNEL and v["record"] == record]
        assert {v["final"] for v in rows} == {0, 1} and len(rows) == 4, rows  # window / two caches, split or not
        assert min(v["ctas_per_sm"] for v in rows) >= shape.ctas_per_sm[family], rows


# Issue 51's "before": warp instructions a candidate of the DeepSeek-V4 kernel's loop on sm_120a
# (16 heads, 16 candidates a step, one stage; fp8 4 warps, NVFP4 8), from the compile gate of the
# parent commit: the compiled code now costs what the plan's model counts, well under these.
DSV4_BEFORE_PER_CANDIDATE = {"fp8_dsv4": 283.5, "nvfp4_dsv4": 724.5}


def test_dsv4_variants_cost_what_the_model_counts(gate):
    """Every DeepSeek-V4 variant: on sm_120a / sm_121a its loop issues the MMAs the plan's model
    counts a step (:class:`~mla_sm120_plugin.kernels.dsv4.plan.Compiled`; f16 and bf16 HMMA, 8 a
    candidate at 16 heads: no warp repeats another's) and at most its instructions (32 candidates a
    step), at two CTAs an SM; on every arch, no spill."""
    rows = [v for v in gate["variants"] if v["kernel"] == compile_gate.DSV4_KERNEL]
    assert len(rows) == 8, [v["variant"] for v in rows]
    for v in rows:
        assert v["spill_bytes"] == v["stack_bytes"] == 0, v
        if gate["arch"] not in compile_gate.FP8_MMA_ARCHES:
            continue
        shape = dsv4_plan.SHAPES[v["record"]]
        assert {k: n * v["warps"] for k, n in v["loop_mma"].items()} == shape.compiled.mma, v
        assert all(k.startswith("HMMA.16816.F32") for k in v["loop_mma"]), v
        most = shape.compiled.instructions * (1 + compile_gate.DSV4_INSTRUCTION_SLACK)
        assert v["loop_instructions"] * v["warps"] <= most and v["instructions_per_candidate"] <= most / 32, v
        assert v["instructions_per_candidate"] < 0.8 * DSV4_BEFORE_PER_CANDIDATE[v["record"]], v
        assert v["ctas_per_sm"] >= 2, v
    assert compile_gate.dsv4_model_failures({**rows[0], "loop_instructions": 10**6})  # the rule can fail


def test_every_streaming_variant_states_its_bytes_in_flight(gate):
    """CTAs x candidates a step x row bytes x (stages - 1, at least 1): on SM12x at least what an SM
    of the family's part moves in one DRAM latency (RTX 5090: 1792 GB/s / 170 SMs x 1 us)."""
    need = compile_gate.latency_bytes_per_sm(gate["arch"])
    rows = [v for v in gate["variants"] if v["kernel"] in compile_gate.STREAMING_KERNELS]
    assert rows
    for v in rows:
        assert v["bytes_in_flight"] == v["ctas_per_sm"] * v["step_bytes"] * max(1, v["stages"] - 1), v
        if gate["arch"] in compile_gate.FP8_MMA_ARCHES:
            assert v["bytes_in_flight"] >= need, v
    assert 10_000 < compile_gate.latency_bytes_per_sm(120) < 11_000


def test_gate_rules_fail_what_they_should():
    """Synthetic rows: the rules themselves, without compiling."""
    good = dict(variant="v", compiled=True, error=None, kernel=compile_gate.FAST_KERNEL, spill_bytes=0, stack_bytes=0,
                local_bytes=0, shared_bytes=48_640, mma={"QMMA.SF.16832.F32.E4M3.E4M3.E8": 24}, ctas_per_sm=2,
                ctas_limited_by="registers", step_bytes=20_992, bytes_in_flight=20_992)
    assert compile_gate.gate_failures(120, [good]) == []
    bad = {
        "no QMMA": dict(mma={"HMMA.16816.F32.BF16": 52}),
        "fewer CTAs per SM than planned": dict(ctas_per_sm=0),
        "plain (half-rate) QMMA": dict(mma={"QMMA.16832.F32.E4M3.E4M3": 24, "QMMA.SF.16832.F32.E4M3.E4M3.E8": 24}),
        "spills": dict(spill_bytes=8, stack_bytes=8),
        "shared memory": dict(shared_bytes=200_000),
        "does not compile": dict(compiled=False, error="boom"),
        "a DRAM latency not covered": dict(bytes_in_flight=10_000),
    }
    for what, change in bad.items():
        assert compile_gate.gate_failures(120, [{**good, **change}]), what
    # sm_90a has no fp8 mma.sync and its own occupancy: only the general rules apply there.
    assert compile_gate.gate_failures(90, [{**good, "mma": {"HMMA.16816.F32.BF16": 52}, "ctas_per_sm": 1}]) == []
    # A layout served on SM12x only (nvfp4_ds_mla): its spills fail sm_120a/121a, not sm_90a.
    nv = {**good, "kernel": "sparse_mla", "cache": layout.NVFP4_DS_MLA, "spill_bytes": 8, "stack_bytes": 8}
    assert compile_gate.gate_failures(120, [nv]) and compile_gate.gate_failures(121, [nv])
    assert compile_gate.gate_failures(90, [nv]) == []


def test_ctas_per_sm_takes_the_tightest_limit():
    assert compile_gate.ctas_per_sm(120, 128, 8, 48_640 + 1_024) == (2, "registers")
    assert compile_gate.ctas_per_sm(120, 176, 8, 27_264) == (1, "registers")
    assert compile_gate.ctas_per_sm(120, 64, 4, 60_000) == (1, "shared")
    assert compile_gate.ctas_per_sm(120, 32, 16, 0) == (3, "threads")
    assert compile_gate.ctas_per_sm(90, 128, 8, 48_640) == (2, "registers")


def _variant(kernel: str, cache: str, out: str, final: int, cfg) -> str:
    """A variant's text with its cache field as ``{}``."""
    cap = "" if cfg.maxnreg is None else f" maxnreg={cfg.maxnreg}"
    return (f"kernel={kernel} q=bf16 cache={{}} out={out} final={final} block_h={cfg.block_h} "
            f"block_k={cfg.block_k} warps={cfg.num_warps} stages={cfg.num_stages}{cap}")


def test_variants_cover_every_launch_the_dispatcher_makes(gate):
    texts = {v["variant"] for v in gate["variants"]}
    served = {}  # variant text with its cache field as {} -> the layouts it serves
    for v in gate["variants"]:
        if "cache" in v:
            served.setdefault(v["variant"].replace(f"cache={v['cache']} ", "cache={} "), set()).update(_caches(v))
    for cache in layout.KV_LAYOUTS:  # every layout, the rope-less ones included
        for out, final in (("bf16", 1), ("fp32", 1), ("fp32", 0)):
            for cfg in tk.launch_variants():
                if int(cfg.num_splits == 1) != final:
                    continue
                assert cache in served.get(_variant("sparse_mla", cache, out, final, cfg), ()), (cache, out, final)
    for cache in layout.FP8_LAYOUTS:
        for out, final in (("bf16", 1), ("fp32", 1), ("fp32", 0)):  # split partials are fp32
            assert cache in served.get(_variant("sparse_mla_fast", cache, out, final, plan.FAST.config()), ()), \
                (cache, out, final)
    for part in {plan.EXACT.partial_dtype, plan.FAST.partial_dtype}:
        for out in ("bf16", "fp32"):
            assert any(t.startswith(f"kernel=combine part={part} out={out} ") for t in texts), texts


def test_the_gate_reports_what_only_a_compiler_sees():
    """The bug class that hid the bf16 failure (a helper whose constexpr branches return different
    dtypes): the interpreter runs it, the gate reports a compile error."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("probe_two_returns.py"))],
                          capture_output=True, text=True, env=clean_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["compiled"] is False and "return" in row["error"].lower(), row


def test_cli_compile_only_json(gate):
    """`mla-sm120 bench --compile-only --arch 121 --json` (the CLI-made gate): the report's fields."""
    if gate["arch"] != CLI_ARCH:
        pytest.skip(f"the CLI makes the sm_{CLI_ARCH}a gate only (one compile per arch a run)")
    assert gate["variants"]
    for v in gate["variants"]:
        assert {"variant", "compiled", "registers", "spill_bytes", "shared_bytes", "error", "ctas_per_sm", "mma",
                "global_loads"} <= set(v)
        assert v["compiled"] and v["spill_bytes"] == 0 and v["shared_bytes"] <= 101_376
    assert gate["gate_passed"] and gate["min_fast_ctas_per_sm"] >= compile_gate.fast_ctas_per_sm(CLI_ARCH)
    assert gate["system_ptxas"] is not None and len(gate["system_ptxas_variants"]) == 6


def test_cli_unknown_arch_is_refused():
    done = run_cli("bench", "--compile-only", "--arch", "75")
    assert done.returncode == 2
    assert "given: arch=75" in done.stderr and "fix:" in done.stderr


def test_the_gate_reads_tritons_own_ptxas_whatever_the_caller_imported(gate):
    """Every gate was compiled with both ptxas overrides pointing at a ptxas that fails every compile
    (:func:`failing_ptxas_env`): the in-process report and the CLI alike stripped them, so every
    variant compiled."""
    rows = gate["variants"]
    assert rows and all(v["compiled"] for v in rows), [v.get("error") for v in rows if not v["compiled"]][:1]


def test_the_nvfp4_writers_are_compiled_for_every_compression(gate):
    """vLLM's DeepSeek-V4 layers run the NVFP4 record's writers (window rows, C4A's 8 overlapping states,
    C128A's 128): each is a variant of the gate, held to its no-spill rule above."""
    rows = {v["rows"]: v for v in gate["variants"] if v["kernel"] == "dsv4_nvfp4_write"}
    assert sorted(rows) == ["c128a", "c4a", "window"]
    assert all(v["compiled"] and v["spill_bytes"] == 0 for v in rows.values()), rows
