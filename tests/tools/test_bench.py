"""The benchmarks: the CPU memory harness's numbers mean what they say; the GPU report is JSON."""

from __future__ import annotations

import json

import pytest

import cpu_memory  # benchmarks/ is on pytest's pythonpath
from helpers import ON_GPU
from mla_sm120_plugin.tools import bench
from mla_sm120_plugin.kernels.dsa import triton_plan as plan


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
