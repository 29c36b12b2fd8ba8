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
    """A GPU family the tables are computed for: a representative part's SM count and bandwidth, and
    what one of its SMs computes a clock (the models that count compute time read these; the DSA
    plans count bytes and round trips only).

    name: "sm120", "sm121" or "sm90"
    part: the representative GPU
    num_sms: its SM count
    bandwidth_gbps: its DRAM bandwidth, GB/s
    l2_bytes: its L2 cache; a family's model may count bytes written and read back within a call
        (split partials) as L2 traffic while they take at most a quarter of it
    clock_ghz: the clock its peak rates are quoted at
    mma_flops: ``((SASS MMA kind prefix, flops a clock an SM with fp32 accumulation), ...)``, the
        longest matching prefix wins (``QMMA.SF`` before ``QMMA``)
    issue_per_clock: warp instructions an SM issues a clock (one a scheduler)
    """

    name: str
    part: str
    num_sms: int
    bandwidth_gbps: float
    l2_bytes: int
    clock_ghz: float = 0.0
    mma_flops: tuple[tuple[str, int], ...] = ()
    issue_per_clock: int = 4

    def mma_rate(self, kind: str) -> int:
        """Flops a clock an SM runs SASS MMA ``kind`` at (fp32 accumulation)."""
        matches = [(len(prefix), rate) for prefix, rate in self.mma_flops if kind.startswith(prefix)]
        if not matches:
            raise KeyError(f"{self.name} has no rate for {kind!r} (known: {[p for p, _ in self.mma_flops]})")
        return max(matches)[1]

    def mma_cycles(self, counts: dict[str, float]) -> float:
        """SM clocks the MMAs ``{SASS kind: instructions}`` take at the SM's rate for each kind."""
        return sum(n * mma_flops(kind) / self.mma_rate(kind) for kind, n in counts.items())

    def clocks_us(self, clocks: float) -> float:
        """``clocks`` SM clocks, in µs."""
        return clocks / (self.clock_ghz * 1e3)

    @property
    def latency_bytes(self) -> float:
        """Bytes the GPU moves in :data:`LATENCY_US`: below this a launch is latency bound."""
        return self.bandwidth_gbps * 1e9 * LATENCY_US * 1e-6

    def seconds(self, num_bytes: float) -> float:
        """How long moving ``num_bytes`` takes at the part's DRAM bandwidth."""
        return num_bytes / (self.bandwidth_gbps * 1e9)


def mma_flops(kind: str) -> int:
    """Flops one SASS MMA instruction does, from its shape (``HMMA.16816...``: m16 n8 k16, 2 * 16 *
    8 * 16; ``QMMA.SF.16832...``: k32)."""
    for part in kind.split("."):
        if part.isdigit() and len(part) >= 4:
            return 2 * int(part[:2]) * int(part[2]) * int(part[3:])
    raise ValueError(f"no m/n/k shape in the MMA kind {kind!r}")


# What an SM computes a clock, fp32 accumulation. SM12x, from the RTX 5090's datasheet peaks at its
# 2.407 GHz boost over 170 SMs: bf16/f16 209.5 TFLOP/s dense = 512 flops a clock (FACTS §11: ~210),
# fp8 419 = 1024; the plain fp8 mma.sync (QMMA) runs at half of that, the bf16 rate, and only the
# block-scaled one (QMMA.SF) at the full 8-bit rate (triton#11320; QuACK measured the plain fp8 MMA
# at the bf16 rate). GB10 is taken to have the same SM (FACTS §5: one family) at 2.54 GHz: its
# quoted 1 PFLOP/s of sparse fp4 is 500 dense over 48 SMs at the 5090's 4096 fp4 flops a clock.
# sm90: the H200's measured dense bf16 matmul (790 TFLOP/s, FACTS §10, wgmma) at 1.98 GHz over
# 132 SMs, an upper bound for the mma.sync Triton runs at M = 16 there; fp8 is emulated on HMMA.
_SM12X_MMA = (("HMMA", 512), ("QMMA", 512), ("QMMA.SF", 1024))
_MB = 1 << 20
FAMILIES = {
    # RTX PRO 6000: 188 SMs, the same bandwidth, 128 MB of L2
    "sm120": ArchFamily("sm120", "RTX 5090", 170, 1792.0, 96 * _MB, 2.407, _SM12X_MMA),
    # GB10's GPU L2 is not published; 24 MB is assumed (a quarter: 6 MB of partials)
    "sm121": ArchFamily("sm121", "DGX Spark GB10", 48, 273.0, 24 * _MB, 2.54, _SM12X_MMA),
    # the device sweep's GPU (H100: 3350 GB/s)
    "sm90": ArchFamily("sm90", "H200", 132, 4800.0, 50 * _MB, 1.98, (("HMMA", 3023),)),
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
                   steps_per_split: int, round_trips_per_step: int = 1, step_us: float = 0.0,
                   pipelined: bool = False, fill_round_trips: int = 0) -> float:
    """A launch's modeled time, µs: the larger of its DRAM time (``total_bytes`` at the family's
    bandwidth) and its step chain at one :data:`LATENCY_US` a dependent round trip: waves of
    resident CTAs x (the round trips before the first step + the steps a program walks x a step's
    time), plus, split, the combine's (one, then one a :data:`COMBINE_SPLIT_BLOCK` splits).

    A step's time (``step_us``: its compute, one CTA alone on an SM; 0 counts round trips only, the
    DSA plans' model): the round trips it waits for, then its compute (``round_trips_per_step`` x
    the latency + ``step_us``), or with the rows loaded a step ahead (``pipelined``) the larger of
    one latency and its compute; at least the compute of the CTAs that share the SM (``k x
    step_us``, k: the wave's CTAs an SM, at most ``ctas_per_sm``; a last, partial wave has fewer)."""
    slots = family.num_sms * ctas_per_sm

    def wave_us(ctas: int) -> float:  # a wave of ``ctas`` CTAs: each SM shares its compute among its own
        sharing = min(ctas_per_sm, cdiv(ctas, family.num_sms))
        if pipelined:
            step = max(LATENCY_US, sharing * step_us)
        else:
            step = max(round_trips_per_step * LATENCY_US + step_us, sharing * step_us)
        return fill_round_trips * LATENCY_US + steps_per_split * step

    full, tail = divmod(programs * splits, slots)
    chain = full * wave_us(slots) + (wave_us(tail) if tail else 0.0)
    if splits > 1:
        chain += (1 + cdiv(splits, COMBINE_SPLIT_BLOCK)) * LATENCY_US
    return max(family.seconds(total_bytes) * 1e6, chain)


def split_rule(family: ArchFamily, *, programs: int, ctas_per_sm: int, blocks: int, max_splits: int,
               traffic_of: Callable[[int, int], Traffic], round_trips_per_step: int = 1,
               balanced: bool = False, step_us: float = 0.0, pipelined: bool = False,
               fill_round_trips: int = 0, max_waves: int = 1) -> tuple[int, int, str]:
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
    :param step_us, pipelined, fill_round_trips: a step's compute and how its loads overlap it
        (:func:`launch_time_us`; the defaults count round trips only, as the DSA plans do).
    :param max_waves: a call that does not fill one wave tries split counts filling up to this many
        (1: one, the DSA plans'): where its last programs leave SMs idle, more, shorter ranges may
        even the load; a count past one wave is taken only where it is strictly faster.
    :returns: ``(num_splits, blocks_per_split, why)``; ``blocks_per_split`` is the longest range.
    """
    slots = family.num_sms * ctas_per_sm
    one_wave = cdiv(slots, programs)
    wave = min(one_wave * max_waves if programs < slots else one_wave, blocks, max_splits)
    unsplit = traffic_of(1, blocks)
    budget = min(unsplit.cache, max(EXTRA_FRACTION * unsplit.total, family.latency_bytes))

    def timed(splits: int, per_split: int, total: int) -> float:
        return launch_time_us(family, total, programs=programs, ctas_per_sm=ctas_per_sm, splits=splits,
                              steps_per_split=per_split, round_trips_per_step=round_trips_per_step,
                              step_us=step_us, pipelined=pipelined, fill_round_trips=fill_round_trips)

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
        # past one wave only where strictly faster: more waves at the same time are more combine work
        if time_us < best[0] or (time_us == best[0] and wanted <= one_wave):
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
