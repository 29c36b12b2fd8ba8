"""Each engine's words and rows (``engines.py``; README "Use with vLLM" / "Use with SGLang"): what
its ``--kv-cache-dtype`` means, the index row width it hands the kernels, and which cache rows it
writes.

Every test names the promise it pins. Values are the engines' facts (docs/facts.md#engine-rules, the
installed vLLM 0.33 / SGLang 0.5.23), written here as values, never recomputed with the code under test.
"""

from __future__ import annotations

import pytest

from mla_sm120_plugin.engines import ENGINES
from mla_sm120_plugin.kernels.dsa import layout


# --- how each engine's --kv-cache-dtype reads (engines.py, README) --------------------------------------


@pytest.mark.parametrize("engine, given, sm_family, layout", [
    ("vllm", None, 12, "bf16"), ("vllm", "auto", 12, "bf16"),  # README: auto/bfloat16 is a bf16 cache on vLLM
    ("vllm", "bfloat16", 12, "bf16"), ("vllm", "bf16", 12, "bf16"), ("vllm", "fp8_ds_mla", 12, "fp8_ds_mla"),
    ("vllm", "fp8", 12, "fp8"), ("vllm", "fp8_e4m3", 12, "fp8_e4m3"),  # not rewritten for CUSTOM: refused later
    ("sglang", "auto", 12, "fp8_ds_mla"), ("sglang", "auto", 10, "fp8_ds_mla"),  # SGLang: auto is fp8 on SM >= 10
    ("sglang", "auto", 9, "bf16"), ("sglang", None, None, "bf16"), ("sglang", "fp8_e4m3", 12, "fp8_ds_mla"),
    ("sglang", "bfloat16", 12, "bf16"), ("sglang", "bf16", 9, "bf16"), ("sglang", "fp8_e5m2", 12, "fp8_e5m2"),
])
def test_each_engines_kv_cache_dtype_spelling_means_one_layout(engine, given, sm_family, layout):
    """README "Use with vLLM" / "Use with SGLang": what each engine's --kv-cache-dtype means for a DSA
    model (fp8_e4m3 is SGLang's name for the 656-byte layout; SGLang turns auto into it on SM >= 10)."""
    from mla_sm120_plugin.context import kv_layout

    assert kv_layout(given, engine, sm_family) == layout


def test_kv_layout_reads_vllms_spelling_by_default_and_engines_name_their_layouts():
    """context.kv_layout: the engine is vLLM unless named; Engine.spelling: each engine's own word."""
    from mla_sm120_plugin.context import kv_layout
    from mla_sm120_plugin.engines import SGLANG, VLLM

    assert kv_layout("auto", sm_family=12) == "bf16" and kv_layout("fp8_e4m3") == "fp8_e4m3"
    assert (VLLM.spelling("fp8_ds_mla"), SGLANG.spelling("fp8_ds_mla"), SGLANG.spelling("bf16")) == \
        ("fp8_ds_mla", "fp8_e4m3", "bf16")
    assert SGLANG.spelling("a-layout-it-has-no-word-for") == "a-layout-it-has-no-word-for"


# --- index row widths and cache writers (docs/facts.md#engine-rules) -------------------------------------

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
