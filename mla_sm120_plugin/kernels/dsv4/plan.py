"""How the DeepSeek-V4 kernel cuts a call into programs, and the bytes each cut moves (pure Python).

A program takes one query token, ``block_h`` heads and one *split*: a range of the call's candidates
read as one list, the window's index row (``W`` ids) followed by the compressed cache's (``E``), cut
into ``num_splits`` ranges of whole ``block_n`` steps differing by at most one step. The split count
comes from the rule the DSA plans use (:func:`~mla_sm120_plugin.kernels.shared.launch_plan.split_rule`),
evaluated at the call's shapes: tokens, heads, the two index widths (never their live lengths) and
the GPU family, so a captured graph replays the same grid. :func:`traffic` counts what DRAM and L2
move; :func:`json_report` is what ``mla-sm120 bench --traffic`` prints.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from mla_sm120_plugin.kernels.dsv4 import layout
from mla_sm120_plugin.kernels.shared.host import cdiv
from mla_sm120_plugin.kernels.shared.launch_plan import (
    DEFAULT_FAMILY, FAMILIES, LATENCY_US, ArchFamily, Traffic, launch_time_us, split_rule,
)

KERNEL = "triton_dsv4"
# The combine merges 32 splits a step (launch_plan.COMBINE_SPLIT_BLOCK), so splits are bounded by
# the wave (and the model's time), not by a walk over them; this only caps the grid's second axis.
MAX_SPLITS = 1024
# A step loads its index row, then the rows the ids name: two dependent round trips (the kernel
# runs one stage and does not prefetch the next step's ids, as the DSA kernels do).
ROUND_TRIPS_PER_STEP = 2
_PARTIAL_ROW = layout.HEAD_DIM * 4 + 4  # an fp32 partial row and its LSE, a head


@dataclass(frozen=True)
class Dsv4Config:
    """A launch's shape: heads a program, candidates a step, warps, pipelining depth, and the split.

    num_splits: candidate ranges per (token, head block); 1 writes ``out`` directly
    blocks_per_split: ``block_n`` steps a range (0 with one split: the whole row)
    maxnreg: register cap handed to ptxas for the unsplit two-cache launch (None: its own choice)
    """

    block_h: int = 16
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 1
    num_splits: int = 1
    blocks_per_split: int = 0
    maxnreg: int | None = None

    def split(self, num_splits: int, blocks_per_split: int) -> "Dsv4Config":
        return replace(self, num_splits=num_splits, blocks_per_split=blocks_per_split if num_splits > 1 else 0)

    def steps(self, candidates: int) -> int:
        """``block_n`` steps a call of ``candidates`` a token walks (at least one)."""
        return cdiv(max(candidates, 1), self.block_n)

    def chunk(self, candidates: int) -> int:
        """Candidates a range holds for a call of ``candidates`` a token (all of them unsplit)."""
        return self.blocks_per_split * self.block_n if self.num_splits > 1 else max(candidates, 1)


@dataclass(frozen=True)
class Dsv4Shape:
    """The kernel's fixed block shape for one record, and the CTAs per SM the compile gate reads for it."""

    record: str
    config: Dsv4Config
    ctas_per_sm: dict


# fp8: 2 CTAs of 4 warps an SM (167 registers). NVFP4: its e2m1 decode keeps more values live; at 4
# warps the [16, 512] key tile spills (255 registers), at 8 it fits, and capped at 128 registers (no
# spill) two CTAs of 8 warps stay resident: one CTA (156 registers, two caches) kept 6 KB in flight,
# under the 10.5 KB an RTX 5090 SM moves in a DRAM latency (the compile gate's residency rule).
SHAPES = {
    layout.FP8_DSV4: Dsv4Shape(layout.FP8_DSV4, Dsv4Config(num_warps=4), {"sm120": 2, "sm121": 2, "sm90": 2}),
    layout.NVFP4_DSV4: Dsv4Shape(layout.NVFP4_DSV4, Dsv4Config(num_warps=8, maxnreg=128),
                                 {"sm120": 2, "sm121": 2, "sm90": 1}),
}


def shape_of(record: layout.Dsv4Record) -> Dsv4Shape:
    """The block shape for caches of ``record``."""
    return SHAPES[record.name]


def traffic(cfg: Dsv4Config, num_tokens: int, num_heads: int, window: int, compressed: int,
            record: layout.Dsv4Record = layout.FP8_RECORD, family_name: str = DEFAULT_FAMILY) -> Traffic:
    """Bytes the launches of ``cfg`` move for a [T, H, 512] bf16 q over ``window`` + ``compressed``
    candidates a token, every one valid and distinct (the most a call reads); bf16 out, fp32 partials.

    DRAM moves a token's rows and ids once (its head blocks are grid neighbours, run side by side
    and walk the same rows: L2 serves the others), q and out once; L2 serves every further read of
    q (each split reloads its heads) and the split partials, written and read back, while they take
    at most a quarter of the family's L2 (otherwise they are DRAM traffic)."""
    candidates = window + compressed
    head_blocks = cdiv(num_heads, cfg.block_h)
    row = num_heads * layout.HEAD_DIM * 2
    rows = num_tokens * candidates * record.token_bytes
    partials = num_tokens * cfg.num_splits * num_heads * _PARTIAL_ROW * 2 if cfg.num_splits > 1 else 0
    resident = partials // 2 <= FAMILIES[family_name].l2_bytes // 4
    return Traffic(
        cache=rows,
        q=num_tokens * row,
        indices=num_tokens * candidates * 4,
        partials=0 if resident else partials,
        output=num_tokens * row,
        minimum=num_tokens * (candidates * (record.token_bytes + 4) + 2 * row),
        l2=(head_blocks - 1) * (rows + num_tokens * candidates * 4) + num_tokens * (cfg.num_splits - 1) * row
        + (partials if resident else 0),
    )


@functools.lru_cache(maxsize=4096)
def choose(record_name: str, num_tokens: int, num_heads: int, window: int, compressed: int,
           family_name: str = DEFAULT_FAMILY) -> tuple[Dsv4Config, str]:
    """The config of one call (index widths ``window`` and ``compressed``) and why; a pure function
    of shapes, cached (no autotuning at serve time)."""
    shape, family = SHAPES[record_name], FAMILIES[family_name]
    record = layout.RECORDS[record_name]
    blocks = shape.config.steps(window + compressed)
    splits, per_split, why = split_rule(
        family, programs=max(num_tokens, 1) * cdiv(num_heads, shape.config.block_h),
        ctas_per_sm=shape.ctas_per_sm[family_name], blocks=blocks, max_splits=MAX_SPLITS,
        traffic_of=lambda s, per: traffic(shape.config.split(s, per), num_tokens, num_heads, window, compressed,
                                          record, family_name),
        round_trips_per_step=ROUND_TRIPS_PER_STEP, balanced=True)
    return shape.config.split(splits, per_split), why


def scratch_bytes(num_tokens: int, num_heads: int, num_splits: int) -> int:
    """Bytes a call's split partials take: fp32 ``[T, S, H, 512]`` and their LSE ``[T, S, H]`` (0 unsplit)."""
    if num_splits <= 1:
        return 0
    return num_tokens * num_splits * num_heads * _PARTIAL_ROW


def scratch_bound(family_name: str | None = None) -> int:
    """The most partial bytes any planned call takes, whatever its tokens, heads or widths (on
    ``family_name``'s plans; every family's by default): what an engine preallocates once.

    Why it is finite: the rule splits only while a wave has CTA slots left (``programs < slots``)
    and into at most ``cdiv(slots, programs)`` ranges, so a split call has fewer than
    ``2 x slots`` (token, head block, range) programs, each with ``block_h`` partial rows. A call
    forced past its plan (``num_splits=`` / ``MLA_SM120_SPLITS``) may need more; it then allocates.
    """
    names = FAMILIES if family_name is None else (family_name,)
    return max((2 * FAMILIES[f].num_sms * shape.ctas_per_sm[f] - 2) * shape.config.block_h * _PARTIAL_ROW
               for f in names for shape in SHAPES.values())


def launch_config(record: layout.Dsv4Record, num_tokens: int, num_heads: int, window: int, compressed: int,
                  family_name: str = DEFAULT_FAMILY) -> Dsv4Config:
    """:func:`choose`'s config for a call over caches of ``record``."""
    return choose(record.name, num_tokens, num_heads, window, compressed, family_name)[0]


def forced(record: layout.Dsv4Record, num_splits: int, window: int, compressed: int) -> Dsv4Config:
    """The record's block shape cut into ``num_splits`` ranges of whole steps (as many as there are
    steps, where fewer): what a forced plan runs."""
    base = shape_of(record).config
    steps = base.steps(window + compressed)
    splits = min(num_splits, steps)
    return base.split(splits, cdiv(steps, splits))


def modeled(cfg: Dsv4Config, family: ArchFamily, num_tokens: int, num_heads: int, window: int, compressed: int,
            ctas_per_sm: int, record: layout.Dsv4Record = layout.FP8_RECORD) -> dict:
    """What a launch costs in the model the rule chooses by: its DRAM time (bytes / the family's
    bandwidth) and its step chain (waves x the longest range's steps x two round trips, plus the
    combine's), the larger of the two (:func:`~..shared.launch_plan.launch_time_us`)."""
    per_split = cfg.blocks_per_split or cfg.steps(window + compressed)
    programs = max(num_tokens, 1) * cdiv(num_heads, cfg.block_h)
    total = traffic(cfg, num_tokens, num_heads, window, compressed, record, family.name).total
    return dict(programs=programs * cfg.num_splits, waves=cdiv(programs * cfg.num_splits, family.num_sms * ctas_per_sm),
                dram_us=round(family.seconds(total) * 1e6, 3),
                modeled_us=round(launch_time_us(family, total, programs=programs, ctas_per_sm=ctas_per_sm,
                                                splits=cfg.num_splits, steps_per_split=per_split,
                                                round_trips_per_step=ROUND_TRIPS_PER_STEP), 3))


# The shapes the split issue names: (tokens, heads, window, compressed): C4A 128 + 512, C128A 128 + 8192.
MUST_SHOW = [(t, h, 128, e) for t in (1, 6, 64) for h in (8, 16, 64, 128) for e in (512, 8192)]
HEAD_BUCKETS = (8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 6, 8, 16, 32, 64)
CANDIDATE_ROWS = ((128, 0), (128, 512), (128, 1024), (128, 2048), (128, 4096), (128, 8192))


def plan_report(record_name: str, num_tokens: int, num_heads: int, window: int, compressed: int,
                family_name: str = DEFAULT_FAMILY) -> dict:
    """The config a call gets, why, its traffic and its modeled time beside the unsplit launch's."""
    shape, family, record = SHAPES[record_name], FAMILIES[family_name], layout.RECORDS[record_name]
    cfg, why = choose(record_name, num_tokens, num_heads, window, compressed, family_name)
    ctas = shape.ctas_per_sm[family_name]
    return dict(
        kernel=KERNEL, record=record_name, family=family_name, num_tokens=num_tokens, num_heads=num_heads,
        candidates=dict(window=window, compressed=compressed, total=window + compressed),
        num_splits=cfg.num_splits, chunk=cfg.chunk(window + compressed),
        block_h=cfg.block_h, block_n=cfg.block_n, ctas_per_sm=ctas, reason=why,
        traffic=traffic(cfg, num_tokens, num_heads, window, compressed, record, family_name).as_dict(),
        modeled=modeled(cfg, family, num_tokens, num_heads, window, compressed, ctas, record),
        unsplit=modeled(shape.config, family, num_tokens, num_heads, window, compressed, ctas, record),
    )


def json_report(family_name: str = DEFAULT_FAMILY) -> dict:
    """Each record's plans for :data:`MUST_SHOW` and its split table (rows: heads, tokens, window,
    compressed, splits, chunk) for one family, as data."""
    family = FAMILIES[family_name]
    tables = {}
    for name in SHAPES:
        tables[name] = [dict(heads=h, tokens=t, window=w, compressed=e, splits=cfg.num_splits, chunk=cfg.chunk(w + e))
                        for h in HEAD_BUCKETS for t in ROW_BUCKETS for w, e in CANDIDATE_ROWS
                        for cfg in [choose(name, t, h, w, e, family_name)[0]]]
    return dict(family=family_name, part=family.part, num_sms=family.num_sms, bandwidth_gbps=family.bandwidth_gbps,
                latency_us=LATENCY_US, plans=[plan_report(name, *shape, family_name) for name in SHAPES
                                              for shape in MUST_SHOW], tables=tables)


def format_report(family_name: str = DEFAULT_FAMILY) -> str:
    """:func:`json_report`'s plans as text (bytes in MB; time in µs: :func:`modeled`)."""
    family = FAMILIES[family_name]
    lines = [f"{KERNEL} on {family_name} ({family.part}, {family.num_sms} SMs); MB: DRAM (total, min), L2; ratio = "
             f"DRAM / minimum; µs = max(DRAM / {family.bandwidth_gbps:.0f} GB/s, waves x steps x "
             f"{ROUND_TRIPS_PER_STEP} round trips x {LATENCY_US:g} µs + the combine's)"]
    lines.append(f"{'record':<11}{'T':>4}{'H':>5}{'W+E':>11}{'splits':>7}{'chunk':>6}{'programs':>9}{'total':>9}"
                 f"{'min':>9}{'L2':>8}{'ratio':>7}{'µs':>8}{'unsplit µs':>11}")
    for name in SHAPES:
        for t, h, w, e in MUST_SHOW:
            r = plan_report(name, t, h, w, e, family_name)
            tr = r["traffic"]
            lines.append(f"{name:<11}{t:>4}{h:>5}{f'{w}+{e}':>11}{r['num_splits']:>7}{r['chunk']:>6}"
                         f"{r['modeled']['programs']:>9}{tr['total'] / 1e6:>9.3f}{tr['minimum'] / 1e6:>9.3f}"
                         f"{tr.get('l2', 0) / 1e6:>8.2f}{tr['ratio']:>7.3f}{r['modeled']['modeled_us']:>8.1f}"
                         f"{r['unsplit']['modeled_us']:>11.1f}")
    return "\n".join(lines)
