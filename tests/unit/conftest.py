"""Every unit test runs without a plugin config or a device named by the environment it was started
in (``MLA_SM120_CONFIG``, ``MLA_SM120_DEVICE``), and with the process's plugin config cache empty."""

from __future__ import annotations

import pytest

from mla_sm120_plugin.config import CONFIG_ENV
from mla_sm120_plugin.context import clear_config_cache


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("MLA_SM120_DEVICE", raising=False)
    clear_config_cache()
    yield
    clear_config_cache()
