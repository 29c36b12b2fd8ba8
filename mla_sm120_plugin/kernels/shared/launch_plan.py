"""The launch-plan rule every Triton kernel's split count comes from (pure Python: no torch, no triton).

A call is cut into programs of (query token, head block, split of the candidates); only the split
count is chosen, from shapes alone (never live lengths or any tensor's values, so a CUDA graph
captured at a shape replays the same grid). :func:`split_rule` is the one rule: fill one wave of
resident CTAs on the family's reference part, pay for splits only in bytes that cost no time,
whole steps per split, and of those the fastest in the model (:func:`launch_time_us`). Each family models its own bytes (:class:`Traffic`): the DSA plans in
``kernels/dsa/plan.py``, DeepSeek-V4's in ``kernels/dsv4/plan.py``.

Why and how the budget is set: docs/kernels.md, section ``kernels/shared/launch_plan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mla_sm120_plugin.kernels.shared.host import cdiv

EXTRA_FRACTION = 0.2  # bytes splitting may add, as a fraction of the unsplit launch's bytes ...
LATENCY_US = 1.0  # ... or what the GPU moves in this long (a loaded DRAM round trip), if more
COMBINE_SPLIT_BLOCK = 32  # splits the combine merges a step (kernels/shared/combine.py)


@dataclass(frozen=True)
class ArchFamily:
    """A GPU family the tables are computed for: a representative part's SM count and bandwidth.

    name: "sm120", "sm121" or "sm90"
    part: the representative GPU
    num_sms: its SM count
    bandwidth_gbps: its DRAM bandwidth, GB/s
    l2_bytes: its L2 cache; a family's model may count bytes written and read back within a call
        (split partials) as L2 traffic while they take at most a quarter of it
    """

    name: str
    part: str
    num_sms: int
    bandwidth_gbps: float
    l2_bytes: int

    @property
    def latency_bytes(self) -> float:
        """Bytes the GPU moves in :data:`LATENCY_US`: below this a launch is latency bound."""
        return self.bandwidth_gbps * 1e9 * LATENCY_US * 1e-6

    def seconds(self, num_bytes: float) -> float:
        """How long moving ``num_bytes`` takes at the part's DRAM bandwidth."""
        return num_bytes / (self.bandwidth_gbps * 1e9)


_MB = 1 << 20
FAMILIES = {
    # RTX PRO 6000: 188 SMs, the same bandwidth, 128 MB of L2
    "sm120": ArchFamily("sm120", "RTX 5090", 170, 1792.0, 96 * _MB),
    # GB10's GPU L2 is not published; 24 MB is assumed (a quarter: 6 MB of partials)
    "sm121": ArchFamily("sm121", "DGX Spark GB10", 48, 273.0, 24 * _MB),
    "sm90": ArchFamily("sm90", "H200", 132, 4800.0, 50 * _MB),  # the device sweep's GPU (H100: 3350 GB/s)
}
DEFAULT_FAMILY = "sm120"


def gpu_family(major: int, minor: int) -> str:
    """The tables' family for a compute capability (SM121 is its own row: 48 SMs, 273 GB/s)."""
    if major == 12:
        return "sm121" if minor == 1 else "sm120"
    if major == 9:
        return "sm90"
    return DEFAULT_FAMILY


def bucket(value: int, edges: tuple[int, ...]) -> int:
    """The first edge >= ``value`` (the last edge for a larger one)."""
    for edge in edges:
        if value <= edge:
            return edge
    return edges[-1]


@dataclass(frozen=True)
class Traffic:
    """Bytes one call's launches move from DRAM, by kind, as the family's model counts them (the DSA
    plans: nothing reused across programs; DeepSeek-V4's: :attr:`l2` takes the reuse).

    cache: cache rows (DSA: once per (token, head block))
    q: q (DSA: once per program: every split reloads its heads)
    indices: index rows (plus, where a kernel prefetches, the step each split loads past its end)
    partials: split partials and their LSE, written and read back (0 for one split)
    output: out (and nothing for lse, which is 4 bytes a head)
    minimum: cache rows + q + indices + output, each once
    l2: bytes the model has L2 serve instead (not in :attr:`total`; 0 where a family counts
        everything as DRAM traffic)
    """

    cache: int
    q: int
    indices: int
    partials: int
    output: int
    minimum: int
    l2: int = 0

    @property
    def total(self) -> int:
        return self.cache + self.q + self.indices + self.partials + self.output

    @property
    def ratio(self) -> float:
        return self.total / self.minimum

    def as_dict(self) -> dict:
        return dict(cache=self.cache, q=self.q, indices=self.indices, partials=self.partials,
                    output=self.output, total=self.total, minimum=self.minimum, ratio=round(self.ratio, 4),
                    partials_over_cache=round(self.partials / self.cache, 4) if self.cache else 0.0,
                    **({"l2": self.l2} if self.l2 else {}))


def cut(blocks: int, wanted: int) -> tuple[int, int]:
    """``blocks`` steps cut into about ``wanted`` ranges of whole steps, none empty:
    ``(num_splits, blocks_per_split)``."""
    per_split = cdiv(blocks, max(1, min(wanted, blocks)))
    return cdiv(blocks, per_split), per_split


def launch_time_us(family: ArchFamily, total_bytes: float, *, programs: int, ctas_per_sm: int, splits: int,
                   steps_per_split: int, round_trips_per_step: int = 1) -> float:
    """A launch's modeled time, µs: the larger of its DRAM time (``total_bytes`` at the family's
    bandwidth) and its step chain at one :data:`LATENCY_US` a dependent round trip: waves of
    resident CTAs x the steps a program walks x round trips a step, plus, split, the combine's
    (one, then one a :data:`COMBINE_SPLIT_BLOCK` splits)."""
    waves = cdiv(programs * splits, family.num_sms * ctas_per_sm)
    chain = waves * steps_per_split * round_trips_per_step
    if splits > 1:
        chain += 1 + cdiv(splits, COMBINE_SPLIT_BLOCK)
    return max(family.seconds(total_bytes) * 1e6, chain * LATENCY_US)


def split_rule(family: ArchFamily, *, programs: int, ctas_per_sm: int, blocks: int, max_splits: int,
               traffic_of: Callable[[int, int], Traffic], round_trips_per_step: int = 1,
               balanced: bool = False) -> tuple[int, int, str]:
    """Splits for a call of ``programs`` (token, head block) pairs over ``blocks`` candidate steps.

    The wave: up to as many splits as fill the family's resident CTA slots once (at most one step
    a split and ``max_splits``). The budget: splitting may add at most the smaller of the unsplit
    cache bytes and the larger of :data:`EXTRA_FRACTION` of the unsplit bytes and what the GPU
    moves in :data:`LATENCY_US`. Of the split counts whose extra bytes fit, the one with the
    shortest modeled time (:func:`launch_time_us`) wins, the most splits among equals (they fill
    more of the wave at no modeled cost).

    :param traffic_of: ``(num_splits, blocks_per_split) -> Traffic`` of the family's launches.
    :param round_trips_per_step: dependent DRAM round trips a program's step waits for (1 where
        the kernel prefetches the next step's ids, 2 where it loads ids, then the rows they name).
    :param balanced: the kernel cuts ``blocks`` into ``num_splits`` ranges differing by at most one
        step (any count up to ``blocks``); otherwise ranges of ``blocks_per_split`` (:func:`cut`).
    :returns: ``(num_splits, blocks_per_split, why)``; ``blocks_per_split`` is the longest range.
    """
    slots = family.num_sms * ctas_per_sm
    wave = min(cdiv(slots, programs), blocks, max_splits)
    unsplit = traffic_of(1, blocks)
    budget = min(unsplit.cache, max(EXTRA_FRACTION * unsplit.total, family.latency_bytes))

    def timed(splits: int, per_split: int, total: int) -> float:
        return launch_time_us(family, total, programs=programs, ctas_per_sm=ctas_per_sm, splits=splits,
                              steps_per_split=per_split, round_trips_per_step=round_trips_per_step)

    best = (timed(1, blocks, unsplit.total), 1, blocks, 0)
    over_budget = 0
    for wanted in range(2, wave + 1):
        splits, per_split = (wanted, cdiv(blocks, wanted)) if balanced else cut(blocks, wanted)
        if splits <= best[1]:
            continue
        extra = traffic_of(splits, per_split).total - unsplit.total
        if extra > budget:
            over_budget += 1
            continue
        time_us = timed(splits, per_split, unsplit.total + extra)
        if time_us <= best[0]:
            best = (time_us, splits, per_split, extra)
    time_us, splits, per_split, extra = best
    if splits > 1:
        noun = "program" if programs == 1 else "programs"
        why = (f"{splits} splits ({programs} {noun} x {splits} for {slots} CTA slots), modeled {time_us:.1f} µs; "
               f"splitting adds {extra / 1e6:.2f} of <= {budget / 1e6:.2f} MB")
    elif wave <= 1:
        why = f"{programs} programs fill {slots} CTA slots"
    else:
        why = (f"no split is faster in the model ({time_us:.1f} µs unsplit)" if over_budget < wave - 1
               else f"no split fits the byte budget ({budget / 1e6:.2f} MB)")
    return splits, per_split, why
