"""The bindings' hooks, installed together once the plugin is enabled.

:func:`engine_hooks` registers the DSA (with its DCP launcher hook) and DeepSeek-V4 rooms' tables (AROUND) through
:mod:`.hooks`; the package face (:func:`mla_sm120_plugin.integration.sglang.register`, when
enabled) and the ``--mla-sm120`` action (:mod:`.flags`) call it. The flags' own table (AFTER) is
registered by the face in every process.
"""

from __future__ import annotations

from typing import Any, Callable

from . import hooks


def engine_tables() -> tuple[dict[str, Callable[..., Any]], ...]:
    """The bindings' hook tables: DSA's, its DCP launcher hook's, then DeepSeek-V4's (imported here, not at
    register time)."""
    from . import dcp, dsa, dsv4

    return dsa.HOOKS, dcp.HOOKS, dsv4.HOOKS


def engine_targets() -> dict[str, Callable[..., Any]]:
    """Every SGLang internal the bindings hook -> its hook."""
    return {target: hook for table in engine_tables() for target, hook in table.items()}


def engine_hooks(*, apply_now: bool = False) -> list[str]:
    """Register the bindings' hooks with SGLang's registry (once a process; again is a no-op).

    :param apply_now: apply them at once (the flag is parsed after ``load_plugins()`` applied
        what was registered then) and check each one took.
    :returns: the targets that are not hooked (empty when ``apply_now`` is False).
    """
    for table in engine_tables():
        hooks.register(table)
    if not apply_now:
        return []
    hooks.apply()
    return hooks.missing(engine_targets())
