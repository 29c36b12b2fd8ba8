"""Planning an nvfp4_ds_mla cache with ``mla-sm120 check``: served on SM12x for the DSA geometry by
the exact Triton kernel (and the reference), with its capacity beside fp8_ds_mla's and bf16's;
refused, with given / supported / fix, where no writer or reader exists."""

from __future__ import annotations

import json

import pytest
from support.cli import decision_of, run_cli

GIB = 1 << 30


def test_check_plans_nvfp4_and_prints_the_capacity():
    res = run_cli("check", "--model", "glm-5", "--sm", "12.1", "--tp", "4", "--kv-cache-dtype", "nvfp4_ds_mla")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "kv cache   nvfp4_ds_mla" in out
    for phase in ("prefill", "decode"):
        assert f"{phase:<8} triton_sparse_mla        SELECTED" in out
    # Independent arithmetic: tokens per GiB of 352-, 656- and 1152-byte rows.
    capacity = next(line for line in out.splitlines() if line.startswith("capacity"))
    for name, row in (("nvfp4_ds_mla", 352), ("fp8_ds_mla", 656), ("bf16", 1152)):
        assert f"{name} {GIB // row:,} ({row} B)" in capacity, capacity
    assert "1.86x fp8_ds_mla" in capacity and "3.27x bf16" in capacity
    # The readers that cannot read it say why.
    assert "flashinfer_sparse_mla    rejected: reads kv_cache_dtype" in out
    assert "triton_sparse_mla_fast   rejected: reads kv_cache_dtype" in out


def test_check_json_carries_the_capacity_and_fast_precision_still_plans():
    res = run_cli("check", "--model", "deepseek-v3.2", "--sm", "12.0", "--tp", "8", "--kv-cache-dtype",
                  "nvfp4_ds_mla", "--precision", "fast", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    decision = decision_of(report)
    assert decision["kernels"] == {"prefill": "triton_sparse_mla", "decode": "triton_sparse_mla"}
    cap = report["capacity"]
    assert cap == decision["capacity"] | {"scope": cap["scope"]}  # one kind: the plan's capacity is its decision's
    assert cap["layouts"]["nvfp4_ds_mla"] == {"token_bytes": 352, "tokens_per_gib": GIB // 352}
    assert cap["ratio_vs"] == {"fp8_ds_mla": round((GIB // 352) / (GIB // 656), 2), "bf16": round((GIB // 352) / (GIB // 1152), 2)}


@pytest.mark.parametrize("args, needles", [
    (("--model", "glm-5.3-flash", "--sm", "12.1"),
     ("rope-less model (GLM-5.3-Flash) has no nvfp4 writer", "supported: the layouts vLLM writes for this model",
      "fix: pass --kv-cache-dtype fp8_ds_mla")),
    (("--model", "glm-5", "--sm", "9.0"),
     ("device sm_90: this plugin serves SM12x only", "FLASHMLA_SPARSE reads nvfp4_ds_mla on SM100 only")),
    (("--model", "glm-5", "--sm", "12.1", "--engine", "sglang"),
     ("SGLang 0.5.23 has no nvfp4_ds_mla cache writer", "supported: the layouts SGLang writes",
      "--attention-backend CUSTOM --kv-cache-dtype nvfp4_ds_mla")),
])
def test_check_refuses_where_nothing_writes_or_reads_it(args, needles):
    res = run_cli("check", *args, "--tp", "4", "--kv-cache-dtype", "nvfp4_ds_mla")
    assert res.returncode == 2, res.stdout
    assert "kv_cache_dtype=nvfp4_ds_mla" in res.stderr and "supported:" in res.stderr and "fix:" in res.stderr
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)
