"""How the DSA Triton kernels cut a call into programs, and the bytes each cut moves (pure Python).

Nothing here imports torch or triton: the table, the rule behind it and the traffic model run on
any machine (``python -m mla_sm120_plugin.kernels.dsa.plan`` prints them).

A program handles one query token, ``block_h`` heads and one *split* (a range of ``chunk`` top-k
candidates, ``block_k`` a step). Each kernel's block shape is fixed (:data:`EXACT`, :data:`FAST`,
with the CTAs per SM the compile gate reads for it), so only the split count is chosen, per (arch
family, heads bucket, token bucket, top-k bucket), by one rule (:func:`choose_chunk`), evaluated
once into :func:`table`: fill one wave of resident CTAs, pay for splits only in bytes that cost
no time, whole ``block_k`` steps per split and at most :data:`MAX_SPLITS`. :func:`traffic` counts
the bytes a launch plan moves with nothing reused across programs, for any cache layout
(:func:`row_bytes_read`); the table is chosen once per kernel, family and layout.

The rule in full, the compiled shapes behind the block sizes, and the traffic bounds: docs/kernels.md,
section ``kernels/dsa/plan.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.shared.host import cdiv
# The rule and the GPU families are shared with DeepSeek-V4's plan; re-exported under their names here.
from mla_sm120_plugin.kernels.shared.launch_plan import (  # noqa: F401
    DEFAULT_FAMILY, EXTRA_FRACTION, FAMILIES, LATENCY_US, ArchFamily, Traffic, bucket as _bucket, gpu_family,
    split_rule,
)

# The combine merges COMBINE_SPLIT_BLOCK (32) splits a step, one program a (token, head, 128 columns),
# so 64 splits are two of its steps; the wave and the byte budget bind before this cap in every table.
MAX_SPLITS = 64

_PARTIAL_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is cut into programs.

    block_h: heads a program handles (tl.dot needs >= 16 rows), padded and masked
    block_k: candidates a loop step handles
    num_splits: top-k ranges per (token, head block); 1 is the single-launch (final) path
    blocks_per_split: ``block_k`` steps in each range
    num_warps: warps a program runs
    num_stages: software-pipelining depth of the candidate loop
    maxnreg: register cap handed to ptxas (None: its own choice)
    partial_dtype: "fp32" or "bf16", the dtype of split partials
    """

    block_h: int
    block_k: int
    num_splits: int
    blocks_per_split: int
    num_warps: int = 8
    num_stages: int = 2
    maxnreg: int | None = None
    partial_dtype: str = "fp32"


@dataclass(frozen=True)
class KernelShape:
    """A kernel's fixed block shape and what the compile gate read for it.

    name: the kernel's registered name
    block_h, block_k, num_warps, num_stages, maxnreg, partial_dtype: as in :class:`LaunchConfig`
    ctas_per_sm: CTAs per SM on the family's target, by {family: count}; the compile gate checks
        that the compiled code gives at least this many (tests/tools/test_compile_gate.py)
    """

    name: str
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    partial_dtype: str
    ctas_per_sm: dict

    def config(self, num_splits: int = 1, blocks_per_split: int = 1) -> LaunchConfig:
        return LaunchConfig(self.block_h, self.block_k, num_splits, blocks_per_split, self.num_warps,
                            self.num_stages, self.maxnreg, self.partial_dtype)


EXACT = KernelShape("triton_sparse_mla", 16, 32, 8, 2, None, "fp32", {"sm120": 1, "sm121": 1, "sm90": 2})
FAST = KernelShape("triton_sparse_mla_fast", 16, 32, 8, 2, None, "fp32", {"sm120": 1, "sm121": 1, "sm90": 1})
KERNELS = {k.name: k for k in (EXACT, FAST)}


HEAD_BUCKETS = (8, 16, 32, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOPK_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def row_bytes_read(kv_layout: str) -> int:
    """Bytes of one cached row the kernels load: the row's used part (its latent, scales and rope),
    not the reserved bytes after it (``fp8_ds_mla_nope``: 528 of its 656)."""
    lay = layout.get(kv_layout)
    return lay.used * (lay.token_bytes // lay.row)


def traffic(cfg: LaunchConfig, num_tokens: int, num_heads: int, topk: int, *, q_bytes: int = 2,
            out_bytes: int = 2, kv_layout: str = layout.FP8_DS_MLA) -> Traffic:
    """The bytes the launches of ``cfg`` move for a [T, H, head_dim] q over a ``kv_layout`` cache
    and [T, topk] indices (every candidate valid and distinct: the most a call can read)."""
    lay = layout.get(kv_layout)
    token_bytes = row_bytes_read(kv_layout)
    head_blocks = cdiv(num_heads, cfg.block_h)
    q_row = num_heads * lay.head_dim * q_bytes
    out_row = num_heads * lay.latent * out_bytes
    split = cfg.num_splits > 1
    prefetch = cfg.num_splits * cfg.block_k * 4  # each split loads one step of ids past its range
    partial_row = num_heads * (lay.latent * _PARTIAL_BYTES[cfg.partial_dtype] + 4)
    return Traffic(
        cache=num_tokens * head_blocks * topk * token_bytes,
        q=num_tokens * cfg.num_splits * q_row,
        indices=num_tokens * head_blocks * (topk * 4 + prefetch),
        partials=num_tokens * cfg.num_splits * partial_row * 2 if split else 0,
        output=num_tokens * out_row,
        minimum=num_tokens * (topk * token_bytes + q_row + topk * 4 + out_row),
    )


def _split(kernel: KernelShape, topk: int, chunk: int) -> LaunchConfig:
    blocks = cdiv(max(topk, 1), kernel.block_k)
    per_split = max(1, min(chunk // kernel.block_k, blocks))
    return kernel.config(cdiv(blocks, per_split), per_split)


def choose_chunk(kernel: KernelShape, family: ArchFamily, num_tokens: int, num_heads: int,
                 topk: int, kv_layout: str = layout.FP8_DS_MLA) -> tuple[int, str]:
    """Candidates per split for this shape over a ``kv_layout`` cache, by the shared rule
    (:func:`~mla_sm120_plugin.kernels.shared.launch_plan.split_rule`), and why."""
    blocks = cdiv(max(topk, 1), kernel.block_k)
    _, per_split, why = split_rule(
        family, programs=num_tokens * cdiv(num_heads, kernel.block_h), ctas_per_sm=kernel.ctas_per_sm[family.name],
        blocks=blocks, max_splits=MAX_SPLITS,
        traffic_of=lambda splits, per: traffic(kernel.config(splits, per), num_tokens, num_heads, topk,
                                               kv_layout=kv_layout))
    return per_split * kernel.block_k, why


@functools.cache
def table(kernel_name: str, family_name: str,
          kv_layout: str = layout.FP8_DS_MLA) -> dict[tuple[int, int, int], tuple[int, str]]:
    """{(heads bucket, token bucket, top-k bucket): (chunk, reason)} for one kernel, family and
    cache layout (the bytes a row costs move the byte budget: 352-byte nvfp4 rows get fewer splits
    than 656-byte fp8 rows, whose partials would otherwise outweigh the cache).

    Each entry is :func:`choose_chunk` at the bucket's upper edge; a shape in the bucket gets that
    chunk (so at most as many splits as the edge would, never an empty split).
    """
    kernel, family = KERNELS[kernel_name], FAMILIES[family_name]
    return {(h, t, k): choose_chunk(kernel, family, t, h, k, kv_layout)
            for h in HEAD_BUCKETS for t in TOKEN_BUCKETS for k in TOPK_BUCKETS}


@functools.lru_cache(maxsize=4096)
def launch_config(kernel_name: str, num_tokens: int, num_heads: int, topk: int,
                  family_name: str = DEFAULT_FAMILY, kv_layout: str = layout.FP8_DS_MLA) -> LaunchConfig:
    """The table's config for one call over a ``kv_layout`` cache (deterministic; no autotuning at
    serve time)."""
    chunk, _ = table(kernel_name, family_name, kv_layout)[(_bucket(num_heads, HEAD_BUCKETS), _bucket(num_tokens, TOKEN_BUCKETS),
                                                _bucket(topk, TOPK_BUCKETS))]
    return _split(KERNELS[kernel_name], topk, chunk)


def plan_report(kernel_name: str, num_tokens: int, num_heads: int, topk: int,
                family_name: str = DEFAULT_FAMILY, *, q_bytes: int = 2, out_bytes: int = 2,
                kv_layout: str = layout.FP8_DS_MLA) -> dict:
    """The config a call gets and the traffic model of its launches over a ``kv_layout`` cache
    (JSON-serializable)."""
    cfg = launch_config(kernel_name, num_tokens, num_heads, topk, family_name, kv_layout)
    _, why = table(kernel_name, family_name, kv_layout)[(_bucket(num_heads, HEAD_BUCKETS), _bucket(num_tokens, TOKEN_BUCKETS),
                                              _bucket(topk, TOPK_BUCKETS))]
    return dict(kernel=kernel_name, family=family_name, num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                num_splits=cfg.num_splits, chunk=cfg.blocks_per_split * cfg.block_k, block_h=cfg.block_h,
                block_k=cfg.block_k, partial_dtype=cfg.partial_dtype, reason=why, kv_layout=kv_layout,
                traffic=traffic(cfg, num_tokens, num_heads, topk, q_bytes=q_bytes, out_bytes=out_bytes,
                                kv_layout=kv_layout).as_dict())


# The shapes the acceptance names: (tokens, heads, top-k).
MUST_SHOW = [(64, 4, 2048), (64, 8, 2048), (64, 16, 2048), (1, 8, 2048), (1, 16, 2048)]


def format_report(family_name: str = DEFAULT_FAMILY) -> str:
    """The traffic model for :data:`MUST_SHOW` and both kernels, as text."""
    lines = [f"family {family_name} ({FAMILIES[family_name].part}); bytes in MB; ratio = modeled / minimum"]
    lines.append(f"{'kernel':<24}{'T':>5}{'H':>5}{'topk':>6}{'splits':>7}{'chunk':>6}{'cache':>9}{'q':>7}"
                 f"{'idx':>7}{'partials':>9}{'out':>7}{'total':>9}{'min':>9}{'ratio':>7}{'part/cache':>11}")
    for name in KERNELS:
        for t, h, k in MUST_SHOW:
            r = plan_report(name, t, h, k, family_name)
            tr = {key: (v / 1e6 if isinstance(v, int) else v) for key, v in r["traffic"].items()}
            lines.append(f"{name:<24}{t:>5}{h:>5}{k:>6}{r['num_splits']:>7}{r['chunk']:>6}{tr['cache']:>9.3f}"
                         f"{tr['q']:>7.3f}{tr['indices']:>7.3f}{tr['partials']:>9.3f}{tr['output']:>7.3f}"
                         f"{tr['total']:>9.3f}{tr['minimum']:>9.3f}{tr['ratio']:>7.3f}"
                         f"{tr['partials_over_cache']:>11.3f}")
    return "\n".join(lines)


def json_report(family_name: str = DEFAULT_FAMILY) -> dict:
    """What :func:`format_report` and :func:`format_table` print, as data: the family, each kernel's
    plan and traffic for :data:`MUST_SHOW`, and each kernel's table as ``{"heads", "tokens",
    "topk", "splits", "chunk"}`` rows."""
    family = FAMILIES[family_name]
    tables = {}
    for name in KERNELS:
        entries = table(name, family_name)
        tables[name] = [dict(heads=h, tokens=t, topk=k, splits=cdiv(k, entries[(h, t, k)][0]),
                             chunk=entries[(h, t, k)][0]) for h in HEAD_BUCKETS for t in TOKEN_BUCKETS
                        for k in TOPK_BUCKETS]
    return dict(family=family_name, part=family.part, num_sms=family.num_sms, bandwidth_gbps=family.bandwidth_gbps,
                ctas_per_sm={name: kernel.ctas_per_sm[family_name] for name, kernel in KERNELS.items()},
                plans=[plan_report(name, t, h, k, family_name) for name in KERNELS for t, h, k in MUST_SHOW],
                tables=tables)


def format_table(kernel_name: str, family_name: str = DEFAULT_FAMILY) -> str:
    """One kernel's table for one family: splits at each bucket edge (rows: heads/tokens)."""
    rows = [f"{kernel_name} on {family_name}: splits (chunk) per top-k bucket"]
    rows.append(f"{'H':>4}{'T<=':>6} " + "".join(f"{k:>11}" for k in TOPK_BUCKETS))
    entries = table(kernel_name, family_name)
    for h in HEAD_BUCKETS:
        for t in TOKEN_BUCKETS:
            cells = []
            for k in TOPK_BUCKETS:
                chunk, _ = entries[(h, t, k)]
                cells.append(f"{cdiv(k, chunk)} ({chunk})".rjust(11))
            rows.append(f"{h:>4}{t:>6} " + "".join(cells))
    return "\n".join(rows)


def with_splits(cfg: LaunchConfig, num_splits: int, blocks_per_split: int) -> LaunchConfig:
    """``cfg`` with another split (tests force the most or fewest partials)."""
    return replace(cfg, num_splits=num_splits, blocks_per_split=blocks_per_split)


if __name__ == "__main__":
    import sys

    family = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_FAMILY
    print(format_report(family))
    if "--table" in sys.argv:
        for name in KERNELS:
            print()
            print(format_table(name, family))
