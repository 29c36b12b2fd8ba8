"""vLLM integration: the ``vllm.general_plugins`` entry point, :func:`register`.

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
once per process, before models are built. It records the backend's class path under
``AttentionBackendEnum.CUSTOM`` and installs the DeepSeek-V4 import hook; nothing heavy is
imported until the user picks ``--attention-backend CUSTOM`` and vLLM resolves that path or builds
a DeepSeek-V4 model.

The rooms: :mod:`.names` (the names they share: a leaf), :mod:`.ray_env` (the settings on Ray's
actors), :mod:`.translate` (vLLM's config -> the plan's inputs; the plan), :mod:`.backend` (the DSA
binding: backend, metadata builder, impl), :mod:`.dsv4` (the DeepSeek-V4 binding: the layer class
vLLM picks), :mod:`.dsv4_nvfp4` (its 384-byte NVFP4 record), and :mod:`.internals` (every vLLM
internal the adapter touches: what, why, what would let it go).
"""

from __future__ import annotations

import logging

# Set once this process has decided (registered, or found CUSTOM taken): later calls return
# at once. A module flag, because vLLM may call register() again in the same process.
_state: dict[str, str] = {}


def register() -> None:
    """Register the backend under ``AttentionBackendEnum.CUSTOM``; cheap, idempotent, never raises.

    If CUSTOM already belongs to another plugin, it is left alone and both names are logged
    once: silently replacing someone else's backend would change what their users run. Under a
    vLLM release the plugin was not read from, nothing is registered or hooked (its internals may
    have moved) and the refusal is logged: given, supported, fix (``mla-sm120 check`` says the same).
    """
    if _state:
        return
    from ...engines import installed_release, release_refusal
    from .names import BACKEND_PATH, LOGGER_NAME
    from .ray_env import carry_settings_to_ray

    logger = logging.getLogger(LOGGER_NAME)
    refusal = release_refusal("vllm", installed_release("vllm"))
    if refusal is not None:
        _state["outcome"] = "unsupported release"
        logger.error("mla_sm120: not registering the CUSTOM attention backend: %s",
                     refusal.replace("\n", "; "))
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
