"""vLLM integration: the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
once per process, before models are built. It only records our backend's class path under
``AttentionBackendEnum.CUSTOM``; nothing is imported until the user picks
``--attention-backend CUSTOM`` and vLLM resolves that path.

Every place this package depends on vLLM 0.33 internals is listed in
:mod:`mla_sm120_plugin.integration.vllm.adapters`, with what would let it go.
"""

from __future__ import annotations

import logging

BACKEND_PATH = "mla_sm120_plugin.integration.vllm.backend.MlaSm120Backend"

logger = logging.getLogger("mla_sm120_plugin")

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
    except Exception as exc:  # an exception here would abort vLLM's start-up
        _state["outcome"] = "failed"
        logger.warning("mla_sm120: could not register the CUSTOM attention backend: %s: %s", type(exc).__name__, exc)
