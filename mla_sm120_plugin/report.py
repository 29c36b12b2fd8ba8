"""Every plan rendered one way: the text ``mla-sm120 check`` prints, its JSON, the engines' log lines
and the cache capacity.

:func:`explain`, :func:`to_dict` and :func:`log_line` take any :class:`~mla_sm120_plugin.plan.Plan`:
a one-kind plan (a DSA model) is its decision's table; a plan of several layer kinds (DeepSeek-V4)
is a row per (layer kind, phase), its record and capacity, then its first kind in full. Each
decision's own table (:func:`explain_decision`) and line (:func:`decision_line`) are the same
everywhere they appear. Pure Python.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .engines import ENGINES
from .families.dsv4 import kind_name
from .hooks.manager import get_registry
from .kernels.accuracy import EXACT_BAR
from .kernels.dsa.layout import BF16, FP8_DS_MLA, LAYOUTS
from .kernels.dsv4.layout import FP8_RECORD, NVFP4_DSV4, RECORDS, Dsv4Record
from .modelinfo import Dsv4Geometry
from .plan import Plan
from .types import EXACT, PHASES, Decision, KernelSpec, Rejection, SelectionContext

GIB = 1 << 30


# ------------------------------------------------------------------------------ capacity


def capacity(ctx: SelectionContext) -> dict[str, Any]:
    """Cache tokens one GiB holds (per layer) in the context's layout, beside the engine's fp8 and bf16
    layouts for the same model geometry: ``{"layouts": {name: {"token_bytes", "tokens_per_gib"}},
    "ratio_vs": {name: this layout's tokens / that one's}}``. A DeepSeek-V4 layer kind lists its record
    alone (no other layout of the engines holds these layers)."""
    if ctx.dsv4 is not None:
        record = RECORDS.get(ctx.kv_cache_dtype)
        rows = {} if record is None else {record.name: {"token_bytes": record.token_bytes,
                                                        "tokens_per_gib": GIB // record.token_bytes}}
        return {"layouts": rows, "ratio_vs": {}}
    engine = ENGINES[ctx.engine]
    names = [ctx.kv_cache_dtype] + [engine.kv_layout(base, ctx.device.sm_family, ctx.qk_rope_head_dim)
                                    for base in (FP8_DS_MLA, BF16)]
    rows = {name: {"token_bytes": LAYOUTS[name].token_bytes, "tokens_per_gib": GIB // LAYOUTS[name].token_bytes}
            for name in dict.fromkeys(names) if name in LAYOUTS}
    mine = rows.get(ctx.kv_cache_dtype)
    ratios = {name: round(mine["tokens_per_gib"] / row["tokens_per_gib"], 2)
              for name, row in rows.items() if mine and name != ctx.kv_cache_dtype}
    return {"layouts": rows, "ratio_vs": ratios}


def bytes_per_token(geometry: Dsv4Geometry, record: Dsv4Record = FP8_RECORD) -> dict[str, float]:
    """Cache bytes one context token costs a DeepSeek-V4 layer of each compressed kind (the window
    cache is bounded by the window; a compressed cache grows with the context)."""
    return {kind_name(ratio): record.token_bytes / ratio for ratio in geometry.layer_counts() if ratio}


def model_capacity(geometry: Dsv4Geometry, record: Dsv4Record) -> dict[str, Any]:
    """Context tokens one GiB of a DeepSeek-V4 model's compressed caches holds (every compressed layer,
    one rank) in ``record``, beside the 584-byte fp8 record: ``{"tokens_per_gib": {name: n}, "ratio": x}``."""
    def tokens(rec: Dsv4Record) -> int:
        per_token = sum(layers * rec.token_bytes / ratio for ratio, layers in geometry.layer_counts().items() if ratio)
        return int(GIB // per_token) if per_token else 0

    mine, fp8 = tokens(record), tokens(FP8_RECORD)
    return {"tokens_per_gib": {record.name: mine, FP8_RECORD.name: fp8},
            "ratio": round(mine / fp8, 2) if fp8 else 1.0}


# ------------------------------------------------------------------------------ one decision


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    """A JSON-ready view of one decision."""
    ctx = decision.context
    return {
        "servable": True,
        "model_arch": ctx.model_arch,
        "model_name": ctx.model_name,
        "profile": decision.profile.name,
        "device": _device_dict(ctx.device),
        "kv_cache_dtype": ctx.kv_cache_dtype,
        "scale_format": decision.scale_format,
        "precision": ctx.precision,
        "tensor_parallel_size": ctx.tensor_parallel_size,
        "heads_per_rank": ctx.num_heads,
        "index_topk": ctx.index_topk,
        "kernels": dict(decision.kernels),
        "capacity": capacity(ctx),
        "rejected": [
            {"kernel": r.kernel, "phase": r.phase, "reasons": list(r.reasons)} for r in decision.rejections
        ],
        "notes": list(decision.notes),
    }


def _device_dict(device: Any) -> dict[str, Any]:
    return {"sm": device.sm, "vendor": device.vendor, "name": device.name, "source": device.source}


def decision_line(decision: Decision) -> str:
    """The one line an engine logs at init for a decision: what runs, and why not the others."""
    ctx = decision.context
    rejected = "; ".join(f"{r.kernel}/{r.phase}: {', '.join(r.reasons)}" for r in decision.rejections) or "none"
    classes = ""
    if decision.classes:
        classes = " (accuracy class: " + ", ".join(f"{phase} {decision.classes[phase]}" for phase in decision.kernels
                                                   if phase in decision.classes) + ")"
    return (
        f"mla_sm120: model={ctx.model_name or ctx.model_arch} ({ctx.model_arch}) "
        f"device={ctx.device.describe()} kv_cache_dtype={ctx.kv_cache_dtype} "
        f"scale_format={decision.scale_format} heads_per_rank={ctx.num_heads} index_topk={ctx.index_topk} "
        f"precision={ctx.precision} prefill={decision.prefill} decode={decision.decode}{classes}; "
        f"rejected: {rejected}"
    )


def _capacity_line(ctx: SelectionContext) -> str:
    cap = capacity(ctx)
    parts = [f"{name} {row['tokens_per_gib']:,} ({row['token_bytes']} B)" for name, row in cap["layouts"].items()]
    ratios = ", ".join(f"{ratio:.2f}x {name}" for name, ratio in cap["ratio_vs"].items())
    return f"capacity   tokens per GiB of cache per layer: {'; '.join(parts)}" + (f" -> {ratios}" if ratios else "")


def _bound(tokens: int | None) -> str:
    return "of any length" if tokens is None else f"<= {tokens} tokens"


def _scales_word(ctx: SelectionContext, decision: Decision) -> str:
    lay = LAYOUTS.get(ctx.kv_cache_dtype)
    if lay is not None and lay.nvfp4:
        return f"e4m3 per {lay.latent_format.block} values, fixed by the layout"
    record = RECORDS.get(ctx.kv_cache_dtype) if ctx.dsv4 is not None else None
    if record is not None:
        kind = "e4m3" if record.nope_bits == 4 else "UE8M0 (pow2)"
        return f"{kind} per {record.scale_group} values, fixed by the record"
    return decision.scale_format


def _bound_text(spec: KernelSpec) -> str:
    return "" if spec.accuracy is None else f": {spec.accuracy.summary()} against float64"


def explain_decision(decision: Decision) -> str:
    """One decision as a plain-text table: chosen kernel per phase, then each rejection."""
    ctx = decision.context
    lines = [
        f"model      {ctx.model_name or decision.profile.name} ({ctx.model_arch}, profile {decision.profile.name})",
        f"device     {ctx.device.describe()} [{ctx.device.source}]",
        f"kv cache   {ctx.kv_cache_dtype} (scales: {_scales_word(ctx, decision)})",
        _capacity_line(ctx),
        f"precision  {ctx.precision} ("
        + ("single-fp8 q/p kernels allowed" if ctx.precision != EXACT
           else f"exact-class kernels only: {EXACT_BAR}") + ")",
        f"shape      {ctx.num_heads} heads per rank (tensor parallel {ctx.tensor_parallel_size}), "
        f"index_topk {ctx.index_topk}",
        f"calls      decode {_bound(ctx.max_decode_tokens)}, prefill {_bound(ctx.max_prefill_tokens)}; "
        f"CUDA graphs {'on' if ctx.cuda_graphs else 'off'}",
        "",
        f"{'phase':<8} {'kernel':<24} status",
    ]
    by_phase: dict[str, list[Rejection]] = {p: [] for p in PHASES}
    for r in decision.rejections:
        by_phase[r.phase].append(r)
    for phase in PHASES:
        spec = get_registry().kernels.get(decision.kernels[phase])
        grade = "" if spec is None else f" ({spec.precision} class{_bound_text(spec)})"
        lines.append(f"{phase:<8} {decision.kernels[phase]:<24} SELECTED{grade}")
        for r in by_phase[phase]:
            lines.append(f"{'':<8} {r.kernel:<24} rejected: {'; '.join(r.reasons)}")
    lines.extend(f"note: {n}" for n in decision.notes)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ a plan


def _record(plan: Plan) -> Dsv4Record:
    return RECORDS[plan.record or FP8_RECORD.name]


def _record_text(record: Dsv4Record) -> str:
    if record.name == NVFP4_DSV4:
        return (f"the {record.token_bytes}-byte NVFP4 DeepSeek-V4 record (448 e2m1 + 64 bf16 rope + 28 e4m3 scales "
                "a 16-value group, page-major; FlashInfer's kv_cache_format='nvfp4')")
    return (f"the {record.token_bytes}-byte fp8 DeepSeek-V4 record (448 e4m3 + 64 bf16 rope + 7 UE8M0 scales, "
            "page-major)")


def _capacity_text(geometry: Dsv4Geometry, record: Dsv4Record) -> str:
    cap = model_capacity(geometry, record)
    counts = cap["tokens_per_gib"]
    if record.name == FP8_RECORD.name:
        return f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers)"
    return (f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers); "
            f"the {FP8_RECORD.token_bytes}-byte fp8 record: {counts[FP8_RECORD.name]:,} -> {cap['ratio']:.2f}x "
            "(the compressed caches alone: vLLM 0.33 gives every block a page of each cache, the window's and the "
            "indexer's and compressor's too, which the record does not shrink, so its block count grows less)")


def _kinds_table(plan: Plan) -> list[str]:
    geometry = plan.facts.dsv4
    assert geometry is not None  # a plan of several kinds is a DeepSeek-V4 plan
    record = _record(plan)
    heads = plan.facts.num_heads // plan.tensor_parallel_size
    lines = [
        f"DeepSeek-V4 plan: {plan.facts.name} ({plan.facts.arch}, {geometry.version}) on {plan.device.describe()} "
        f"({plan.device.source}), {plan.versioned}, tp={plan.tensor_parallel_size}: {heads} heads and "
        f"{geometry.o_groups // plan.tensor_parallel_size} output group(s) a GPU",
        f"kv cache: {_record_text(record)}; compressed caches cost "
        + ", ".join(f"{k} {v:.3g} B" for k, v in bytes_per_token(geometry, record).items())
        + " a context token a layer",
        _capacity_text(geometry, record),
        "",
        f"{'layer kind':<11} {'layers':>6}  {'phase':<8} {'q heads':>7} {'window':>7} {'page':>5} "
        f"{'compressed':>10} {'page':>5}  kernel (class)",
    ]
    for kind, decision in plan.decisions.items():
        call = decision.context.dsv4
        assert call is not None
        for phase in PHASES:
            extra = (f"{call.extra:>10} {call.extra_page:>5}" if call.extra else f"{'-':>10} {'-':>5}")
            lines.append(f"{kind:<11} {call.layers:>6}  {phase:<8} {call.heads_for(phase):>7} "
                         f"{call.window_for(phase):>7} {call.window_page:>5} {extra}  "
                         f"{decision.kernels[phase]} ({decision.classes.get(phase, '?')})")
    lines.append("")
    lines.extend(f"note: {note}" for note in plan.notes)
    first_kind, first = next(iter(plan.decisions.items()))
    lines += ["", f"first layer kind in full ({first_kind}):", explain_decision(first)]
    return lines


def explain(plan: Plan | Decision) -> str:
    """The plan as ``mla-sm120 check`` prints it (a bare decision: its table)."""
    if isinstance(plan, Decision):
        return explain_decision(plan)
    if plan.facts.dsv4 is None:
        own = [f"note: {note}" for note in plan.notes if note not in plan.decision.notes]
        return "\n".join([explain_decision(plan.decision), *own])
    return "\n".join(_kinds_table(plan))


def to_dict(plan: Plan) -> dict[str, Any]:
    """A JSON-ready view (``mla-sm120 check --json``): a DSA plan is its decision's view."""
    geometry = plan.facts.dsv4
    if geometry is None:
        view = decision_to_dict(plan.decision)
        notes = [*view.get("notes", ()), *(note for note in plan.notes if note not in plan.decision.notes)]
        return {**view, "engine": plan.engine, "engine_release": plan.release, "notes": notes}
    record = _record(plan)
    return {
        "servable": True,
        "family": plan.family,
        "model_arch": plan.facts.arch,
        "model_name": plan.facts.name,
        "engine": plan.engine,
        "engine_release": plan.release,
        "device": _device_dict(plan.device),
        "tensor_parallel_size": plan.tensor_parallel_size,
        "kv_record": {"name": record.name, "token_bytes": record.token_bytes},
        "capacity": model_capacity(geometry, record),
        "layers_known": geometry.layers_known,
        "layer_kinds": {
            kind: {"call": dataclasses.asdict(d.context.dsv4) if d.context.dsv4 else None,
                   "kernels": dict(d.kernels), "classes": dict(d.classes),
                   "decision": decision_to_dict(d)}
            for kind, d in plan.decisions.items()
        },
        "compressed_bytes_per_token": bytes_per_token(geometry, record),
        "notes": list(plan.notes),
    }


def log_line(plan: Plan) -> str:
    """The one line an engine logs when it has planned: a DSA plan's decision line, or the model, the
    device and each layer kind's kernels."""
    if plan.facts.dsv4 is None:
        return decision_line(plan.decision)
    kinds = "; ".join(
        f"{kind} x{d.context.dsv4.layers if d.context.dsv4 else '?'}: prefill={d.prefill} decode={d.decode}"
        for kind, d in plan.decisions.items())
    return (f"mla_sm120: DeepSeek-V4 plan for {plan.facts.name} ({plan.facts.arch}) on {plan.device.describe()}, "
            f"{plan.versioned} tp={plan.tensor_parallel_size}, kv {_record(plan).name}: {kinds}")
