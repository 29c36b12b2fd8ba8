"""The hook mechanism: hook tables registered with SGLang's ``HookRegistry``, and whether each took.

A room (:mod:`.flags`, :mod:`.dsa`, :mod:`.dsv4`) holds its own table, SGLang dotted name -> the
hook on it; :mod:`.install` registers the rooms' tables together. SGLang logs and swallows a hook it
cannot apply, so :func:`missing` looks for each hook in the wrapper chain SGLang installed (its
wrappers keep the inner function as ``__wrapped__`` and the hook in their closure) and
:func:`require` refuses to serve without them. This module imports no room.
"""

from __future__ import annotations

import logging
import pkgutil
from typing import Any, Callable, Mapping

from ...errors import PluginError, format_error
from .names import FLAG, LOGGER

logger = logging.getLogger(LOGGER)

Table = Mapping[str, Callable[..., Any]]

# What register() gave SGLang in this process: target -> hook (the AROUND tables, which the
# bindings need in place; the AFTER hook on SGLang's parser only adds the flags).
_engine: dict[str, Callable[..., Any]] = {}
_registered: dict[str, Callable[..., Any]] = {}


def release_refusal() -> str | None:
    """Why the installed SGLang is not a release the hooks were read from (given / supported / fix, one
    a line, as vLLM's adapter and ``mla-sm120 check`` say it), or None when it is one."""
    from ...engines import installed_release, release_refusal as refusal_for

    return refusal_for("sglang", installed_release("sglang"), f"serve without {FLAG}")


def register(table: Table, *, after: bool = False) -> None:
    """Register each hook of ``table`` with SGLang's registry, AROUND its target (``after``: AFTER it);
    a target already registered with the same hook in this process is left as it is."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kind = HookType.AFTER if after else HookType.AROUND
    for target, hook in table.items():
        if _registered.get(target) is hook:
            continue
        HookRegistry.register(target, hook, kind)
        _registered[target] = hook
        if not after:
            _engine[target] = hook


def apply() -> None:
    """Apply what is registered now (a flag parsed after ``load_plugins()`` applied the rest)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def _hooked(target: str, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is somewhere in the wrapper chain SGLang installed at ``target``."""
    try:
        fn = pkgutil.resolve_name(target)
    except Exception:
        return False
    seen = 0
    while fn is not None and seen < 32:  # SGLang's wrappers keep the inner function as __wrapped__
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(cell, "cell_contents", None) is hook for cell in cells):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def missing(table: Table) -> list[str]:
    """Targets of ``table`` where its hook is not installed."""
    return [target for target, hook in table.items() if not _hooked(target, hook)]


def missing_message(targets: list[str]) -> str:
    """The refusal for hooks SGLang did not apply: given / supported / fix."""
    from ...engines import RELEASES, installed_release

    supported = RELEASES["sglang"]
    return format_error(
        f"{FLAG} is on but SGLang did not apply the plugin's hooks on {', '.join(targets)} "
        f"(SGLang {installed_release('sglang')})",
        "SGLang " + " or ".join(supported) + " (the releases the plugin's hooks were read from)",
        "; or ".join(engine.install for engine in supported.values()) + f"; or serve without {FLAG}",
    )


def require(table: Table) -> None:
    """Refuse unless ``table``'s hooks and every engine hook registered in this process are installed.

    :raises PluginError: some are not, naming them.
    """
    targets = missing({**_engine, **table})
    if targets:
        raise PluginError(missing_message(targets))
