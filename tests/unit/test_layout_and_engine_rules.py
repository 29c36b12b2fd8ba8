"""Rules the mutation run (README: Mutation testing) showed no unit test pinned: each engine's index
row width and cache writers, the rope-less layout a cache flag gives, a layout's own consistency
check, the context's precision, and the exact words of the geometry and device refusals.

Values are the engines' facts (docs/facts.md#engine-rules, the installed vLLM 0.33 / SGLang 0.5.23), written here as
numbers, never recomputed with the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest

from mla_sm120_plugin.config import Settings
from mla_sm120_plugin.context import EngineLimits, build_context
from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.engines import ENGINES
from mla_sm120_plugin.rules import mla_sm120_validate
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.modelinfo import ModelFacts
from mla_sm120_plugin.types import SelectionContext

VLLM, SGLANG = ENGINES["vllm"], ENGINES["sglang"]


@pytest.mark.parametrize("engine, kpool, width", [
    (VLLM, 1, 2048), (VLLM, 2, 2048 + 128), (VLLM, 4, 2176), (VLLM, 16, 2176), (VLLM, 64, 2176),
    (VLLM, 130, 2176 + 128),
    (SGLANG, 1, 2048), (SGLANG, 2, 2049), (SGLANG, 4, 2051), (SGLANG, 16, 2063),
])
def test_a_pooled_indexer_hands_the_kernels_its_engines_row_width(engine, kpool, width):
    """vLLM: round_up(top-k + kpool - 1, 128) (2176 for GLM-5.3-Flash); SGLang: top-k + kpool - 1
    (2051); no pooling: top-k."""
    assert engine.index_width(2048, kpool) == width
    assert engine.index_width(37, 1) == 37


def test_which_engine_writes_nvfp4_rows():
    assert VLLM.writer_missing(layout.NVFP4_DS_MLA, 64) is None
    assert "rope-less" in VLLM.writer_missing(layout.NVFP4_DS_MLA, 0)
    assert "no nvfp4_ds_mla cache writer" in SGLANG.writer_missing(layout.NVFP4_DS_MLA, 64)
    assert "no nvfp4_ds_mla cache writer" in SGLANG.writer_missing(layout.NVFP4_DS_MLA, 0)
    for engine in (VLLM, SGLANG):
        for rope in (64, 0, 1):
            assert engine.writer_missing(layout.FP8_DS_MLA, rope) is None
    assert VLLM.writer_missing(layout.NVFP4_DS_MLA, 1) is None  # only a rope of 0 is rope-less


def test_a_rope_less_model_gets_the_engines_nope_rows_and_other_layouts_stay():
    assert VLLM.kv_layout("fp8_ds_mla", 12, 0) == layout.FP8_DS_MLA_NOPE
    assert SGLANG.kv_layout("fp8_e4m3", 12, 0) == layout.FP8_NOPE
    assert VLLM.kv_layout("fp8_ds_mla", 12, 64) == layout.FP8_DS_MLA
    # A layout without a rope-less twin is handed on as it is (the policy then refuses it by name).
    assert VLLM.kv_layout("nvfp4_ds_mla", 12, 0) == layout.NVFP4_DS_MLA


def test_a_layout_checks_its_own_bytes_when_built():
    dsa = layout.LAYOUTS[layout.FP8_DS_MLA]
    assert dsa.row == dsa.used == 656  # a row may be exactly its used bytes
    assert dataclasses.replace(dsa, name="nope-copy", rope=0).rope == 0  # rope 0 is a layout
    nvfp4 = layout.LAYOUTS[layout.NVFP4_DS_MLA]
    assert dataclasses.replace(nvfp4, name="nvfp4-copy").used == 352
    for bad, words in [(dict(latent=500), "latent 500"), (dict(rope=-1), "rope -1"), (dict(row=655), "row 655")]:
        with pytest.raises(ValueError, match=f"CacheLayout 'bad': .*{words}.*656 elements used|"
                                             f"CacheLayout 'bad': .*{words}"):
            dataclasses.replace(dsa, name="bad", **bad)
    with pytest.raises(ValueError, match="latent 520"):  # a multiple of nvfp4's 16-value block, not of 128
        dataclasses.replace(nvfp4, name="bad", latent=520)


def test_an_unknown_layout_name_lists_the_known_ones():
    with pytest.raises(KeyError) as err:
        layout.get("fp8_e5m2")
    assert "kv_layout 'fp8_e5m2': known layouts are ['fp8_ds_mla'" in str(err.value)


def test_the_context_carries_the_configured_precision():
    facts = ModelFacts(arch="GlmMoeDsaForCausalLM", name="glm", num_heads=64, index_topk=2048)
    device = parse_device("12.0", source="--sm")
    for precision in ("exact", "fast"):
        ctx = build_context(facts, Settings(precision=precision), device, "fp8_ds_mla", EngineLimits())
        assert ctx.precision == precision


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


def test_a_bf16_or_nvfp4_layout_is_checked_by_its_own_block():
    bf16 = layout.LAYOUTS[layout.BF16]
    assert dataclasses.replace(bf16, name="bf16-copy").used == 576  # no scales: no block to divide by
    with pytest.raises(ValueError, match="latent 144"):  # a whole number of 16-value blocks, not of 128 tiles
        dataclasses.replace(layout.LAYOUTS[layout.NVFP4_DS_MLA], name="bad", latent=144)


def test_sglangs_auto_mismatch_names_the_layout_sglang_writes_on_that_gpu():
    """SGLang's auto is fp8 on SM >= 10: on SM12x a rope-less model's auto is the 528-byte rows."""
    ctx = SelectionContext("X", "fp8_ds_mla", 8, 2048, parse_device("12.0", source="--sm"), qk_rope_head_dim=0,
                           kv_cache_dtype_given="auto", engine="sglang")
    (refusal,) = _refusals(ctx)
    assert refusal.supported == "a layout whose rope width is the model's (fp8_nope)"


def test_the_inline_config_is_read_once_whatever_its_key_order(monkeypatch):
    from mla_sm120_plugin import config as config_mod
    from mla_sm120_plugin import context

    context.clear_config_cache()
    reads = []
    original = config_mod.load_config
    monkeypatch.setattr(config_mod, "load_config", lambda *a, **k: reads.append(1) or original(*a, **k))
    first = {"precision": "exact", "kv_scale_format": "pow2"}
    second = {"kv_scale_format": "pow2", "precision": "exact"}
    a = context.plugin_config(first, kernel_names=("triton_sparse_mla",))
    b = context.plugin_config(second, kernel_names=("triton_sparse_mla",))
    assert a is b and len(reads) == 1
    context.clear_config_cache()


def test_an_inline_value_json_cannot_hold_is_the_configs_error_not_a_crash():
    from mla_sm120_plugin import context
    from mla_sm120_plugin.errors import ConfigError

    context.clear_config_cache()
    with pytest.raises(ConfigError):
        context.plugin_config({"precision": object()}, kernel_names=("triton_sparse_mla",))
    context.clear_config_cache()
