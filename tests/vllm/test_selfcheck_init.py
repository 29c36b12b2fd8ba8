"""The self-check inside vLLM's real impl construction on the CPU (before any weight would load).

A third-party kernel that ignores the fp8 scales is forced for decode: the impl falls back to the
next kernel the decision allows and logs why; with MLA_SM120_SELF_CHECK=strict it refuses.
"""

from __future__ import annotations

import pytest
from support.cli import assert_three_parts
from support.model_configs import write_model
from support.vllm_engine import make_impl, make_vllm_config, vllm_log

from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.hooks.manager import reset_registry
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON_FAST
from mla_sm120_plugin.types import DECODE, PREFILL

pytestmark = pytest.mark.self_check  # the init self-check is what this file is about (tests/conftest.py)

HEADS, TOPK = 5, 100
WRONG = "noscale_sparse_mla"


@pytest.fixture
def forced_wrong_decode(tmp_path, monkeypatch, noscale_plugin_path):
    import vllm.model_executor.layers.attention.sparse_mla_attention as sma

    monkeypatch.setattr(sma, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.syspath_prepend(str(noscale_plugin_path))
    reset_registry()
    model = write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS)
    return make_vllm_config(model, enforce_eager=True,
                            additional_config={"mla_sm120": {"decode_kernel": WRONG, "prefill_kernel": TORCH}})


def _build(vc):
    return make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype="fp8_ds_mla", scale=(192 + 64) ** -0.5)


def test_failing_kernel_falls_back_and_says_why(forced_wrong_decode):
    with vllm_log() as messages:
        impl = _build(forced_wrong_decode)
    assert impl.decision.decode == WRONG  # what was decided ...
    assert impl._mla_sm120_kernels[DECODE].name == TRITON_FAST  # ... and what runs: the next kernel allowed
    assert impl._mla_sm120_kernels[PREFILL].name == TORCH
    (line,) = [m for m in messages if "self-check" in m]
    assert f"decode={WRONG} FAILED on arbitrary-written scales (max error" in line, line
    assert f"falling back to {TRITON_FAST} ok" in line, line
    assert line.rstrip().endswith(" s"), line  # the time it took


def test_strict_refuses_before_any_weight_loads(forced_wrong_decode, monkeypatch):
    monkeypatch.setenv("MLA_SM120_SELF_CHECK", "strict")
    with pytest.raises(UnsupportedConfiguration) as err:
        _build(forced_wrong_decode)
    message = str(err.value)
    assert f"decode kernel {WRONG} failed its self-check" in message and "tolerance" in message
    assert_three_parts(message)


def test_off_skips_and_says_so(forced_wrong_decode, monkeypatch):
    monkeypatch.setenv("MLA_SM120_SELF_CHECK", "off")
    with vllm_log() as messages:
        impl = _build(forced_wrong_decode)
    assert impl._mla_sm120_kernels[DECODE].name == WRONG
    assert any("self-check skipped (MLA_SM120_SELF_CHECK=off)" in m for m in messages)
