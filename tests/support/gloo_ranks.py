"""Several engine ranks on the CPU: ``world`` spawned processes that join one gloo group on a free port.

The DCP helpers (``tests/support/vllm_dcp.py``, ``tests/support/sglang_dcp.py``) give :func:`run_ranks` their rank function,
``target(rank, world, port, *args, queue)``, which joins the group through its engine's own parallel state,
runs its cases and puts ``(rank, results)`` on the queue (a traceback string where it failed).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable
from unittest import mock


def run_ranks(target: Callable[..., None], world: int, args: tuple, env: dict[str, str], timeout: float) -> dict:
    """Start ``world`` ranks of ``target`` with ``env`` set for them only; rank -> what it put on the queue."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    with mock.patch.dict(os.environ, env):  # the children's only
        for p in procs:
            p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def rank_result(ranks: dict, world: int, rank: int, case: Any) -> Any:
    """What ``rank`` of the ``world``-rank group returned for ``case``; a rank's or case's traceback fails here."""
    got = ranks[world][rank]
    assert not isinstance(got, str), got  # the rank's traceback
    got = got[case.name]
    assert not isinstance(got, str), got
    return got


def each_case(run_case: Callable[..., Any], cases: list, *args: Any) -> dict:
    """``run_case(case, *args)`` for each case: case name -> its result, or its traceback (the others still run)."""
    import traceback

    results = {}
    for case in cases:
        try:
            results[case.name] = run_case(case, *args)
        except Exception:
            results[case.name] = traceback.format_exc()
    return results
