"""The names every room of the vLLM adapter shares (a leaf: it imports only :mod:`mla_sm120_plugin.envs`).

The backend's class path (what ``register()`` records under ``AttentionBackendEnum.CUSTOM`` and
what the DeepSeek-V4 wrapper compares against), the logger's name and the Ray variable that carries
the plugin's settings. Pure Python. The vLLM releases the adapter serves are
:data:`mla_sm120_plugin.engines.RELEASES`.
"""

from __future__ import annotations

from ... import envs

BACKEND_PATH = "mla_sm120_plugin.integration.vllm.backend.MlaSm120Backend"
# A child of vLLM's "vllm" logger: vLLM configures handlers (its format, its stream, its level from
# VLLM_LOGGING_LEVEL) on that logger only and does not propagate it, so records of any other
# logger reach no handler in a vLLM process.
LOGGER_NAME = "vllm.mla_sm120_plugin"
SETTINGS_PREFIX = envs.PREFIX  # every plugin setting starts with it
# vLLM's documented, additive list of extra variable prefixes its Ray launchers copy to their actors.
RAY_EXTRA_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
