"""The decision as ``mla-sm120 check`` prints it (``report.py``: ``explain``, ``to_dict``), as
README "The main job" documents it: the model, the bounds, each phase's kernel and every rejection.

Every test names the promise it pins.
"""

from __future__ import annotations

import json

from support.cli import decision_of
from support.decisions import _edge_ctx, _edge_registry

from mla_sm120_plugin import cli
from mla_sm120_plugin.dispatch.catalog import FLASHINFER

GLM_ARCH = "GlmMoeDsaForCausalLM"


# --- the decision as check prints it (report.explain, decision_to_dict, the refusal's parts) ---------


def test_check_prints_the_model_the_bounds_and_each_rejection(capsys):
    """README "The main job": check prints "a table of kernels": the model as the user named it (and
    its profile), the call bounds, CUDA graphs, then each phase's kernel and every rejection."""
    assert cli.main(["check", "--model", "zai-org/GLM-5-FP8", "--sm", "12.1", "--tp", "16",
                     "--max-decode-tokens", "64", "--max-prefill-tokens", "4096", "--enforce-eager"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model      zai-org/GLM-5-FP8 (GlmMoeDsaForCausalLM, profile glm-5)"
    assert "shape      4 heads per rank (tensor parallel 16), index_topk 2048" in lines
    assert "calls      decode <= 64 tokens, prefill <= 4096 tokens; CUDA graphs off" in lines
    header = lines.index("phase    kernel                   status")
    assert lines[header - 1] == ""
    assert lines[header + 1].startswith("prefill  ") and " SELECTED (exact class: cos_diff <= 5e-06, " in lines[header + 1]
    assert any(line.startswith(" " * 9 + "flashinfer_sparse_mla    rejected: ") for line in lines[header:])
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0"]) == 0
    assert "calls      decode of any length, prefill of any length; CUDA graphs on" in capsys.readouterr().out


def test_a_rejection_with_several_reasons_lists_them_on_one_line():
    """selection.explain: "each rejection" on its own line, its reasons joined by "; "."""
    from mla_sm120_plugin.report import explain
    from mla_sm120_plugin.selection import select

    d = select(_edge_ctx(heads=4, topk=2048), registry=_edge_registry(heads=(8, 32), topk_min=4096))
    lines = explain(d).splitlines()
    assert " " * 9 + f"{'edge':<24} rejected: heads per rank 4 outside [8, 32]; index_topk 2048 < 4096" in lines
    assert "\n".join(lines) == explain(d) and not any("XX" in line for line in lines)


def test_check_json_reports_the_decision(capsys):
    """README: ``check --json``: machine-readable: the model, device, cache, shape and each kernel."""
    assert cli.main(["check", "--model", "zai-org/GLM-5-FP8", "--sm", "12.1", "--tp", "8", "--json",
                     "--kv-cache-dtype", "bf16"]) == 0
    top = json.loads(capsys.readouterr().out)
    assert (top["servable"], top["family"], top["engine"], top["kv_cache"]) == (
        True, "dsa", "vllm", {"name": "bf16", "token_bytes": 1152})
    report = decision_of(top)  # a DSA model: one layer kind
    assert report["servable"] is True
    assert (report["model_arch"], report["model_name"], report["profile"]) == (GLM_ARCH, "zai-org/GLM-5-FP8", "glm-5")
    assert report["device"] == {"sm": "12.1", "vendor": "nvidia", "name": report["device"]["name"], "source": "--sm"}
    assert (report["kv_cache_dtype"], report["scale_format"]) == ("bf16", "arbitrary")
    assert (report["tensor_parallel_size"], report["heads_per_rank"], report["index_topk"]) == (8, 8, 2048)
    assert set(report["kernels"]) == {"prefill", "decode"} and FLASHINFER not in report["kernels"].values()
    fi = [r for r in report["rejected"] if r["kernel"] == FLASHINFER]
    assert {r["phase"] for r in fi} == {"prefill", "decode"}
    assert all(r["reasons"][0].startswith("reads kv_cache_dtype ['fp8_ds_mla'") and r["reasons"][0].endswith("], not bf16")
               for r in fi)
    assert isinstance(report["notes"], list)


def test_check_json_has_one_schema_for_every_family(capsys):
    """README "The main job": one ``check --json`` schema for every model: the same top-level keys for
    a DSA model (one layer kind, ``dsa``) and DeepSeek-V4 (a kind per layer type), each kind with its
    call, kernels, classes and decision, and the capacity saying what it counts."""
    reports = {}
    for model in ("glm-5", "deepseek-v4-flash"):
        assert cli.main(["check", "--model", model, "--sm", "12.0", "--tp", "4", "--json"]) == 0
        reports[model] = json.loads(capsys.readouterr().out)
    glm, v4 = reports["glm-5"], reports["deepseek-v4-flash"]
    assert list(glm) == list(v4) == ["servable", "family", "model_arch", "model_name", "engine", "engine_release",
                                     "device", "tensor_parallel_size", "decode_context_parallel_size", "kv_cache",
                                     "capacity", "layer_kinds",
                                     "details", "notes"]
    assert (glm["family"], sorted(glm["layer_kinds"])) == ("dsa", ["dsa"])
    assert (v4["family"], sorted(v4["layer_kinds"])) == ("dsv4", ["c128a", "c4a", "window"])
    for report in reports.values():
        assert set(report["capacity"]) == {"scope", "layouts", "ratio_vs"}
        assert set(report["kv_cache"]) == {"name", "token_bytes"}
        for kind in report["layer_kinds"].values():
            assert set(kind) == {"call", "kernels", "classes", "decision"}
            assert set(kind["kernels"]) == {"prefill", "decode"} == set(kind["decision"]["kernels"])
