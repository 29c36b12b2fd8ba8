"""Every plan rendered one way: the text ``mla-sm120 check`` prints, its JSON, the engines' log lines
and the cache capacity.

:func:`explain`, :func:`to_dict` and :func:`log_line` take any :class:`~mla_sm120_plugin.plan.Plan`,
whatever its family (:mod:`mla_sm120_plugin.families`): a plan whose family has no rows of its own (a
DSA model's one layer kind) is its decision's table; otherwise the family's rows (a family with several
call shapes: a row per (layer kind, phase), its record and capacity), the notes, then its first kind in full. The JSON
has one schema for every family (:func:`to_dict`). Each decision's own table (:func:`explain_decision`)
and line (:func:`decision_line`) are the same everywhere they appear. Pure Python.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import families
from .hooks.manager import get_registry
from .kernels.accuracy import EXACT_BAR
from .plan import Plan
from .types import EXACT, PHASES, Decision, KernelSpec, Rejection, SelectionContext


def capacity(ctx: SelectionContext) -> dict[str, Any]:
    """One decision's cache capacity, as its family counts it: ``{"scope", "layouts": {name:
    {"token_bytes", "tokens_per_gib"}}, "ratio_vs": {name: this layout's tokens / that one's}}`` (a DSA
    context: its layout beside the engine's fp8 and bf16 layouts at the planned release; the family says
    what it compares)."""
    return families.get(ctx.family).capacity(ctx)


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
        "heads_per_rank": ctx.heads_per_rank,
        "decode_context_parallel_size": ctx.decode_context_parallel_size,
        "heads_per_call": ctx.num_heads,
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
        f"scale_format={decision.scale_format} heads_per_rank={ctx.heads_per_rank} "
        + (f"dcp={ctx.decode_context_parallel_size} heads_per_call={ctx.num_heads} "
           if ctx.decode_context_parallel_size > 1 else "")
        + f"index_topk={ctx.index_topk} "
        f"precision={ctx.precision} prefill={decision.prefill} decode={decision.decode}{classes}; "
        f"rejected: {rejected}"
    )


def _capacity_line(ctx: SelectionContext) -> str:
    cap = capacity(ctx)
    parts = [f"{name} {row['tokens_per_gib']:,} ({row['token_bytes']} B)" for name, row in cap["layouts"].items()]
    ratios = ", ".join(f"{ratio:.2f}x {name}" for name, ratio in cap["ratio_vs"].items())
    line = f"capacity   tokens per GiB of cache per layer: {'; '.join(parts)}" + (f" -> {ratios}" if ratios else "")
    dcp = cap.get("decode_context_parallel")
    if dcp:
        line += (f"\ndcp        {dcp['size']} ranks share the cache by token: each GPU keeps {dcp['kept_per_gpu']} of it, "
                 f"{dcp['tokens_per_gib_per_gpu']:,} tokens of context a GiB of each GPU per layer in "
                 f"{ctx.kv_cache_dtype} ({dcp['ratio_vs_dcp_1']:.2f}x dcp 1); each layer's call costs an all-gather "
                 f"of q ({ctx.num_heads} heads) and of the LSE and a reduce-scatter of the output")
    return line


def _heads(ctx: SelectionContext) -> str:
    if ctx.decode_context_parallel_size == 1:
        return f"{ctx.num_heads} heads per rank (tensor parallel {ctx.tensor_parallel_size})"
    return (f"{ctx.num_heads} heads a call, gathered over decode context parallel {ctx.decode_context_parallel_size} "
            f"({ctx.heads_per_rank} per rank, tensor parallel {ctx.tensor_parallel_size})")


def _bound(tokens: int | None) -> str:
    return "of any length" if tokens is None else f"<= {tokens} tokens"


def _bound_text(spec: KernelSpec) -> str:
    return "" if spec.accuracy is None else f": {spec.accuracy.summary()} against float64"


def explain_decision(decision: Decision) -> str:
    """One decision as a plain-text table: chosen kernel per phase, then each rejection."""
    ctx = decision.context
    lines = [
        f"model      {ctx.model_name or decision.profile.name} ({ctx.model_arch}, profile {decision.profile.name})",
        f"device     {ctx.device.describe()} [{ctx.device.source}]",
        f"kv cache   {ctx.kv_cache_dtype} (scales: {families.get(ctx.family).scales(ctx, decision)})",
        _capacity_line(ctx),
        f"precision  {ctx.precision} ("
        + ("single-fp8 q/p kernels allowed" if ctx.precision != EXACT
           else f"exact-class kernels only: {EXACT_BAR}") + ")",
        f"shape      {_heads(ctx)}, index_topk {ctx.index_topk}",
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


def explain(plan: Plan | Decision) -> str:
    """The plan as ``mla-sm120 check`` prints it (a bare decision: its table)."""
    if isinstance(plan, Decision):
        return explain_decision(plan)
    rows = families.get(plan.family).plan_rows(plan)
    first_kind, first = next(iter(plan.decisions.items()))
    if not rows:  # the one decision's table is the plan: then the notes it does not carry itself
        return "\n".join([explain_decision(first), *(f"note: {note}" for note in plan.notes if note not in first.notes)])
    return "\n".join([*rows, "", *(f"note: {note}" for note in plan.notes), "",
                      f"first layer kind in full ({first_kind}):", explain_decision(first)])


def _call(ctx: SelectionContext) -> dict[str, Any] | None:
    """A context's call shape as JSON (None: its family has one call shape)."""
    return dataclasses.asdict(ctx.call) if dataclasses.is_dataclass(ctx.call) else None


def to_dict(plan: Plan) -> dict[str, Any]:
    """A JSON-ready view (``mla-sm120 check --json``), one schema for every family: the model, engine,
    device and TP size; the cache every layer kind reads and its capacity (the family says what is
    counted: ``capacity.scope``); per layer kind its call, kernels, accuracy classes and whole decision;
    the family's own facts (``details``); the notes."""
    family = families.get(plan.family)
    return {
        "servable": True,
        "family": plan.family,
        "model_arch": plan.facts.arch,
        "model_name": plan.facts.name,
        "engine": plan.engine,
        "engine_release": plan.release,
        "device": _device_dict(plan.device),
        "tensor_parallel_size": plan.tensor_parallel_size,
        "decode_context_parallel_size": plan.decode_context_parallel_size,
        "kv_cache": {"name": plan.kv_cache, "token_bytes": family.token_bytes(plan.kv_cache)},
        "capacity": family.plan_capacity(plan),
        "layer_kinds": {
            kind: {"call": _call(d.context), "kernels": dict(d.kernels), "classes": dict(d.classes),
                   "decision": decision_to_dict(d)}
            for kind, d in plan.decisions.items()
        },
        "details": family.details(plan),
        "notes": list(plan.notes),
    }


def log_line(plan: Plan) -> str:
    """The one line an engine logs when it has planned: a one-kind plan's decision line, or the model,
    the device and each layer kind's kernels."""
    if len(plan.decisions) == 1:
        return decision_line(next(iter(plan.decisions.values())))
    family = families.get(plan.family)

    def counted(decision: Decision) -> str:
        layers = family.layers(decision.context)
        return "" if layers is None else f" x{layers}"

    kinds = "; ".join(f"{kind}{counted(d)}: prefill={d.prefill} decode={d.decode}" for kind, d in plan.decisions.items())
    return (f"mla_sm120: {family.label} plan for {plan.facts.name} ({plan.facts.arch}) on {plan.device.describe()}, "
            f"{plan.versioned} tp={plan.tensor_parallel_size}"
            + (f" dcp={plan.decode_context_parallel_size}" if plan.decode_context_parallel_size > 1 else "")
            + f", kv {plan.kv_cache}: {kinds}")
