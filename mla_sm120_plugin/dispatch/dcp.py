"""Decode context parallelism: one rank's share of a sparse-MLA call, the one home for every engine.

Under DCP the engine shards the cache by token over ranks of its TP group, gathers the group's query
heads for every call (in rank order) and merges the ranks' partial outputs by the LSE each returns. An
engine adapter only translates: it reads the engine's DCP size and rank (:class:`DcpRank`), turns the
call's ids into this rank's with the engine's own localizer (owned ids first, their counts) and calls
:func:`rank_share`, which

- applies the one sink rule (:data:`mla_sm120_plugin.rules.SINK_RULE`): the rank's own heads' sinks,
  -inf (counted by another rank) for the other heads (:func:`call_sinks`);
- calls the phase's kernel once, the owned counts as ``topk_length``, asking for the LSE in the base
  the engine's merge reads and with the sink folded in (``lse_with_sink``): nothing is converted after
  the call, and FlashInfer's own sink-folded LSE is used as it is;
- returns the kernel's ``(out [T, H x N, 512], lse [T, H x N] float32)``: a row with no owned id gives
  0 and -inf, or the sink on the heads whose sink this rank counts.

What the caller reads besides the output (the LSE, its base, the sink in it) is part of the kernel
contract (:func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward`); the init self-check proves it
for the kernels a DCP deployment binds, on the calls built here (:mod:`.selfcheck_dsa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..engines import LSE_BASES, Engine
from ..errors import KernelInputError, format_error

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DcpRank:
    """This rank of the engine's DCP group, as a call's share needs it.

    :param size: ranks the cache is sharded over (the DCP size, > 1).
    :param rank: this rank's place in the group (its heads are the slice ``rank`` of a call's heads).
    :param lse_base: the base the engine's merge reads a rank's LSE in (``"e"`` or ``"2"``).
    :raises KernelInputError: a size below 2, a rank outside the group or an unknown base.
    """

    size: int
    rank: int
    lse_base: str

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and isinstance(self.rank, int) and self.size > 1
                and 0 <= self.rank < self.size and self.lse_base in LSE_BASES):
            raise KernelInputError(format_error(
                f"DCP rank {self.rank!r} of {self.size!r}, LSE base {self.lse_base!r}",
                f"a DCP size > 1, a rank in [0, size) and a base in {LSE_BASES}",
                "pass the engine's DCP group size and rank (decode context parallelism > 1 only)"))

    @classmethod
    def of(cls, engine: Engine, size: int, rank: int) -> DcpRank:
        """Rank ``rank`` of a DCP group of ``size`` under ``engine`` (the base its merge reads)."""
        return cls(int(size), int(rank), engine.dcp.lse_base)


def call_sinks(sinks: torch.Tensor | None, rank: DcpRank, call_heads: int) -> torch.Tensor | None:
    """The sinks a rank's call carries under the one rule: its own heads' (the slice ``rank`` of the
    gathered heads), -inf for the other ranks' heads, which those ranks count.

    sinks: [H] float32, this rank's own heads' sink logits (the layer's parameter), or None
    returns: [H x N] float32 (N the DCP size), or None without sinks
    :raises KernelInputError: sinks that are not one a head of this rank.
    """
    import torch

    if sinks is None:
        return None
    heads = call_heads // rank.size
    if call_heads % rank.size or tuple(sinks.shape) != (heads,):
        raise KernelInputError(format_error(
            f"sinks of shape {tuple(sinks.shape)} for a call of {call_heads} heads at DCP size {rank.size}",
            f"[{call_heads // rank.size}] float32: one sink a head of this rank (the call gathers {rank.size} "
            "ranks' heads)", "pass the layer's own sink parameter"))
    mine = (rank.rank * heads, (rank.size - 1 - rank.rank) * heads)  # -inf before and after the own slice
    return torch.nn.functional.pad(sinks.to(torch.float32), mine, value=float("-inf"))


def rank_share(run: Callable[..., Any], q: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, *,
               rank: DcpRank, sinks: torch.Tensor | None) -> Any:
    """This rank's share of a call: the kernel once on its owned ids, as the engine's merge reads it.

    :param run: the engine's kernel call for these rows, ``run(q, slots, **contract)`` with
        ``sparse_mla_forward``'s keyword arguments (``topk_length``, ``sink``, ``return_lse``,
        ``lse_base``, ``lse_with_sink``); it returns ``(out, lse)``.
    :param q: [T, H x N, D] bfloat16, the DCP group's heads gathered in rank order.
    :param slots: [T, K] int32, this rank's owned ids first (slots of its own cache), from the engine's
        localizer; entries past a row's count are not read.
    :param counts: [T] int32, owned ids a row (0: none).
    :param rank: this rank (:class:`DcpRank`).
    :param sinks: [H] float32, this rank's own heads' sinks, or None.
    :returns: what ``run`` returns: out [T, H x N, 512] and lse [T, H x N] float32 in ``rank.lse_base``,
        the sinks this rank counts folded in.
    """
    sink = call_sinks(sinks, rank, q.shape[1])
    extra = {} if sink is None else {"sink": sink, "lse_with_sink": True}
    return run(q, slots, topk_length=counts, return_lse=True, lse_base=rank.lse_base, **extra)
