"""The DCP tests' skeleton, one for both engines: the case, the rows rank 0 owns all or none of, the expected
partial and merged outputs (the float64 oracle), and ``world`` gloo ranks on the CPU.

Each engine's module (:mod:`support.vllm_dcp`, :mod:`support.sglang_dcp`) adds only its own: how its cache
places a token on a rank, its problem's random draws, its parallel state, its call and its merge. Its rank
function, ``target(rank, world, port, *args, queue)``, given to :func:`run_ranks`, joins the group through
the engine's own parallel state and hands :func:`serve_rank` the case runner; the test reads a rank's
result with :func:`rank_result`.
"""

from __future__ import annotations

import os
import socket
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import torch

from support.oracle import sparse_attention


@dataclass(frozen=True)
class DcpCase:
    """One DCP forward, the fields both engines' cases have (each engine's ``Case`` sets its defaults
    and adds its own): model, cache, kernels per phase, merge backend, batch."""

    name: str
    model: str = "glm"  # the test's model directory key ("glm", "hyv4" with sinks, "glm53" rope-less)
    kv: str = ""  # the engine's --kv-cache-dtype
    decode_kernel: str = "triton_sparse_mla"
    prefill_kernel: str = "torch_sparse_mla"
    comm: str = ""  # the engine's --dcp-comm-backend: "a2a" or "ag_rs"
    heads: int = 3  # heads a rank (odd); a call sees heads x world
    topk: int = 64
    q_lens: tuple[int, ...] = (1, 1, 1, 1)
    seq_lens: tuple[int, ...] = (150, 9, 70, 40)
    # Rows whose ids are rewritten (each request's first row): "padded" (no id), "first_rank" (only
    # positions rank 0 owns, so the others own none of its ids), "others" (none rank 0 owns).
    special: tuple[tuple[int, str], ...] = field(default=((1, "padded"), (2, "first_rank"), (3, "others")))


def generator(case: DcpCase, world: int) -> torch.Generator:
    """The problem's seed: the same in every process of a group, different per case and world size."""
    return torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))


def query_starts(case: DcpCase) -> list[int]:
    """Each request's first query row."""
    return [sum(case.q_lens[:r]) for r in range(len(case.q_lens))]


def rewrite_special_rows(ids: torch.Tensor, case: DcpCase, on_first_rank: Callable[[int, int], bool]) -> None:
    """Rewrite ``case.special``'s rows of ``ids`` (positions, [T, topk] int32) in place: "padded" none,
    "first_rank" the visible positions ``p`` of request ``r`` with ``on_first_rank(r, p)``, "others" those
    without (each request's first row sees ``seq_len - q_len + 1`` positions)."""
    starts = query_starts(case)
    for r, kind in case.special:
        t = starts[r]
        ids[t] = -1
        if kind in ("first_rank", "others"):
            visible = case.seq_lens[r] - case.q_lens[r] + 1
            mine = [p for p in range(visible) if on_first_rank(r, p) == (kind == "first_rank")][: case.topk]
            ids[t, : len(mine)] = torch.tensor(mine, dtype=torch.int32)


def own_sinks(sinks: torch.Tensor | None, world: int, rank: int) -> torch.Tensor | None:
    """The sinks rank ``rank``'s partial counts: its own heads' (the slice ``rank`` of the gathered heads),
    -inf (none) for the others', which their ranks count; None without sinks."""
    if sinks is None:
        return None
    mine = (torch.arange(sinks.shape[0]) // (sinks.shape[0] // world)) == rank
    return torch.where(mine, sinks, torch.full_like(sinks, float("-inf")))


def expected(keys64: torch.Tensor, ids: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor | None, scale: float,
             keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle over ``keys64`` (the whole cache's rows as the bytes hold them) for each row's ids
    (``keep``, a mask of ``ids``: only those, one rank's partial), each head's sink one more logit of its
    denominator. Returns (out [T, H, 512], lse [T, H] natural log, the sink folded in: what a DCP merge
    weighs; a row with no id: 0, and -inf or the sink)."""
    if keep is not None:
        ids = torch.where(keep, ids, -1)
    return sparse_attention(q, keys64, ids, scale, sink=sinks, lse_with_sink=True)


# ---------------------------------------------------------------- the ranks


def run_ranks(target: Callable[..., None], world: int, args: tuple, env: dict[str, str], timeout: float,
              self_check: str = "on") -> dict:
    """Start ``world`` ranks of ``target`` (spawned) on one free port with ``env`` set for them only; rank ->
    what it put on the queue. ``self_check``: the ranks' ``MLA_SM120_SELF_CHECK`` (every rank runs the same
    check, in the interpreter: a group that is not about it turns it off)."""
    from mla_sm120_plugin.envs import SELF_CHECK

    env = {**env, SELF_CHECK: self_check}
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


def serve_rank(rank: int, queue, join: Callable[[], None], run_case: Callable[[Any], Any], cases: list,
               leave: Callable[[], None] | None = None) -> None:
    """A rank's life: ``join`` the group (the engine's parallel state), ``run_case`` each case, put
    ``(rank, case name -> result or traceback)`` on the queue, ``leave``; a traceback of its own if any of
    that fails outside a case."""
    try:
        join()
        queue.put((rank, each_case(run_case, cases)))
        if leave is not None:
            leave()
    except Exception:
        queue.put((rank, traceback.format_exc()))


def rank_result(ranks: dict, world: int, rank: int, case: Any) -> Any:
    """What ``rank`` of the ``world``-rank group returned for ``case``; a rank's or case's traceback fails here."""
    got = ranks[world][rank]
    assert not isinstance(got, str), got  # the rank's traceback
    got = got[case.name]
    assert not isinstance(got, str), got
    return got


def each_case(run_case: Callable[..., Any], cases: list, *args: Any) -> dict:
    """``run_case(case, *args)`` for each case: case name -> its result, or its traceback (the others still run)."""
    results = {}
    for case in cases:
        try:
            results[case.name] = run_case(case, *args)
        except Exception:
            results[case.name] = traceback.format_exc()
    return results
