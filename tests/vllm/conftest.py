"""The vLLM suite: real vLLM objects for tiny DSA models, built on the CPU (no weights, no GPU).

The helpers that reproduce vLLM's GPU start-up (construction context, metadata, logging) live in
``tests/support/vllm_engine.py``, importable from subprocesses too; this file adds the per-test state.
"""

from __future__ import annotations

import os

# vLLM's INFO lines would flood the test output; tests that look at the console say so themselves.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402

pytest.importorskip("vllm.config", reason="install the vllm extra: pip install -e '.[vllm]'")

from support.model_configs import write_model  # noqa: E402,F401  (re-exported for the vLLM tests)
from support.vllm_engine import make_impl, make_vllm_config, selector_kwargs  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _fresh_backend_state():
    from mla_sm120_plugin.context import clear_config_cache
    from mla_sm120_plugin.integration.vllm import translate

    translate.reset_for_tests()
    clear_config_cache()
    yield
    translate.reset_for_tests()
    clear_config_cache()


@pytest.fixture
def cpu_vllm(monkeypatch):
    """What vLLM's CPU-less platform lacks, set the narrowest way: no pinned memory, TP of 1."""
    import vllm.model_executor.layers.attention.sparse_mla_attention as sma

    monkeypatch.setattr(sma, "PIN_MEMORY", False)
    monkeypatch.setattr(sma, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
