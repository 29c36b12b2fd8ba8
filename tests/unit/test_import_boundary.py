"""Importing the package (and the modules the engines' entry points and the CLI touch) stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "flashinfer", "vllm", "sglang")


@pytest.mark.parametrize(
    "module",
    [
        "mla_sm120_plugin",
        "mla_sm120_plugin.kernels",
        "mla_sm120_plugin.selection",
        "mla_sm120_plugin.config",
        "mla_sm120_plugin.cli",
        "mla_sm120_plugin.dispatch.catalog",
        "mla_sm120_plugin.dispatch.flashinfer",
        "mla_sm120_plugin.integration.vllm",
        "mla_sm120_plugin.integration.sglang",
        "mla_sm120_plugin.integration.sglang.hooks",
        "mla_sm120_plugin.integration.sglang.names",
        "mla_sm120_plugin.integration.sglang.flags",
        "mla_sm120_plugin.integration.sglang.install",
        "mla_sm120_plugin.integration.vllm.names",
        "mla_sm120_plugin.integration.vllm.ray_env",
        "mla_sm120_plugin.context",
    ],
)
def test_import_leaves_heavy_modules_out(module):
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import {module} pulled in {out.strip()}"

