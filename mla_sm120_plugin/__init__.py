"""mla_sm120_plugin: FP8 sparse-MLA for DeepSeek-Sparse-Attention models on SM120/SM121 GPUs.

Importing this package is cheap: torch, triton, flashinfer and vllm are imported only by the
functions that need them. The public names below are resolved on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "select": "mla_sm120_plugin.selection",
    "explain": "mla_sm120_plugin.report",
    "load_config": "mla_sm120_plugin.config",
    "get_registry": "mla_sm120_plugin.hooks.manager",
    "sparse_mla_forward": "mla_sm120_plugin.dispatch.forward",
    "hookimpl": "mla_sm120_plugin.hooks.specs",
    "DeviceInfo": "mla_sm120_plugin.types",
    "KernelSpec": "mla_sm120_plugin.types",
    "ModelProfile": "mla_sm120_plugin.types",
    "SelectionContext": "mla_sm120_plugin.types",
    "Decision": "mla_sm120_plugin.types",
    "UnsupportedConfiguration": "mla_sm120_plugin.errors",
    "ConfigError": "mla_sm120_plugin.errors",
    "PluginError": "mla_sm120_plugin.errors",
    "KernelInputError": "mla_sm120_plugin.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_sm120_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
