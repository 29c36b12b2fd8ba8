"""GLM-5.3-Flash (rope-less sparse MLA) planned as each engine runs it: its cache rows, the width of
the index rows the kernels get, FlashInfer's glm53_nope family, on a full and a core-only install."""

from __future__ import annotations

import json

import pytest
from support.cli import decision_of, run_cli
from support.model_configs import write_model

from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.dispatch import flashinfer
from mla_sm120_plugin.dispatch.catalog import FLASHINFER
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import DeviceInfo, SelectionContext

ENGINES = {"vllm": ("fp8_ds_mla", "fp8_ds_mla_nope", 2176), "sglang": ("fp8_e4m3", "fp8_nope", 2051)}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sm", ["12.0", "12.1"])
def test_flashinfer_serves_both_phases_at_tp8(engine, sm):
    spelling, layout_name, width = ENGINES[engine]
    res = run_cli("check", "--engine", engine, "--model", "glm-5.3-flash", "--sm", sm, "--tp", "8",
                  "--kv-cache-dtype", spelling, "--json")
    assert res.returncode == 0, res.stderr
    plan = decision_of(json.loads(res.stdout))
    assert plan["kernels"] == {"prefill": FLASHINFER, "decode": FLASHINFER}
    assert (plan["kv_cache_dtype"], plan["index_topk"], plan["heads_per_rank"]) == (layout_name, width, 8)
    assert plan["profile"] == "glm-5.3-flash" and plan["scale_format"] == "arbitrary"


@pytest.mark.parametrize("engine, spelling, layout_name", [("vllm", "auto", "bf16_nope"),
                                                          ("vllm", "bfloat16", "bf16_nope"),
                                                          ("sglang", "bfloat16", "bf16_nope"),
                                                          ("sglang", "auto", "fp8_nope")])
def test_the_cache_flag_gives_the_rope_less_rows(engine, spelling, layout_name):
    res = run_cli("check", "--engine", engine, "--model", "glm-5.3-flash", "--sm", "12.0", "--tp", "8",
                  "--kv-cache-dtype", spelling, "--json", "--enforce-eager")
    plan = json.loads(res.stdout)
    assert plan["kv_cache"]["name"] == layout_name, plan


def test_a_model_directory_is_planned_from_its_own_config(tmp_path):
    model = write_model(tmp_path, "glm53", heads=64)
    res = run_cli("check", "--model", model, "--sm", "12.1", "--tp", "8", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert (plan["model_arch"], plan["kv_cache"]["name"], decision_of(plan)["index_topk"]) == (
        "Glm5NextForCausalLM", "fp8_ds_mla_nope", 2176)


def test_a_dsa_layout_for_a_rope_less_model_is_refused():
    ctx = SelectionContext("Glm5NextForConditionalGeneration", "fp8_ds_mla", 8, 2176,
                           DeviceInfo("nvidia", 12, 0, source="--sm"), qk_rope_head_dim=0,
                           kv_cache_dtype_given="fp8_ds_mla")
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx)
    message = str(err.value)
    assert "kv layout fp8_ds_mla has a 64-wide rope part" in message and "fp8_ds_mla_nope" in message


@pytest.mark.parametrize("layout_name", ["fp8_ds_mla_nope", "fp8_nope"])
@pytest.mark.parametrize("scale_format", ["pow2", "arbitrary"])
def test_flashinfer_reads_the_rope_less_rows_as_glm53_nope(layout_name, scale_format):
    """Its only NoPE format reads the fp32 scales as values: pow2-written caches too (vLLM's writer)."""
    assert flashinfer.native_format(scale_format, layout_name) == flashinfer.NOPE_FORMAT
    assert flashinfer.NOPE_FORMAT.kv_scale_format == "arbitrary_fp32"
    # SGLang's 2051 ids over 64 tokens: the binding pads the rows to whole 64-entry tiles.
    assert flashinfer.envelope_reasons(phase="prefill", num_heads=8, topk=2051, max_tokens=4096,
                                       kv_layout=layout_name, scale_format=scale_format) == ()
    reasons = flashinfer.envelope_reasons(phase="prefill", num_heads=4, topk=2176, max_tokens=4096,
                                          kv_layout=layout_name, scale_format=scale_format)
    assert any("num_heads=4" in r for r in reasons)
