"""The ``precision`` setting: ``fast`` lets fp8 q/p kernels serve (FlashInfer, triton_sparse_mla_fast),
``exact`` keeps to bf16/fp32 operands; ``check`` and the decision line name it; each kernel states
its own tolerance, and the self-check holds it to that."""

from __future__ import annotations

import json

import pytest
from helpers import assert_three_parts, run_cli

from mla_sm120_plugin.errors import PluginError, UnsupportedConfiguration
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TRITON, TRITON_FAST, TRITON_FAST_SPEC
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
    assert "precision=fast" in decision.log_line()


def test_exact_keeps_to_kernels_with_bf16_operands():
    decision = _decide(precision="exact")
    assert (decision.prefill, decision.decode) == (TRITON, TRITON)
    reasons = {r.kernel: r.reasons for r in decision.rejections if r.phase == "prefill"}
    for fast in (FLASHINFER, TRITON_FAST):
        assert any("precision=exact" in reason for reason in reasons[fast]), reasons[fast]
    assert "precision=exact" in decision.log_line()


def test_a_forced_fast_kernel_under_exact_is_refused_naming_the_setting():
    with pytest.raises(UnsupportedConfiguration) as err:
        _decide(precision="exact", decode_kernel=TRITON_FAST, heads=8)
    message = str(err.value)
    assert_three_parts(message)
    assert "computes with fp8 q and probabilities" in message and 'precision = "fast"' in message.split("fix:")[1]


def test_the_toml_switches_the_kernel(tmp_path):
    toml = tmp_path / "mla_sm120.toml"
    toml.write_text('[architectures.GlmMoeDsaForCausalLM]\nprecision = "exact"\n')
    fast = json.loads(run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--json").stdout)
    exact = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--json", "--config", str(toml))
    assert exact.returncode == 0, exact.stderr
    exact = json.loads(exact.stdout)
    assert (fast["precision"], fast["kernels"]["prefill"]) == ("fast", TRITON_FAST)
    assert (exact["precision"], exact["kernels"]["prefill"]) == ("exact", TRITON)
    table = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--precision", "exact").stdout
    assert "precision  exact" in table and f"prefill  {TRITON} " in table


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


def test_the_fast_kernels_declared_tolerance_is_the_kernels_own():
    from mla_sm120_plugin.kernels.dsa import triton_fast

    assert TRITON_FAST_SPEC.tolerance == triton_fast.TOLERANCE
    assert TRITON_FAST_SPEC.precision == "fast" and TRITON_FAST_SPEC.priority < 300  # below FlashInfer's


def test_bench_traffic_prints_the_model_and_the_tables():
    from mla_sm120_plugin.kernels.dsa import triton_plan

    for family in triton_plan.FAMILIES:
        res = run_cli("bench", "--traffic", family)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"family {family}")
        assert all(f"{kernel} on {family}: splits" in res.stdout for kernel in triton_plan.KERNELS)
