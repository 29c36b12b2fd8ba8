"""SGLang 0.5.23's own code on the CPU: argument resolution, plugin loading, the DSA call site.

Runs in the SGLang environment (`.venv-sglang`, `pip install -e ".[sglang,test]"`); skipped where
sglang is not installed (the vLLM environment). The GPU's compute capability is what SGLang reads
from ``torch.cuda.get_device_capability()``; tests set it there, and Triton kernels (SGLang's cache
writer and index transforms, and ours) run in Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang.srt", reason="the SGLang suite runs in its own environment: pip install -e '.[sglang,test]'")

import torch  # noqa: E402

from mla_sm120_plugin.integration import sglang as plugin  # noqa: E402,F401
from mla_sm120_plugin.integration.sglang import names  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _plugins_loaded():
    """SGLang's loader, run once as every SGLang process runs it, with the plugin enabled so its
    engine hooks are registered and applied; tests switch the opt-in off to see SGLang alone."""
    os.environ[names.ENABLE_ENV] = "1"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    yield


@pytest.fixture(autouse=True)
def _fresh_sglang_state(monkeypatch):
    from mla_sm120_plugin.context import clear_config_cache
    from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401

    monkeypatch.setenv(names.ENABLE_ENV, "1")
    for name in (names.PLAN_ENV, names.INLINE_CONFIG_ENV, "MLA_SM120_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    clear_config_cache()
    dsa.reset_for_tests()
    dsv4.reset_for_tests()
    yield
    dsa.reset_for_tests()
    dsv4.reset_for_tests()
    clear_config_cache()


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability SGLang and the plugin read for "this GPU"."""
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (major, minor))

    return set_capability
