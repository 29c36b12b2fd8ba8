"""How the DeepSeek-V4 kernel cuts a call into programs, and what bounds each cut (pure Python).

A program takes one query token, ``block_h`` heads and one *split*: a range of the call's candidates
read as one list, the window's index row (``W`` ids, in whole ``block_n`` steps) followed by the
compressed cache's (``E``), cut into ``num_splits`` ranges of whole steps differing by at most one
step. The split count comes from the rule the DSA plans use
(:func:`~mla_sm120_plugin.kernels.shared.launch_plan.split_rule`), evaluated at the call's shapes:
tokens, heads, the two index widths (never their live lengths) and the GPU family, so a captured
graph replays the same grid.

The model (:func:`modeled`) counts the three things that bound a launch: what DRAM moves
(:func:`traffic`: a request's rows once across its tokens, L2 serving the rest), what the tensor
cores do (the MMAs a step of the compiled kernel issues, :class:`Compiled`, at the SM's rate for
each kind) and the step chain (the round trips a program waits for, its steps' compute, the waves,
the combine). :func:`json_report` / :func:`format_report` are what ``mla-sm120 bench --traffic``
prints. Sources of every constant: docs/kernels.md, section ``kernels/dsv4/plan.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from mla_sm120_plugin.kernels.dsv4 import layout
from mla_sm120_plugin.kernels.shared.host import cdiv
from mla_sm120_plugin.kernels.shared.launch_plan import (
    DEFAULT_FAMILY, FAMILIES, LATENCY_US, ArchFamily, Traffic, launch_time_us, split_rule,
)

KERNEL = "triton_dsv4"
# The combine merges 32 splits a step (launch_plan.COMBINE_SPLIT_BLOCK), so splits are bounded by
# the wave (and the model's time), not by a walk over them; this only caps the grid's second axis.
MAX_SPLITS = 1024
# The round trip before a program's first step (its first ids; every later step's ids are loaded a
# step ahead, so a step waits for its rows alone, or for nothing when they were loaded a step ahead).
FILL_ROUND_TRIPS = 1
ROUND_TRIPS_PER_STEP = 1
# Split counts up to two waves of resident CTAs are tried: 64 tokens of 32 heads are 128 programs, on
# 340 slots a split of 2 leaves 84 SMs with one CTA, one of 5 fills two waves.
MAX_WAVES = 2
_PARTIAL_ROW = layout.HEAD_DIM * 4 + 4  # an fp32 partial row and its LSE, a head


@dataclass(frozen=True)
class Dsv4Config:
    """A launch's shape: heads a program, candidates a step, warps, pipelining depth, and the split.

    num_splits: candidate ranges per (token, head block); 1 writes ``out`` directly
    blocks_per_split: ``block_n`` steps a range (0 with one split: the whole row)
    maxnreg: register cap handed to ptxas (None: its own choice)
    """

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 1
    num_splits: int = 1
    blocks_per_split: int = 0
    maxnreg: int | None = None

    def split(self, num_splits: int, blocks_per_split: int) -> "Dsv4Config":
        return replace(self, num_splits=num_splits, blocks_per_split=blocks_per_split if num_splits > 1 else 0)

    def steps(self, window: int, compressed: int = 0) -> int:
        """``block_n`` steps a call walks over a window row of ``window`` ids and a compressed row of
        ``compressed`` (each row in whole steps: a step reads one cache; at least one step)."""
        return max(cdiv(window, self.block_n) + cdiv(compressed, self.block_n), 1)

    def chunk(self, window: int, compressed: int = 0) -> int:
        """Candidate positions a range holds (all of the call's, unsplit)."""
        steps = self.blocks_per_split if self.num_splits > 1 else self.steps(window, compressed)
        return steps * self.block_n


@dataclass(frozen=True)
class Compiled:
    """What one step of a program (``block_n`` candidates, ``block_h`` heads) costs in the sm_120a
    code the compile gate reads (Triton 3.8, its bundled ptxas; the split two-cache variant, the one
    decode runs; tests/tools/test_compile_gate.py holds every variant to these numbers).

    mma: SASS MMA instructions a step, the whole CTA's, by kind
    instructions: warp instructions a step (the loop body's, times the warps)
    """

    mma: dict
    instructions: int

    def step_clocks(self, family: ArchFamily) -> float:
        """SM clocks a step takes with the SM to itself: the tensor cores' time for its MMAs or the
        schedulers' for its instructions, whichever is longer (they overlap)."""
        return max(family.mma_cycles(self.mma), self.instructions / family.issue_per_clock)


@dataclass(frozen=True)
class Dsv4Shape:
    """The kernel's block shape for one record, the CTAs per SM the compile gate reads for it, and
    what a step of its compiled code costs."""

    record: str
    config: Dsv4Config
    ctas_per_sm: dict
    compiled: Compiled = field(default_factory=lambda: Compiled({}, 0))

    @property
    def pipelined(self) -> bool:
        """Whether a program's next step's rows load while this step computes (Triton's pipeliner,
        two stages: the ids come a step earlier still)."""
        return self.config.num_stages >= 2


# Both records: 16 heads x 32 candidates a step in 4 warps, the score dot [16, 32] one n8 tile a
# warp and the weighted sum [16, 64] pieces two a warp, so no warp repeats another's MMA (8 HMMA a
# candidate, 16 heads: 2 x 16 x 512 flops). fp8 (sm_120a / sm_121a): 172-176 registers, 22,528 B
# of shared memory, 2 CTAs an SM; at two stages it needs 50,176 B (+ 1 KB static), over the
# two-CTA limit, so its rows load while the SM's other CTA computes. NVFP4: two stages, 40,064 B,
# 166-222 registers, 2 CTAs an SM; its rows load a step ahead. (No register cap: on sm_120a any cap
# makes every variant spill 32-64 bytes; on sm_90a the variants build at 168-176 without one.)
SHAPES = {
    layout.FP8_DSV4: Dsv4Shape(
        layout.FP8_DSV4, Dsv4Config(num_stages=1), {"sm120": 2, "sm121": 2, "sm90": 2},
        Compiled({"HMMA.16816.F32": 112, "HMMA.16816.F32.BF16": 144}, 4 * 1433)),
    layout.NVFP4_DSV4: Dsv4Shape(
        layout.NVFP4_DSV4, Dsv4Config(num_stages=2), {"sm120": 2, "sm121": 2, "sm90": 3},
        Compiled({"HMMA.16816.F32": 224, "HMMA.16816.F32.BF16": 32}, 4 * 1717)),
}


def shape_of(record: layout.Dsv4Record) -> Dsv4Shape:
    """The block shape for caches of ``record``."""
    return SHAPES[record.name]


def request_count(num_tokens: int, requests: int | None) -> int:
    """The requests a call's tokens are: ``requests`` within 1 .. ``num_tokens``; None: one a token."""
    return max(1, min(requests or num_tokens, num_tokens))


def request_rows(num_tokens: int, window: int, compressed: int, requests: int | None = None) -> int:
    """Distinct rows the call's tokens read, ``requests`` requests of consecutive tokens (None: one a
    token, the most a call reads): a request's windows overlap (``n + W - 1`` rows for ``n``
    consecutive tokens) and its compressed rows are one set (exact for a C128A layer, whose tokens
    all attend every compressed entry; an upper bound on the reuse for a C4A one, whose indexer picks
    per token)."""
    requests = request_count(num_tokens, requests)
    rows = 0
    for r in range(requests):
        n = num_tokens // requests + (r < num_tokens % requests)
        rows += min(n * window, n + window - 1) + (compressed if n else 0)
    return rows


def traffic(cfg: Dsv4Config, num_tokens: int, num_heads: int, window: int, compressed: int,
            record: layout.Dsv4Record = layout.FP8_RECORD, family_name: str = DEFAULT_FAMILY,
            requests: int | None = None) -> Traffic:
    """Bytes the launches of ``cfg`` move for a [T, H, 512] bf16 q over ``window`` + ``compressed``
    candidates a token, every one valid (the most a call reads); bf16 out, fp32 partials.

    DRAM moves each distinct row once (:func:`request_rows`: a request's tokens, and a token's head
    blocks, run side by side as grid neighbours and read the same rows; L2 serves the repeats), the
    ids, q and out once; L2 serves every further read of a row or of q (each split reloads its
    heads) and the split partials, written and read back, while they take at most a quarter of the
    family's L2 (otherwise they are DRAM traffic). ``minimum``: the same with one split."""
    candidates = window + compressed
    head_blocks = cdiv(num_heads, cfg.block_h)
    row = num_heads * layout.HEAD_DIM * 2
    distinct = request_rows(num_tokens, window, compressed, requests) * record.token_bytes
    reads = num_tokens * candidates * record.token_bytes
    partials = num_tokens * cfg.num_splits * num_heads * _PARTIAL_ROW * 2 if cfg.num_splits > 1 else 0
    resident = partials // 2 <= FAMILIES[family_name].l2_bytes // 4
    return Traffic(
        cache=distinct,
        q=num_tokens * row,
        indices=num_tokens * candidates * 4,
        partials=0 if resident else partials,
        output=num_tokens * row,
        minimum=distinct + num_tokens * (candidates * 4 + 2 * row),
        l2=head_blocks * reads - distinct + (head_blocks - 1) * num_tokens * candidates * 4
        + num_tokens * (cfg.num_splits - 1) * row + (partials if resident else 0),
    )


def step_us(shape: Dsv4Shape, family: ArchFamily) -> float:
    """A step's compute, µs, a CTA alone on an SM of ``family`` (:meth:`Compiled.step_clocks`)."""
    return family.clocks_us(shape.compiled.step_clocks(family))


@functools.lru_cache(maxsize=4096)
def choose(record_name: str, num_tokens: int, num_heads: int, window: int, compressed: int,
           family_name: str = DEFAULT_FAMILY) -> tuple[Dsv4Config, str]:
    """The config of one call (index widths ``window`` and ``compressed``) and why: the shared rule
    by this model's time (its bytes at one request a token, the most a call reads); a pure function
    of shapes, cached (no autotuning at serve time)."""
    shape, family = SHAPES[record_name], FAMILIES[family_name]
    record = layout.RECORDS[record_name]
    blocks = shape.config.steps(window, compressed)
    splits, per_split, why = split_rule(
        family, programs=max(num_tokens, 1) * cdiv(num_heads, shape.config.block_h),
        ctas_per_sm=shape.ctas_per_sm[family_name], blocks=blocks, max_splits=MAX_SPLITS,
        traffic_of=lambda s, per: traffic(shape.config.split(s, per), num_tokens, num_heads, window, compressed,
                                          record, family_name),
        round_trips_per_step=ROUND_TRIPS_PER_STEP, balanced=True, step_us=step_us(shape, family),
        pipelined=shape.pipelined, fill_round_trips=FILL_ROUND_TRIPS, max_waves=MAX_WAVES)
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
    and into at most ``MAX_WAVES x cdiv(slots, programs)`` ranges, so a split call has fewer than
    ``2 x MAX_WAVES x slots`` (token, head block, range) programs, each with ``block_h`` partial
    rows. A call forced past its plan (``num_splits=`` /
    ``MLA_SM120_SPLITS``) may need more; it then allocates.
    """
    names = FAMILIES if family_name is None else (family_name,)
    return max((2 * MAX_WAVES * FAMILIES[f].num_sms * shape.ctas_per_sm[f] - 2) * shape.config.block_h * _PARTIAL_ROW
               for f in names for shape in SHAPES.values())


def launch_config(record: layout.Dsv4Record, num_tokens: int, num_heads: int, window: int, compressed: int,
                  family_name: str = DEFAULT_FAMILY) -> Dsv4Config:
    """:func:`choose`'s config for a call over caches of ``record``."""
    return choose(record.name, num_tokens, num_heads, window, compressed, family_name)[0]


def forced(record: layout.Dsv4Record, num_splits: int, window: int, compressed: int) -> Dsv4Config:
    """The record's block shape cut into ``num_splits`` ranges of whole steps (as many as there are
    steps, where fewer): what a forced plan runs."""
    base = shape_of(record).config
    steps = base.steps(window, compressed)
    splits = min(num_splits, steps)
    return base.split(splits, cdiv(steps, splits))


def modeled(cfg: Dsv4Config, family: ArchFamily, num_tokens: int, num_heads: int, window: int, compressed: int,
            ctas_per_sm: int, record: layout.Dsv4Record = layout.FP8_RECORD, requests: int | None = None) -> dict:
    """What a launch costs, by the terms that bound it: ``dram_us`` (:func:`traffic` at the family's
    bandwidth), ``mma_us`` (the compiled MMAs of every step of every program at the SM's rate for
    their kind, the whole GPU busy), ``issue_us`` (the same for its instructions at one a scheduler
    a clock), ``chain_us`` (:func:`~..shared.launch_plan.launch_time_us`'s step chain: waves x (the
    first ids' round trip + steps x a step's time) + the combine's) and ``modeled_us``, the larger
    of DRAM and the chain (the chain holds the compute: a step is never shorter than its CTAs'
    MMAs); ``bound``: which term it is, and ``ratio``: modeled over the larger of DRAM and MMA."""
    shape = SHAPES[record.name]
    steps = cfg.steps(window, compressed)
    per_split = cfg.blocks_per_split or steps
    programs = max(num_tokens, 1) * cdiv(num_heads, cfg.block_h)
    total = traffic(cfg, num_tokens, num_heads, window, compressed, record, family.name, requests).total
    dram_us = family.seconds(total) * 1e6
    work_steps = programs * steps  # every step of every (token, head block), split or not
    mma_us = family.clocks_us(work_steps * family.mma_cycles(shape.compiled.mma)) / family.num_sms
    issue_us = family.clocks_us(work_steps * shape.compiled.instructions / family.issue_per_clock) / family.num_sms
    chain_us = launch_time_us(family, 0, programs=programs, ctas_per_sm=ctas_per_sm, splits=cfg.num_splits,
                              steps_per_split=per_split, round_trips_per_step=ROUND_TRIPS_PER_STEP,
                              step_us=step_us(shape, family), pipelined=shape.pipelined,
                              fill_round_trips=FILL_ROUND_TRIPS)
    modeled_us = max(dram_us, chain_us)
    return dict(programs=programs * cfg.num_splits,
                waves=cdiv(programs * cfg.num_splits, family.num_sms * ctas_per_sm),
                dram_us=round(dram_us, 3), mma_us=round(mma_us, 3), issue_us=round(issue_us, 3),
                chain_us=round(chain_us, 3), modeled_us=round(modeled_us, 3),
                bound="dram" if dram_us >= chain_us else "chain",
                ratio=round(modeled_us / max(dram_us, mma_us), 3))


# The shapes the split issue names: (tokens, heads, window, compressed): C4A 128 + 512, C128A 128 + 8192.
MUST_SHOW = [(t, h, 128, e) for t in (1, 6, 64) for h in (8, 16, 64, 128) for e in (512, 8192)]
BATCH_TOKENS = 64  # the shapes' batched decode: one token a request


def requests_of(tokens: int) -> int:
    """Requests a modeled or benchmarked shape's tokens are: :data:`BATCH_TOKENS` is a batched decode
    of one token a request, every other shape one request (a decode step, a verify, a prefill chunk)."""
    return tokens if tokens == BATCH_TOKENS else 1


# Issue 51's shapes, (tokens, heads, window, compressed, requests): an MTP / DSpark verify of 2-6
# rows of one request, a batched decode of 64 requests, prefill chunks of one request; with
# MUST_SHOW's shapes of at most 32 heads (T = 1 / 6: one request; T = 64: 64).
SPEED_SHAPES = sorted({(t, h, 128, e, requests_of(t)) for t in (2, 4, 6, BATCH_TOKENS, 512, 2048, 8192)
                       for h in (16, 32) for e in (512, 8192)}
                      | {(t, h, w, e, requests_of(t)) for t, h, w, e in MUST_SHOW if h <= 32})
PREFILL_TOKENS = 512  # from here a shape is a prefill chunk: its bar is 1.5x, a decode's 1.3x
HEAD_BUCKETS = (8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 6, 8, 16, 32, 64)
CANDIDATE_ROWS = ((128, 0), (128, 512), (128, 1024), (128, 2048), (128, 4096), (128, 8192))


def plan_report(record_name: str, num_tokens: int, num_heads: int, window: int, compressed: int,
                family_name: str = DEFAULT_FAMILY, requests: int | None = None) -> dict:
    """The config a call gets, why, its traffic and its model's terms beside the unsplit launch's."""
    shape, family, record = SHAPES[record_name], FAMILIES[family_name], layout.RECORDS[record_name]
    cfg, why = choose(record_name, num_tokens, num_heads, window, compressed, family_name)
    ctas = shape.ctas_per_sm[family_name]
    return dict(
        kernel=KERNEL, record=record_name, family=family_name, num_tokens=num_tokens, num_heads=num_heads,
        candidates=dict(window=window, compressed=compressed, total=window + compressed),
        requests=request_count(num_tokens, requests),
        num_splits=cfg.num_splits, chunk=cfg.chunk(window, compressed),
        block_h=cfg.block_h, block_n=cfg.block_n, ctas_per_sm=ctas, reason=why,
        traffic=traffic(cfg, num_tokens, num_heads, window, compressed, record, family_name, requests).as_dict(),
        modeled=modeled(cfg, family, num_tokens, num_heads, window, compressed, ctas, record, requests),
        unsplit=modeled(shape.config, family, num_tokens, num_heads, window, compressed, ctas, record, requests),
    )


def json_report(family_name: str = DEFAULT_FAMILY) -> dict:
    """Each record's plans for :data:`MUST_SHOW` (one request a token) and :data:`SPEED_SHAPES`,
    and its split table (rows: heads, tokens, window, compressed, splits, chunk) for one family, as
    data."""
    family = FAMILIES[family_name]
    tables = {}
    for name in SHAPES:
        tables[name] = [dict(heads=h, tokens=t, window=w, compressed=e, splits=cfg.num_splits, chunk=cfg.chunk(w, e))
                        for h in HEAD_BUCKETS for t in ROW_BUCKETS for w, e in CANDIDATE_ROWS
                        for cfg in [choose(name, t, h, w, e, family_name)[0]]]
    return dict(family=family_name, part=family.part, num_sms=family.num_sms, bandwidth_gbps=family.bandwidth_gbps,
                clock_ghz=family.clock_ghz, latency_us=LATENCY_US,
                compiled={name: dict(mma=shape.compiled.mma, instructions=shape.compiled.instructions,
                                     block_h=shape.config.block_h, block_n=shape.config.block_n,
                                     stages=shape.config.num_stages, ctas_per_sm=shape.ctas_per_sm[family_name])
                          for name, shape in SHAPES.items()},
                plans=[plan_report(name, *shape, family_name) for name in SHAPES for shape in MUST_SHOW],
                speed=[plan_report(name, t, h, w, e, family_name, requests) for name in SHAPES
                       for t, h, w, e, requests in SPEED_SHAPES],
                tables=tables)


def format_report(family_name: str = DEFAULT_FAMILY) -> str:
    """:data:`SPEED_SHAPES`' plans as text: each term of :func:`modeled` (µs), the split, the bound."""
    family = FAMILIES[family_name]
    lines = [f"{KERNEL} on {family_name} ({family.part}, {family.num_sms} SMs, {family.bandwidth_gbps:.0f} GB/s, "
             f"{family.clock_ghz:g} GHz); µs; req = requests (a request's tokens read its rows once); "
             f"modeled = max(DRAM, chain: waves x ({FILL_ROUND_TRIPS} + steps x a step) x {LATENCY_US:g} µs a "
             f"round trip, a step's compute at least its CTAs' MMAs); ratio = modeled / max(DRAM, MMA)"]
    lines.append(f"{'record':<11}{'T':>5}{'H':>4}{'W+E':>10}{'req':>5}{'splits':>7}{'programs':>9}{'DRAM':>9}"
                 f"{'MMA':>9}{'issue':>9}{'chain':>9}{'modeled':>9}{'ratio':>7}  bound")
    for name in SHAPES:
        for t, h, w, e, requests in SPEED_SHAPES:
            r = plan_report(name, t, h, w, e, family_name, requests)
            m = r["modeled"]
            lines.append(f"{name:<11}{t:>5}{h:>4}{f'{w}+{e}':>10}{r['requests']:>5}{r['num_splits']:>7}"
                         f"{m['programs']:>9}{m['dram_us']:>9.1f}{m['mma_us']:>9.1f}{m['issue_us']:>9.1f}"
                         f"{m['chain_us']:>9.1f}{m['modeled_us']:>9.1f}{m['ratio']:>7.2f}  {m['bound']}")
    return "\n".join(lines)
