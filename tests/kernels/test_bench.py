"""The benchmark module: JSON-serializable, and its CPU numbers mean what they say."""

from __future__ import annotations

import json

import pytest

from mla_sm120_plugin.kernels import bench


def test_cpu_quick_report(monkeypatch):
    monkeypatch.setattr(bench, "CPU_SHAPES_QUICK", [dict(num_heads=4, topk=256, num_tokens=16)])
    monkeypatch.setattr(bench, "CPU_KINDS", {"torch_sparse_mla_1MiB": 1 << 20, "naive_full_gather": None})
    report = json.loads(json.dumps(bench.run_benchmarks(quick=True, device="cpu")))
    (row,) = report["cpu"]
    chunked, naive = row["torch_sparse_mla_1MiB"], row["naive_full_gather"]
    assert chunked["max_abs_diff_vs_naive"] < 1e-2
    # A 1 MiB bound must hold the live tensors well under the full gather's (~20 MiB here).
    assert chunked["peak_live_tensor_bytes"] < naive["peak_live_tensor_bytes"] / 4
    assert naive["peak_rss_rise_bytes"] is not None and naive["peak_rss_rise_bytes"] > 0


@pytest.mark.parametrize(
    "name, override, expected",
    [("NVIDIA GeForce RTX 5090", None, 1792.0), ("NVIDIA GB10", None, 273.0),
     ("NVIDIA GeForce RTX 5090", 1500.0, 1500.0), ("Some GPU", None, None)],
)
def test_peak_bandwidth_lookup(name, override, expected):
    assert bench._peak_for(name, override)[0] == expected
