"""The built-in rules' refusals in the documented words (``rules.py``, README "The main job"):
the device, the KV layout and the model geometry, line for line.

Every test names the promise it pins. Values are the engines' facts (docs/facts.md#engine-rules, the
installed vLLM 0.33 / SGLang 0.5.23), written here as text, never recomputed with the code under test.
"""

from __future__ import annotations

import pytest
from support.decisions import _refusal

from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.families import mla_sm120_validate
from mla_sm120_plugin.types import SelectionContext


# --- refusals in the documented words (README, rules.py) -----------------------------------------


def test_sm90_refusal_is_the_one_the_readme_prints(capsys):
    """README "The main job": the SM90 refusal, line for line (given, the reason, supported, fix)."""
    lines = _refusal(capsys, "--model", "glm-5", "--sm", "9.0")
    assert lines[0].startswith("given: model_arch=GlmMoeDsaForCausalLM, sm=9.0, kv_cache_dtype=fp8_ds_mla, "
                               "heads_per_rank=64 (tp=1), ")
    assert lines[1:] == [
        "  - device sm_90: this plugin serves SM12x only",
        "supported: an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)",
        "fix: on sm_90 serve without this plugin: drop --attention-backend CUSTOM; vLLM's own sparse-MLA backends "
        "serve DSA models there (FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90)",
    ]


@pytest.mark.parametrize("sm, where", [("cpu", "no GPU (CPU)"), ("rocm", "a ROCm GPU")])
def test_a_device_that_is_not_nvidia_is_refused_with_how_to_plan(capsys, sm, where):
    """rules.py: off NVIDIA the refusal says what the device is and how to plan for an SM12x GPU."""
    lines = _refusal(capsys, "--model", "glm-5", "--sm", sm)
    assert f"  - device {where}: this plugin serves NVIDIA SM12x GPUs only" in lines
    assert "supported: an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)" in lines
    assert lines[-1] == ("fix: run on an SM12x GPU, or plan for one with --sm 12.0 (RTX 50xx / RTX PRO 6000) or "
                         "--sm 12.1 (DGX Spark)")


@pytest.mark.parametrize("engine, kv, fix", [
    ("vllm", "fp8", "fix: pass --kv-cache-dtype fp8_ds_mla (the 656-byte DSA layout); plain fp8 is not rewritten for "
                    "a plugin backend (SGLang's fp8_e4m3 is that layout: plan for SGLang with mla-sm120 check "
                    "--engine sglang)"),
    ("vllm", "int8", "fix: pass --kv-cache-dtype fp8_ds_mla (the 656-byte DSA layout), or --kv-cache-dtype auto "
                     "(or bfloat16) for a bf16 cache"),
    ("sglang", "fp8_e5m2", "fix: pass --kv-cache-dtype fp8_e4m3 (the 656-byte DSA layout), or --kv-cache-dtype "
                           "bfloat16 for a bf16 cache"),
])
def test_an_unreadable_kv_cache_dtype_names_the_flag_to_pass(capsys, engine, kv, fix):
    """README: plain fp8 on vLLM "would be the wrong layout: the plugin refuses it and names the flag
    to pass"; every engine's refusal is in its own spellings."""
    lines = _refusal(capsys, "--engine", engine, "--model", "glm-5", "--sm", "12.0", "--kv-cache-dtype", kv)
    assert f"  - kv_cache_dtype {kv}: no kernel reads that layout" in lines
    spelled = "fp8_ds_mla" if engine == "vllm" else "fp8_e4m3"
    assert (f"supported: {spelled} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or bf16") in lines
    assert lines[-1] == fix


def test_kv_dtype_fix_speaks_each_engines_flags():
    """families.dsa.kv_dtype_fix: in the given engine's flags (vLLM adds what its plain fp8 means)."""
    from mla_sm120_plugin.engines import lookup
    from mla_sm120_plugin.families.dsa import kv_dtype_fix

    assert "plain fp8 is not rewritten" in kv_dtype_fix("fp8", lookup("vllm"))
    assert kv_dtype_fix("fp8", lookup("sglang")).startswith("pass --kv-cache-dtype fp8_e4m3")


# --- each rule's refusal, from mla_sm120_validate itself -------------------------------------------------


def _refusals(ctx: SelectionContext) -> list:
    return list(mla_sm120_validate(ctx=ctx, profile=None))


def test_the_geometry_refusal_word_for_word():
    ctx = SelectionContext("X", "fp8_ds_mla", 8, 2048, parse_device("12.0", source="--sm"), kv_lora_rank=256,
                           qk_rope_head_dim=32)
    (refusal,) = _refusals(ctx)
    assert refusal.reason == (
        "model geometry kv_lora_rank=256, qk_rope_head_dim=32: the kernels read caches of a 512-wide fp8/bf16 "
        "latent with a 64-wide rope (q/k 576 wide) or none (q/k 512 wide); this model writes other rows")
    assert refusal.supported == ("kv_lora_rank in [512] or qk_rope_head_dim in [64, 0] "
                                 "(GLM-5, DeepSeek-V3.2, GLM-5.3-Flash)")
    assert refusal.fix == ("serve this model without --attention-backend CUSTOM, or check that the model's "
                           "config.json is its own (a copied config edited by hand?)")


def test_a_layout_of_the_other_rope_width_names_the_layout_the_engine_writes():
    ctx = SelectionContext("X", "fp8_ds_mla", 8, 2048, parse_device("12.1", source="--sm"), qk_rope_head_dim=0,
                           kv_cache_dtype_given="fp8_ds_mla")
    (refusal,) = _refusals(ctx)
    assert refusal.reason == ("kv layout fp8_ds_mla has a 64-wide rope part; the model's qk_rope_head_dim is 0: "
                              "the engine writes fp8_ds_mla_nope rows for it")
    assert refusal.supported == "a layout whose rope width is the model's (fp8_ds_mla_nope)"
    assert refusal.fix == ("let the plugin derive the layout from the engine's --kv-cache-dtype and the model "
                           "(do not name a layout of another geometry)")


def test_nvfp4_for_a_rope_less_model_is_one_refusal_the_missing_writer():
    ctx = SelectionContext("X", "nvfp4_ds_mla", 8, 2048, parse_device("12.0", source="--sm"), qk_rope_head_dim=0,
                           kv_cache_dtype_given="nvfp4_ds_mla")
    reasons = [r.reason for r in _refusals(ctx)]
    assert len(reasons) == 1 and "has no nvfp4 writer" in reasons[0], reasons


def test_off_sm12x_the_device_refusal_says_where_the_engine_reads_nvfp4_itself():
    ctx = SelectionContext("X", "nvfp4_ds_mla", 8, 2048, parse_device("9.0", source="--sm"))
    refusal = _refusals(ctx)[0]
    assert refusal.reason == "device sm_90: this plugin serves SM12x only"
    assert refusal.fix.startswith("on sm_90 serve without this plugin: drop --attention-backend CUSTOM; ")
    assert refusal.fix.endswith(" (vLLM's own FLASHMLA_SPARSE reads nvfp4_ds_mla on SM100 only; elsewhere pass "
                                "--kv-cache-dtype fp8_ds_mla)")
    fp8 = _refusals(SelectionContext("X", "fp8_ds_mla", 8, 2048, parse_device("9.0", source="--sm")))[0]
    assert "FLASHMLA_SPARSE reads nvfp4" not in fp8.fix


def test_sglangs_auto_mismatch_names_the_layout_sglang_writes_on_that_gpu():
    """SGLang's auto is fp8 on SM >= 10: on SM12x a rope-less model's auto is the 528-byte rows."""
    ctx = SelectionContext("X", "fp8_ds_mla", 8, 2048, parse_device("12.0", source="--sm"), qk_rope_head_dim=0,
                           kv_cache_dtype_given="auto", engine="sglang")
    (refusal,) = _refusals(ctx)
    assert refusal.supported == "a layout whose rope width is the model's (fp8_nope)"
