"""DeepSeek-V4 in SGLang 0.5.23's launcher with the plugin: planned per layer kind at launch, before
any weight loads, from SGLang's own resolved settings and config object; refused there with the
text ``mla-sm120 check --engine sglang`` prints. SGLang's model hooks run as its launcher runs them
(``handle_model_specific_adjustments``: the dsv4 backend, 256-token pages, the KV dtype)."""

from __future__ import annotations

import json
import logging
import os

import pytest
from support.cli import run_cli
from support.kernel_checks import flashinfer_refusal_here
from sglang.srt.arg_groups.model_hook import handle_model_specific_adjustments
from sglang.srt.arg_groups.overrides import ResolvedView, _declaration_overlay
from sglang.srt.arg_groups.resolution_hooks import run_hook
from support.sglang_launch import server_args

from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401

TINY_V4 = dict(num_hidden_layers=3, hidden_size=256, vocab_size=256, intermediate_size=256, moe_intermediate_size=64,
               n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=64, o_lora_rank=64, index_n_heads=4)


def _model(tmp_path, version="v4", **changes) -> str:
    """A tiny DeepSeek-V4 config.json as the checkpoints ship it (transformers' keys plus the
    per-layer compress_ratios SGLang reads)."""
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"], **TINY_V4)
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("layer_types", None)  # the checkpoints' legacy list decides, in SGLang and here alike
    data["compress_ratios"] = [128, 4, 128, 0]
    if version == "v4.1":
        data.update(model_type="deepseek_v41", architectures=["DeepseekV41ForCausalLM"], compress_ratios=[0, 1, 2, 0])
    data.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


def _launch(model: str, **kw):
    sa = server_args(model, **kw)
    run_hook(handle_model_specific_adjustments, sa)
    return ResolvedView(sa, overlay=_declaration_overlay(sa))


def _expected_kernel() -> str:
    """FlashInfer's DeepSeek-V4 kernels where they run here (an SM12x GPU), else the plugin's Triton
    kernel (Triton's interpreter on this CPU): what SGLang alone would find only at its first forward."""
    return "flashinfer_dsv4_sm120" if flashinfer_refusal_here() is None else "triton_dsv4"


def test_the_launcher_plans_each_layer_kind_and_exports_it(tmp_path, capability, caplog):
    capability(12, 0)
    caplog.set_level(logging.WARNING, logger="mla_sm120_plugin")
    _launch(_model(tmp_path), tp_size=4)
    (line,) = [r.getMessage() for r in caplog.records if "DeepSeek-V4 plan" in r.getMessage()]
    assert "SGLang 0.5.23 tp=4" in line and "sm_120" in line
    kernel = _expected_kernel()
    for kind in ("c128a x2", "c4a x1", "window x1"):
        assert f"{kind}: prefill={kernel} decode={kernel}" in line
    exported = json.loads(os.environ[names.PLAN_ENV])
    assert set(exported) == {"c128a", "c4a", "window"}


def test_sglangs_v41_config_object_is_read_as_v41(tmp_path, capability):
    """SGLang's own config object for V4.1 (renamed to V4's architecture, model_type kept), read by
    the plan. (SGLang's V4.1 model hook itself needs CUDA-graph settings a later pass fills, so only
    its config loading runs here.)"""
    capability(12, 1)
    model = _model(tmp_path, "v4.1")
    sa = server_args(model, tp_size=8)
    view = ResolvedView(sa, overlay=_declaration_overlay(sa))
    from sglang.srt.arg_groups.overrides import model_config_of

    hf_config = model_config_of(view).hf_config
    assert hf_config.architectures == ["DeepseekV4ForCausalLM"]  # SGLang runs V4.1 under V4's name
    planned = translate.plan_from_sglang(view, hf_config, (12, 1))
    from mla_sm120_plugin.families.dsv4 import layer_calls
    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.modelinfo import facts_from_hf_config

    facts = facts_from_hf_config(hf_config, name=model, registry=get_registry())
    assert facts.geometry.version == "v4.1" and facts.geometry.ratios == (0, 1, 2, 0)
    calls = {c.kind: c for c in layer_calls(facts, "sglang", 8)}
    assert set(calls) == {"window", "c1a", "c2a"}
    assert (calls["c1a"].extra_page, calls["c2a"].extra_page, calls["c1a"].window_page) == (256, 128, 64)
    assert (calls["c1a"].decode_heads, calls["c1a"].prefill_heads) == (8, 8)
    assert set(planned.decisions) == set(calls)


@pytest.mark.parametrize("kw, cap, needle", [
    (dict(tp_size=16), (12, 0), "8 output-projection groups"),
    (dict(tp_size=4, kv_cache_dtype="bfloat16"), (12, 0), "uint8 records only"),
    (dict(tp_size=4), (9, 0), "--attention-backend dsv4 (FlashMLA)"),
])
def test_a_refusal_stops_the_launch_with_the_text_check_prints(tmp_path, capability, kw, cap, needle):
    capability(*cap)
    model = _model(tmp_path)
    with pytest.raises(UnsupportedConfiguration) as err:
        _launch(model, **kw)
    assert needle in str(err.value)
    args = ["--tp", str(kw["tp_size"]), "--sm", f"{cap[0]}.{cap[1]}"]
    if "kv_cache_dtype" in kw:
        args += ["--kv-cache-dtype", kw["kv_cache_dtype"]]
    res = run_cli("check", "--engine", "sglang", "--model", model, *args)
    assert res.returncode == 2
    assert res.stderr.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n") == str(err.value)


def test_without_the_opt_in_sglang_launches_alone(tmp_path, capability, monkeypatch, caplog):
    capability(12, 0)
    monkeypatch.delenv("MLA_SM120_SGLANG")
    caplog.set_level(logging.WARNING, logger="mla_sm120_plugin")
    view = _launch(_model(tmp_path), tp_size=16)  # SGLang itself says nothing here
    assert view.attention_backend == "dsv4"
    assert not [r for r in caplog.records if "DeepSeek-V4 plan" in r.getMessage()]


def test_the_hook_is_installed():
    assert dsv4.DEFAULTS in dsv4.HOOKS and hooks.missing(install.engine_targets()) == []
