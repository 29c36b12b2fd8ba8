"""vLLM integration: the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
once per process, before models are built. It records our backend's class path under
``AttentionBackendEnum.CUSTOM`` and installs the DeepSeek-V4 import hook
(:mod:`.dsv4`); nothing is imported until the user picks ``--attention-backend CUSTOM`` and vLLM
resolves that path or builds a DeepSeek-V4 model.

Every place this package depends on vLLM 0.33 internals is listed in
:mod:`mla_sm120_plugin.integration.vllm.adapters`, with what would let it go.
"""

from __future__ import annotations

import logging
import os

BACKEND_PATH = "mla_sm120_plugin.integration.vllm.backend.MlaSm120Backend"
# A child of vLLM's "vllm" logger: vLLM configures handlers (its format, its stream, its level from
# VLLM_LOGGING_LEVEL) on that logger only and does not propagate it, so records of any other
# logger reach no handler in a vLLM process.
LOGGER_NAME = "vllm.mla_sm120_plugin"

logger = logging.getLogger(LOGGER_NAME)

# The plugin's settings travel in the environment (MLA_SM120_CONFIG, MLA_SM120_SELF_CHECK,
# MLA_SM120_DISABLE_PLUGINS, MLA_SM120_DEVICE). vLLM 0.33's Ray paths copy to the actors they start
# only variables they know (vllm/ray/ray_env.py: get_env_vars_to_copy, used for Ray data-parallel
# engine cores) plus the prefixes a user adds to this documented, additive variable.
SETTINGS_PREFIX = "MLA_SM120_"
RAY_EXTRA_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"

# Set once this process has decided (registered, or found CUSTOM taken): later calls return
# at once. A module flag, because vLLM may call register() again in the same process.
_state: dict[str, str] = {}


def register() -> None:
    """Register the backend under ``AttentionBackendEnum.CUSTOM``; cheap, idempotent, never raises.

    If CUSTOM already belongs to another plugin, it is left alone and both names are logged
    once: silently replacing someone else's backend would change what their users run.
    """
    if _state:
        return
    carry_settings_to_ray()
    try:
        # vllm is already imported when vLLM calls this; the import is free then.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        custom = AttentionBackendEnum.CUSTOM
        if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
            _state["outcome"] = "foreign"
            logger.warning(
                "mla_sm120: AttentionBackendEnum.CUSTOM already belongs to %s; leaving it as is, "
                "so --attention-backend CUSTOM will not run %s. Uninstall one of the two plugins "
                "or exclude one with VLLM_PLUGINS.",
                custom.get_path(),
                BACKEND_PATH,
            )
            return
        register_backend(custom, BACKEND_PATH)
        _state["outcome"] = "registered"
        # DeepSeek-V4 layers pick their class without the selector: wrap that choice where vLLM
        # imports it (nothing imported now; without the opt-in the wrapper returns vLLM's choice).
        from .dsv4 import install

        install()
    except Exception as exc:  # an exception here would abort vLLM's start-up
        _state["outcome"] = "failed"
        logger.warning("mla_sm120: could not register the CUSTOM attention backend: %s: %s", type(exc).__name__, exc)


def carry_settings_to_ray() -> None:
    """Add :data:`SETTINGS_PREFIX` to vLLM's extra Ray prefixes when a plugin setting is set here.

    vLLM loads plugins in the API server before it starts engine cores or workers, so the
    variable is in place when its Ray launchers read it; mp and external-launcher workers inherit
    the environment anyway. Never raises.
    """
    if not any(name.startswith(SETTINGS_PREFIX) for name in os.environ):
        return
    prefixes = [p.strip() for p in os.environ.get(RAY_EXTRA_PREFIXES_ENV, "").split(",") if p.strip()]
    if SETTINGS_PREFIX not in prefixes:
        os.environ[RAY_EXTRA_PREFIXES_ENV] = ",".join([*prefixes, SETTINGS_PREFIX])
