"""A decision bound for an engine: the one service every engine binding calls.

:func:`bind_decision` takes a :class:`~mla_sm120_plugin.types.Decision` (one layer kind's, from the plan)
and, once a process for the same context and engine callables, proves each phase's kernel on this
machine (:func:`mla_sm120_plugin.dispatch.selfcheck.verify_at_init`: the self-check, its fallback
along the decision's alternates, ``MLA_SM120_SELF_CHECK``), binds what passed, and logs two lines on
the engine's logger: the decision (what runs, why not the others) and the self-check's results. vLLM's
DSA impl and DeepSeek-V4 layer class and SGLang's DSA and DeepSeek-V4 schedulers all bind this way, so
the four say the same thing in the same words.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..report import decision_line
from ..types import Decision
from . import selfcheck
from .binding import BoundKernel, bind


@dataclass(frozen=True)
class BoundDecision:
    """A decision as an engine runs it.

    :param decision: what the plan decided.
    :param kernels: phase -> the kernel that passed its self-check (the decided one, or the alternate a
        fallback took), imported; a kernel the engine runs itself is its own callable.
    :param check_line: the self-check's log line.
    """

    decision: Decision
    kernels: Mapping[str, BoundKernel]
    check_line: str

    def engine_runs(self, phase: str) -> bool:
        """The phase's kernel is one the engine calls itself (the engine's own call is left as it is)."""
        return self.kernels[phase].engine_own


_bound: dict[tuple[Any, ...], BoundDecision] = {}


def bind_decision(decision: Decision, *, logger: logging.Logger,
                  engine_fns: Mapping[str, Callable[..., Any]] | None = None) -> BoundDecision:
    """Verify, bind and log ``decision`` (once a process for its context and ``engine_fns``).

    :param logger: the engine adapter's logger (its lines reach the engine's log handlers).
    :param engine_fns: kernel name -> the callable the engine runs it with, for kernels the engine calls
        itself (FlashInfer's DeepSeek-V4 kernel as the engine imported it); others bind from their entry.
    :returns: each phase's kernel, bound, and the self-check's line.
    :raises UnsupportedConfiguration: a phase's kernel and its alternates all failed the self-check
        (or ``MLA_SM120_SELF_CHECK=strict`` and the first failed).
    """
    fns = dict(engine_fns or {})
    key = (decision.context, tuple(sorted((name, id(fn)) for name, fn in fns.items())))
    if key not in _bound:
        names, line = selfcheck.verify_at_init(decision, fns)
        kernels = {phase: selfcheck.engine_kernel(name, fns[name]) if name in fns else bind(name)
                   for phase, name in names.items()}
        _bound[key] = BoundDecision(decision, kernels, line)
        logger.info("%s", decision_line(decision))
        logger.info("%s", line)
    return _bound[key]


def clear() -> None:
    """Forget what was bound in this process (tests)."""
    _bound.clear()
