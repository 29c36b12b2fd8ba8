"""The benchmarks: the CPU memory harness's numbers mean what they say; the GPU report is JSON."""

from __future__ import annotations

import json

import pytest

import cpu_memory  # benchmarks/ is on pytest's pythonpath
from support.kernel_checks import ON_GPU
from mla_sm120_plugin.tools import bench
from mla_sm120_plugin.kernels.dsa import plan


def _clear_refs_writable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("rss_method", ["vmhwm", "sampled"])
def test_cpu_quick_report(monkeypatch, rss_method):
    """Both Linux ways of reading the rise (the high-water mark reset through clear_refs, and a
    sampling thread where a container makes clear_refs read-only) see the full gather's memory."""
    if rss_method == "vmhwm" and not _clear_refs_writable():
        pytest.skip("/proc/self/clear_refs is not writable here: the sampled reading stands in")
    monkeypatch.setattr(cpu_memory, "CPU_SHAPES_QUICK", [dict(num_heads=4, topk=256, num_tokens=16)])
    kinds = {"torch_sparse_mla_1MiB": 1 << 20, "naive_full_gather": None}
    report = json.loads(json.dumps(cpu_memory.run_cpu_benchmarks(quick=True, kinds=kinds, rss_method=rss_method)))
    (row,) = report["cpu"]
    chunked, naive = row["torch_sparse_mla_1MiB"], row["naive_full_gather"]
    assert chunked["max_abs_diff_vs_naive"] < 1e-2
    # A 1 MiB bound must hold the live tensors well under the full gather's (~20 MiB here).
    assert chunked["peak_live_tensor_bytes"] < naive["peak_live_tensor_bytes"] / 4
    # Both measured in their own subprocess, with the bound each kind was given.
    assert naive["peak_rss_rise_bytes"] is not None and naive["peak_rss_rise_bytes"] > 0
    assert chunked["peak_rss_rise_bytes"] is not None
    assert chunked["peak_rss_rise_bytes"] < naive["peak_rss_rise_bytes"]


@pytest.mark.skipif(not ON_GPU, reason="timings need a CUDA GPU (mla-sm120 bench on a GPU machine runs it)")
def test_gpu_quick_report(tmp_path):
    report = json.loads(json.dumps(bench.run_gpu_benchmarks(quick=True, compile_report=False)))
    assert report["ceilings"]["copy_gbps"] > 0 and report["ceilings"]["matmul_tflops"] > 0
    for row in report["results"]:
        for kernel in bench.TRITON_KERNELS:
            for label, entry in row["kernels"][kernel].items():
                assert "error" not in entry, (kernel, label, entry)
                bound = entry["bound"]
                assert entry["graph_us"] > 0 and entry["max_rel_diff"] <= bound["max_rel"], (kernel, label, entry)
                assert entry["cos_diff"] <= bound["cos_diff"] and entry["rel_rms"] <= bound["rel_rms"], entry
                assert entry["traffic"]["total"] >= entry["traffic"]["minimum"]
                assert ("note" in entry) == (kernel == plan.FAST.name and report["capability"].startswith("9."))
    pytest.importorskip("matplotlib")
    bench.plot(report, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_candidate_configs_start_with_the_table_and_cover_top_k():
    for kernel in bench.TRITON_KERNELS:
        for tokens, heads in bench.SHAPES:
            found = bench.candidate_configs(kernel, tokens, heads, bench.TOPK, "sm120")
            assert next(iter(found)) == bench.TABLE
            assert found[bench.TABLE] == plan.launch_config(kernel, tokens, heads, bench.TOPK, "sm120")
            assert len(set(found.values())) == len(found) >= 2  # something to compare the table's choice with
            for cfg in found.values():
                blocks = -(-bench.TOPK // cfg.block_k)
                assert (cfg.num_splits - 1) * cfg.blocks_per_split < blocks <= cfg.num_splits * cfg.blocks_per_split


def test_plot_draws_both_ceilings(tmp_path):
    """The picture from a report of the shape run_gpu_benchmarks returns (on a GPU, the test above
    plots a real one): one bar per kernel and shape, a ceiling line per panel, every candidate's time."""
    pytest.importorskip("matplotlib")
    entry = lambda frac: dict(gbps=4000 * frac, tflops=700 * frac, graph_us=10 / frac)  # noqa: E731
    row = lambda t, h, frac: dict(num_tokens=t, num_heads=h, kernels={  # noqa: E731
        "triton_sparse_mla": {"table": entry(frac), "double_splits": entry(frac / 2)},
        "triton_sparse_mla_fast": {"table": entry(2 * frac), "one_split": dict(error="boom")},
        "flashinfer_sparse_mla": {"table": dict(error="KernelUnavailable: not an SM120 GPU")}})
    report = dict(device="NVIDIA H200", ceilings=dict(copy_gbps=4246.0, matmul_tflops=797.0),
                  fast_kernel_note=bench.SM90_FAST_NOTE,
                  results=[row(1, 16, 0.1), row(64, 8, 0.5), row(2048, 128, 0.3)])
    fig = bench.figure(report)
    gbps_axis, tflops_axis, time_axis = fig.axes
    # The ceilings, as horizontal lines at the measured values.
    assert [tuple(line.get_ydata()) for line in gbps_axis.get_lines()] == [(4246.0, 4246.0)]
    assert [tuple(line.get_ydata()) for line in tflops_axis.get_lines()] == [(797.0, 797.0)]
    # One bar per kernel and shape at its table config's numbers (0 where it failed).
    heights = {c.get_label(): [bar.get_height() for bar in c] for c in gbps_axis.containers}
    assert heights["triton_sparse_mla"] == [400.0, 2000.0, 1200.0]
    assert heights["triton_sparse_mla_fast"] == [800.0, 4000.0, 2400.0]
    assert heights["flashinfer_sparse_mla"] == [0, 0, 0]
    # Every candidate config that ran has its time; the fast kernel's failed one is a zero bar.
    times = {c.get_label(): [bar.get_height() for bar in c] for c in time_axis.containers}
    assert times["triton double_splits"] == [200.0, 40.0, pytest.approx(200 / 3)]
    assert times["triton_fast one_split"] == [0, 0, 0]
    assert bench.SM90_FAST_NOTE in gbps_axis.get_title()
    bench.plot(report, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_dsv4_shapes_are_the_ones_the_issues_name():
    """The split issue's (T = 1 / 6 / 64 x 8 / 16 / 64 / 128 heads) and issue 51's: verifies of one
    request (T = 2-6), a batched decode (T = 64), prefill chunks (T = 512-8192) at 16 and 32 heads."""
    from mla_sm120_plugin.kernels.dsv4 import plan as dsv4_plan
    from mla_sm120_plugin.tools import bench_dsv4

    shapes = {(t, h) for _, _, t, h in bench_dsv4.SHAPES}
    assert shapes >= {(t, h) for t in (1, 6, 64) for h in (8, 16, 64, 128)}
    assert shapes >= {(t, h) for t in (2, 4, 6, 64, 512, 2048, 8192) for h in (16, 32)}
    assert [dsv4_plan.requests_of(t) for t in (1, 6, 64, 512)] == [1, 1, 64, 1]
    assert {kind: (bench_dsv4.WINDOW, c) for kind, (c, _) in bench_dsv4.KINDS.items()} == {
        "c4a": (128, 512), "c128a": (128, 8192)}
    assert {r for r, *_ in bench_dsv4.SHAPES} == {"fp8_dsv4", "nvfp4_dsv4"}
    assert bench_dsv4.FOOTPRINT_BYTES >= 4 * (128 << 20)  # several times the largest SM120 L2


@pytest.mark.parametrize("record", ["fp8_dsv4", "nvfp4_dsv4"])
def test_dsv4_bench_rows_run_what_they_time_and_check_it(record):
    """The CPU run of one row (no timings): the plan and the unsplit kernel on the bench's own inputs
    (a verify of one request: full rows, its windows overlapping, one compressed row) match float64,
    the row carrying the model's terms; FlashInfer's kernel, which cannot run here, is an error in its
    entry, not a failure of the row."""
    from mla_sm120_plugin.tools import bench_dsv4

    row = json.loads(json.dumps(bench_dsv4.shape_row(record, "c4a", 2, 8, "cpu", "sm120", None, footprint=1 << 20)))
    assert row["num_splits"] >= 1 and row["minimum_bytes"] > 0 and row["requests"] == 1
    assert row["modeled_us"]["plan"] <= row["modeled_us"]["unsplit"] and row["model"]["modeled_us"] == row[
        "modeled_us"]["plan"]
    assert {"dram_us", "mma_us", "issue_us", "chain_us", "bound", "ratio"} <= set(row["model"])
    for label in ("plan", "unsplit"):
        entry = row["kernels"][label]
        assert "error" not in entry, entry
        assert entry["cos_diff"] <= 5e-6 and entry["rel_rms"] <= 3e-3, entry
    flashinfer = row["kernels"]["flashinfer"]
    assert "error" in flashinfer or (flashinfer["cos_diff"] <= 5e-6 and flashinfer["rel_rms"] <= 3e-3), flashinfer


@pytest.mark.skipif(not ON_GPU, reason="timings need a CUDA GPU (mla-sm120 bench --dsv4 on a GPU machine runs it)")
def test_gpu_dsv4_report():
    from mla_sm120_plugin.tools import bench_dsv4

    report = json.loads(json.dumps(bench_dsv4.run(shapes=[("fp8_dsv4", "c4a", 1, 8), ("nvfp4_dsv4", "c128a", 6, 16)])))
    assert report["copy_gbps"] > 0
    for row in report["results"]:
        for label in ("plan", "unsplit"):
            entry = row["kernels"][label]
            assert "error" not in entry and entry["graph_us"] > 0, entry
            assert entry["cos_diff"] <= 5e-6 and entry["rel_rms"] <= 3e-3, entry


def test_dsv4_timings_refuse_what_they_cannot_do():
    from support.cli import assert_three_parts, run_cli

    clash = run_cli("bench", "--dsv4", "--plot", "x.png", "--quick")
    assert clash.returncode != 0
    assert_three_parts(clash.stderr.split("KernelInputError: ", 1)[1].strip(), "--dsv4 with --plot, --quick")
    if not ON_GPU:
        done = run_cli("bench", "--dsv4")
        assert done.returncode != 0 and "a CUDA GPU for DeepSeek-V4 timings" in done.stderr, done.stderr
