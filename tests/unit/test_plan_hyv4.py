"""HY V4 (Hy4-preview): DSA with a learned sink logit per head, planned for both engines (issue 34).

A config.json with the geometry of Tencent's release (HYV4ForCausalLM, model_type hy_v4: 64 heads, the
512 + 64 latent, index top-k 2048, learnable_sink, gated_mla, one MTP layer; the values
tests/fixtures/public_model_configs.json records, not HYV4Config's placeholder defaults) is planned by
``mla-sm120 check`` on SM120 / SM121 at TP 1-8 in vLLM and SGLang; SM90 is refused naming the
engine's own sink path. The sinks travel as a fact (config -> facts -> context -> decision note ->
self-check case) and a kernel that cannot apply them is no candidate.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.cli import assert_three_parts, decision_of

from mla_sm120_plugin import cli, families
from mla_sm120_plugin.dispatch import catalog, selfcheck, selfcheck_dsa
from mla_sm120_plugin.dispatch.binding import bind
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.kernels.accuracy import measure
from mla_sm120_plugin.modelinfo import facts_from_hf_config
from mla_sm120_plugin.selection import envelope_reasons

HY4_PREVIEW = {
    "architectures": ["HYV4ForCausalLM"], "model_type": "hy_v4", "num_attention_heads": 64,
    "num_key_value_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
    "v_head_dim": 256, "q_lora_rank": 2048, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "learnable_sink": True, "gated_mla": True, "gating_type": "elementwise", "num_nextn_predict_layers": 1,
    "num_hidden_layers": 78, "hidden_size": 6144, "max_position_embeddings": 1048576,
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HY4_PREVIEW))
    return str(tmp_path)


def _check(capsys, *argv: str) -> tuple[int, dict]:
    rc = cli.main(["check", *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else {"stderr": out.err})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_check_plans_sm12x_at_every_tp_and_says_the_sink_is_applied(model_dir, capsys, engine):
    for sm in ("12.0", "12.1"):
        for tp in ("1", "2", "4", "8"):
            rc, report = _check(capsys, "--engine", engine, "--model", model_dir, "--sm", sm, "--tp", tp)
            assert rc == 0, report
            report = decision_of(report)
            kernels = report["kernels"]
            assert set(kernels) == {"decode", "prefill"}
            sink_note = [n for n in report["notes"] if n.startswith("sinks: ")]
            assert len(sink_note) == 1
            assert f"applied by {kernels['decode']} (decode) and {kernels['prefill']} (prefill)" in sink_note[0]
            assert report["heads_per_rank"] == HY4_PREVIEW["num_attention_heads"] // int(tp)
            # SGLang forces a bfloat16 cache for learnable sinks; vLLM's CUSTOM backend takes fp8_ds_mla
            assert report["kv_cache_dtype"] == ("bf16" if engine == "sglang" else "fp8_ds_mla")


@pytest.mark.parametrize("engine, own_path", [("vllm", "FLASHMLA_SPARSE sink backend"),
                                              ("sglang", "flashmla_sparse")])
def test_sm90_is_refused_naming_the_engines_own_sink_path(model_dir, capsys, engine, own_path):
    rc = cli.main(["check", "--engine", engine, "--model", model_dir, "--sm", "9.0", "--tp", "4"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_UNSERVABLE
    fix = [line for line in err.splitlines() if line.startswith("fix: ")]
    assert fix and own_path in fix[0], err


def test_sglang_refuses_an_fp8_cache_for_a_sink_model_as_sglang_does(model_dir, capsys):
    rc = cli.main(["check", "--engine", "sglang", "--model", model_dir, "--sm", "12.0", "--kv-cache-dtype",
                   "fp8_e4m3"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_UNSERVABLE
    assert "learned attention sinks" in err and "bfloat16" in err.split("fix: ")[1], err


@pytest.mark.parametrize("key, value, accepted", [("learnable_sink", "yes", "true or false"),
                                                  ("gated_mla", 1, "true or false"),
                                                  ("num_nextn_predict_layers", -1, "an integer from 0")])
def test_the_config_reader_checks_the_sink_keys(key, value, accepted):
    with pytest.raises(ConfigError) as err:
        facts_from_hf_config({**HY4_PREVIEW, key: value}, name="hy", registry=get_registry())
    assert_three_parts(str(err.value))
    assert key in str(err.value) and accepted in str(err.value)


def test_the_sink_is_a_fact_of_the_config_and_of_the_profile():
    registry = get_registry()
    assert facts_from_hf_config(HY4_PREVIEW, name="hy", registry=registry).sinks is True
    without_key = {k: v for k, v in HY4_PREVIEW.items() if k != "learnable_sink"}
    assert facts_from_hf_config(without_key, name="hy", registry=registry).sinks is True  # the profile's
    assert facts_from_hf_config({**HY4_PREVIEW, "learnable_sink": False}, name="hy", registry=registry).sinks is False
    glm = {**HY4_PREVIEW, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
    del glm["learnable_sink"]
    assert facts_from_hf_config(glm, name="glm", registry=registry).sinks is False


def _decision(model_dir, engine="vllm"):
    from mla_sm120_plugin.plan import check_kv_cache_dtype, plan
    from mla_sm120_plugin import config as config_mod
    from mla_sm120_plugin.context import EngineLimits
    from mla_sm120_plugin.modelinfo import resolve_model
    from mla_sm120_plugin.types import DeviceInfo

    facts = resolve_model(model_dir, registry=get_registry())
    device = DeviceInfo(vendor="nvidia", sm_major=12, sm_minor=0, name="planned", source="--sm")
    limits = EngineLimits(tensor_parallel_size=4, engine=engine)
    planned = plan(facts, config_mod.Settings(), device, check_kv_cache_dtype(facts, limits.facts, None), limits)
    return next(iter(planned.decisions.values()))


def test_a_kernel_that_applies_no_sink_is_no_candidate(model_dir):
    decision = _decision(model_dir)
    ctx = decision.context
    assert ctx.sinks
    for spec in get_registry().kernels.values():
        if families.of_kernel(spec).name == "dsa":
            assert spec.sinks  # every built-in DSA kernel applies one
            sinkless = dataclasses.replace(spec, sinks=False)
            assert any("applies no attention sink" in r for r in envelope_reasons(sinkless, ctx, "decode", None))
            assert not any("sink" in r for r in envelope_reasons(spec, ctx, "decode", None))


def test_the_self_check_case_carries_the_sinks_and_fails_a_kernel_that_drops_them(model_dir):
    """The init self-check of a sink model runs its case with sinks (finite near the LSE, -inf, +30);
    the torch kernel called as bound passes it, and the same kernel called without the sink fails it."""
    decision = _decision(model_dir)
    (fields,) = [k for k in selfcheck_dsa.keys(decision, "decode", catalog.TORCH, q_dtype="bf16", device="cpu")
                 if k["written_format"] == decision.scale_format]
    key = selfcheck.CheckKey(**{**fields, "topk": 128})
    assert key.sinks
    inputs = selfcheck_dsa.build(key, torch.device("cpu"))
    assert inputs["sink"] is not None and torch.isinf(inputs["sink"]).any()
    kernel = bind(catalog.TORCH)
    want = selfcheck_dsa.truth(key, inputs)
    bound = catalog.TORCH_SPEC.accuracy
    assert not bound.violations(measure(selfcheck_dsa.run(kernel, key, inputs), want))
    dropped = selfcheck_dsa.run(kernel, key, {**inputs, "sink": None})
    assert bound.violations(measure(dropped, want))
