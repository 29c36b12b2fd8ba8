"""The launcher's plan as a scheduler binds it: one :class:`BoundState` per room, the same for both.

Each room (:mod:`.dsa`, :mod:`.dsv4`) asks :func:`bound_state` for its layer kinds once a process:
the contexts the launcher exported (:func:`.translate.imported`) are decided again, and each kind's
decision goes through the one binding service every engine binding uses
(:func:`mla_sm120_plugin.dispatch.bound.bind_decision`: self-check, bind, two log lines).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...selection import select
from ...types import Decision
from . import hooks, translate
from .names import LOGGER

logger = logging.getLogger(LOGGER)

_states: dict[str, "BoundState"] = {}  # room -> its state in this process


@dataclass(frozen=True, eq=False)
class BoundState:
    """A room's share of the launcher's plan in this scheduler: layer kind -> its bound decision
    (:class:`~mla_sm120_plugin.dispatch.bound.BoundDecision`: the decision, each phase's kernel after
    the self-check, the check's log line). Compared and hashed by identity: one a room a process, so a
    room may index it once (``functools`` caches keyed on it)."""

    kinds: Mapping[str, Any]

    def decision(self, kind: str) -> Decision:
        """The decision for layer kind ``kind``."""
        return self.kinds[kind].decision


def bound_state(room: str, table: Mapping[str, Callable[..., Any]], what: str, where: str, *,
                kinds: tuple[str, ...] | None = None,
                engine_fns: Callable[[list[Decision]], Mapping[str, Callable[..., Any]]] | None = None) -> BoundState:
    """Decide, self-check, bind and log ``room``'s layer kinds of the launcher's plan, once a process.

    :param room: the room's name (the state is kept per room).
    :param table: the room's hook table (each hook must be installed: :func:`.hooks.require`).
    :param what: what the launcher's plan is called in a refusal (``"decision"``).
    :param where: what SGLang's launcher was doing when it planned (``"resolving the DSA backends"``).
    :param kinds: the layer kinds this room serves (None: every kind in the plan).
    :param engine_fns: given the decisions, kernel name -> the callable the engine runs it with, for
        kernels SGLang calls itself.
    :raises UnsupportedConfiguration: the plan did not reach this process (or holds none of ``kinds``),
        or a kind's kernels and their alternates all failed the self-check.
    """
    state = _states.get(room)
    if state is not None:
        return state
    hooks.require(table)
    contexts = translate.imported(what, where)
    if kinds is not None:
        contexts = {kind: ctx for kind, ctx in contexts.items() if kind in kinds}
    if not contexts:
        raise translate.not_reached(what, where)
    from ...dispatch.bound import bind_decision

    decisions = {kind: select(ctx) for kind, ctx in contexts.items()}
    fns = engine_fns(list(decisions.values())) if engine_fns else None
    state = _states[room] = BoundState({kind: bind_decision(decision, logger=logger, engine_fns=fns)
                                        for kind, decision in decisions.items()})
    return state


def forget(room: str) -> None:
    """Forget ``room``'s bound state in this process (tests; SGLang binds once a process)."""
    _states.pop(room, None)
