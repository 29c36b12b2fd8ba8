"""The ``precision`` setting: ``fast`` lets single-fp8 q/p kernels serve (FlashInfer's), ``exact``
keeps to exact-class kernels (cos_diff <= 5e-6, relRMS <= 0.3 % against float64: the Triton kernels,
the fast one with its e4m3 hi + lo pairs included); ``check`` and the decision line name it and each
chosen kernel's class; each kernel states its own bounds, and the self-check holds it to them."""

from __future__ import annotations

import json

import pytest
from support.cli import assert_three_parts, decision_of, run_cli

from mla_sm120_plugin.errors import PluginError, UnsupportedConfiguration
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TRITON, TRITON_FAST, TRITON_FAST_SPEC
from mla_sm120_plugin.report import decision_line
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import DeviceInfo, KernelSpec, SelectionContext

GLM = "GlmMoeDsaForCausalLM"
SM120 = DeviceInfo("nvidia", 12, 0, source="--sm")


def _decide(**kw):
    return select(SelectionContext(GLM, "fp8_ds_mla", kw.pop("heads", 4), 2048, SM120, **kw))


def test_fast_is_the_default_and_serves_what_flashinfer_cannot():
    decision = _decide()  # 4 heads per GPU: FlashInfer has no prefill kernel for it
    assert decision.context.precision == "fast"
    assert decision.prefill == TRITON_FAST and decision.decode in (FLASHINFER, TRITON_FAST)
    assert "precision=fast" in decision_line(decision)


def test_exact_keeps_to_exact_class_kernels():
    decision = _decide(precision="exact", heads=8, max_decode_tokens=64)  # FlashInfer serves this decode
    assert (decision.prefill, decision.decode) == (TRITON_FAST, TRITON_FAST)
    reasons = {r.kernel: r.reasons for r in decision.rejections if r.phase == "decode"}
    assert any("precision=exact" in reason and "single fp8 q" in reason for reason in reasons[FLASHINFER])
    assert not any("precision=exact" in reason for reason in reasons[TRITON])
    line = decision_line(decision)
    assert "precision=exact" in line and "(accuracy class: prefill exact, decode exact)" in line
    fast = _decide(heads=8, max_decode_tokens=64)
    assert (fast.prefill, fast.decode) == (FLASHINFER, FLASHINFER)
    assert "(accuracy class: prefill fast, decode fast)" in decision_line(fast)


def test_every_exact_kernel_states_an_exact_class_bound():
    from mla_sm120_plugin.hooks.manager import get_registry

    for spec in get_registry().kernels.values():
        assert spec.accuracy is not None, spec.name
        assert spec.accuracy.exact_class == (spec.precision == "exact"), spec.name


def test_a_kernel_cannot_claim_exact_with_a_fast_bound():
    from mla_sm120_plugin.kernels.accuracy import AccuracyBound

    loose = AccuracyBound(cos_diff=1e-3, rel_rms=0.05, max_rel=0.15)
    with pytest.raises(PluginError) as err:
        KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"bf16"}, vendors={"cpu"}, priority=1, entry="m:f",
                   precision="exact", accuracy=loose)
    assert_three_parts(str(err.value))
    assert "relRMS <= 5.00%" in str(err.value) and "precision='fast'" in str(err.value)
    KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"bf16"}, vendors={"cpu"}, priority=1, entry="m:f",
               precision="fast", accuracy=loose)


def test_a_forced_fast_kernel_under_exact_is_refused_naming_the_setting():
    with pytest.raises(UnsupportedConfiguration) as err:
        _decide(precision="exact", decode_kernel=FLASHINFER, heads=8, max_decode_tokens=64)
    message = str(err.value)
    assert_three_parts(message)
    assert "computes with a single fp8 q and probability" in message
    assert 'precision = "fast"' in message.split("fix:")[1]


def test_the_toml_switches_the_kernel(tmp_path):
    toml = tmp_path / "mla_sm120.toml"
    toml.write_text('[architectures.GlmMoeDsaForCausalLM]\nprecision = "exact"\n')
    fast = decision_of(json.loads(run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--json").stdout))
    exact = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--json", "--config", str(toml))
    assert exact.returncode == 0, exact.stderr
    exact = decision_of(json.loads(exact.stdout))
    assert (fast["precision"], fast["kernels"]["prefill"]) == ("fast", TRITON_FAST)
    assert (exact["precision"], exact["kernels"]["prefill"]) == ("exact", TRITON_FAST)
    # Where FlashInfer would serve decode, exact keeps to the Triton kernel.
    bounded = ["check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--max-decode-tokens", "64", "--json"]
    assert decision_of(json.loads(run_cli(*bounded).stdout))["kernels"]["decode"] == FLASHINFER
    exact = decision_of(json.loads(run_cli(*bounded, "--config", str(toml)).stdout))
    assert exact["kernels"]["decode"] == TRITON_FAST
    table = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--precision", "exact").stdout
    assert "precision  exact (exact-class kernels only" in table
    assert f"prefill  {TRITON_FAST:<24} SELECTED (exact class" in table


def test_a_bad_precision_is_a_config_error(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('precision = "fp4"\n')
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--config", str(toml))
    assert res.returncode == 2 and "precision='fp4'" in res.stderr and "['fast', 'exact']" in res.stderr


@pytest.mark.parametrize("precision", ["fp8", "", None])
def test_a_kernel_must_state_its_precision(precision):
    with pytest.raises(PluginError, match="precision="):
        KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"bf16"}, vendors={"cpu"}, priority=1, entry="m:f",
                   precision=precision)


def test_the_fast_kernels_declared_bound_is_the_kernels_own():
    from mla_sm120_plugin.kernels.dsa import triton_fast

    assert TRITON_FAST_SPEC.tolerance == triton_fast.TOLERANCE
    assert TRITON_FAST_SPEC.accuracy == triton_fast.ACCURACY and triton_fast.ACCURACY.exact_class
    assert TRITON_FAST_SPEC.precision == "exact" and TRITON_FAST_SPEC.priority < 300  # below FlashInfer's


def test_bench_traffic_prints_the_model_and_the_tables():
    from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

    for family in dsa_plan.FAMILIES:
        res = run_cli("bench", "--traffic", family)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"family {family}")
        assert all(f"{kernel} on {family}: splits" in res.stdout for kernel in dsa_plan.KERNELS)


def test_bench_traffic_json_is_json_with_the_same_numbers():
    from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

    res = run_cli("bench", "--traffic", "sm120", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["family"] == "sm120" and report["ctas_per_sm"][TRITON_FAST] == dsa_plan.FAST.ctas_per_sm["sm120"]
    assert len(report["plans"]) == len(dsa_plan.KERNELS) * len(dsa_plan.MUST_SHOW)
    first = report["plans"][0]
    assert first == json.loads(json.dumps(dsa_plan.plan_report(first["kernel"], first["num_tokens"],
                                                                  first["num_heads"], first["topk"], "sm120")))
    text = run_cli("bench", "--traffic", "sm120").stdout
    for row in report["tables"][TRITON_FAST]:
        assert f"{row['splits']} ({row['chunk']})" in text
