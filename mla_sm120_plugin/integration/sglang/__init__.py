"""SGLang integration: the ``sglang.srt.plugins`` entry point, :func:`register`.

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts (launcher,
schedulers, detokenizer), before the launcher parses its command line. Installed but not enabled,
the plugin only adds its two flags to SGLang's parser (:mod:`.flags`): resolution and the kernel
call stay SGLang's own. Enabled (``--mla-sm120``, or ``MLA_SM120_SGLANG=1`` for the Python API), it
hooks SGLang's DSA backend resolution, validator and call site (:mod:`.dsa`) and its DeepSeek-V4
defaults, backend and call (:mod:`.dsv4`); the flag's value reaches the scheduler processes through
the environment, which SGLang's children inherit.

The rooms: :mod:`.names` (the names they share: a leaf), :mod:`.hooks` (the hook mechanism), :mod:`.bound`
(the launcher's plan as a scheduler binds it, for both binding rooms),
:mod:`.install` (the bindings' tables together), :mod:`.flags`, :mod:`.translate` (SGLang's settings ->
the plan's inputs; the plan handed to the schedulers), :mod:`.dsa`, :mod:`.dcp` (its decode context
parallelism: a rank's share of a call, HY V4's lifted refusal), :mod:`.dsv4`, and
:mod:`.internals` (every SGLang internal the adapter touches: what, why, what would let it go).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("mla_sm120_plugin")

# Set once this process has registered (SGLang's loader runs once, but a test or an embedder may
# call register() again).
_state: dict[str, Any] = {}


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: cheap, idempotent, never raises into SGLang.

    Registers the flags' hook always and the bindings' hooks only when enabled. Under an SGLang
    release the hooks were not read from, only the flags are registered (``--mla-sm120`` then stops
    the launch with the refusal) and the refusal is logged once: given, supported, fix, as vLLM's
    adapter and ``mla-sm120 check`` say it.
    """
    if _state:
        return
    _state["registered"] = True
    try:
        from . import flags, hooks, install
        from .names import enabled

        hooks.register(flags.HOOKS, after=True)
        refusal = hooks.release_refusal()
        if refusal is not None:
            _state["outcome"] = "unsupported release"
            logger.error("mla_sm120: not hooking SGLang: %s", refusal.replace("\n", "; "))
            return
        if enabled():
            install.engine_hooks()
    except Exception as exc:  # an exception here is logged and swallowed by SGLang: say it plainly
        _state["failed"] = f"{type(exc).__name__}: {exc}"
        logger.warning("mla_sm120: could not register with SGLang: %s", _state["failed"])
