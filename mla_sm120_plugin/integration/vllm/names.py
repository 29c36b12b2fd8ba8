"""The names every room of the vLLM adapter shares (a leaf: it imports only :mod:`mla_sm120_plugin.envs`).

The vLLM release the adapter was read from, the backend's class path (what ``register()`` records
under ``AttentionBackendEnum.CUSTOM`` and what the DeepSeek-V4 wrapper compares against), the
logger's name and the Ray variable that carries the plugin's settings. Pure Python.
"""

from __future__ import annotations

from ... import envs

BUILT_FOR = "0.33.0"  # the vLLM release the adapter was written and tested against
BACKEND_PATH = "mla_sm120_plugin.integration.vllm.backend.MlaSm120Backend"
# A child of vLLM's "vllm" logger: vLLM configures handlers (its format, its stream, its level from
# VLLM_LOGGING_LEVEL) on that logger only and does not propagate it, so records of any other
# logger reach no handler in a vLLM process.
LOGGER_NAME = "vllm.mla_sm120_plugin"
SETTINGS_PREFIX = envs.PREFIX  # every plugin setting starts with it
# vLLM's documented, additive list of extra variable prefixes its Ray launchers copy to their actors.
RAY_EXTRA_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
