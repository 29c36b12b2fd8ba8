"""The constraint matrix: which kernel serves which phase, and why the others cannot.

Kernels state their envelopes as data (:class:`~mla_sm120_plugin.types.KernelSpec`), models
theirs as profiles; :func:`select` intersects them with one
:class:`~mla_sm120_plugin.types.SelectionContext` and either returns a
:class:`~mla_sm120_plugin.types.Decision` or raises one
:class:`~mla_sm120_plugin.errors.UnsupportedConfiguration` that names the combination, every
reason, what can run instead, and the fix. :mod:`mla_sm120_plugin.plan` decides a model's layer
kinds with it; :mod:`mla_sm120_plugin.report` renders the outcome.
"""

from __future__ import annotations

import dataclasses

from . import families
from .engines import for_context
from .errors import UnsupportedConfiguration, format_error
from .hooks.manager import Registry, get_registry
from .kernels.accuracy import EXACT_BAR
from .kernels.dsa.layout import LAYOUTS, SCALE_FORMATS
from .types import (
    AUTO,
    DECODE,
    EXACT,
    ENGINE_NATIVE_IMPLS,
    PHASES,
    PREFILL,
    Decision,
    DeviceInfo,
    KernelSpec,
    ModelProfile,
    Refusal,
    Rejection,
    SelectionContext,
)

# Token count above which a bare-shape call (kernel="auto" on tensors) is treated as prefill.
DECODE_TOKENS_MAX = 64

_probe_cache: dict[tuple[str, str, DeviceInfo], tuple[str, ...]] = {}


def clear_probe_cache() -> None:
    """Forget cached probe results (after installing a package, or between tests)."""
    _probe_cache.clear()


def probe_reasons(spec: KernelSpec, device: DeviceInfo) -> tuple[str, ...]:
    if spec.probe is None:
        return ()
    key = (spec.name, spec.entry, device)
    if key not in _probe_cache:
        try:
            _probe_cache[key] = tuple(str(r) for r in spec.probe(device))
        except Exception as exc:  # a probe that crashes means "cannot run", with the crash as reason
            _probe_cache[key] = (f"probe failed: {type(exc).__name__}: {exc}",)
    return _probe_cache[key]


def envelope_reasons(
    spec: KernelSpec, ctx: SelectionContext, phase: str, profile: ModelProfile | None
) -> list[str]:
    """Reasons ``spec`` cannot serve ``phase`` of ``ctx`` (empty: it can), probes excluded."""
    dev = ctx.device
    reasons: list[str] = []
    if phase not in spec.phases:
        reasons.append(f"does not implement {phase}")
    if dev.vendor not in spec.vendors:
        reasons.append(f"runs on {sorted(spec.vendors)}, not {dev.vendor}")
    elif dev.vendor == "nvidia" and spec.sm_families is not None and dev.sm_family not in spec.sm_families:
        fams = ", ".join(f"SM{f}x" for f in sorted(spec.sm_families))
        reasons.append(f"needs {fams}, device is sm_{dev.sm_major}{dev.sm_minor}")
    if ctx.kv_cache_dtype not in spec.kv_cache_dtypes:
        reasons.append(f"reads kv_cache_dtype {sorted(spec.kv_cache_dtypes)}, not {ctx.kv_cache_dtype}")
    lo, hi = spec.heads
    if not lo <= ctx.num_heads <= hi:
        what = "heads per rank" if ctx.decode_context_parallel_size == 1 else "heads a call (gathered over DCP)"
        reasons.append(f"{what} {ctx.num_heads} outside [{lo}, {hi}]")
    if ctx.index_topk < spec.topk_min:
        reasons.append(f"index_topk {ctx.index_topk} < {spec.topk_min}")
    if ctx.index_topk % spec.topk_multiple:
        reasons.append(f"index_topk {ctx.index_topk} not a multiple of {spec.topk_multiple}")
    max_tokens = ctx.max_tokens_for(phase)
    if spec.max_tokens is not None and (max_tokens is None or max_tokens > spec.max_tokens):
        seen = "calls of any length (no bound given)" if max_tokens is None else f"{max_tokens} tokens a call"
        reasons.append(f"{phase} may see {seen}, kernel takes <= {spec.max_tokens}")
    if ctx.precision == EXACT and spec.precision != EXACT:
        reasons.append(f"computes with a single fp8 q and probability (precision {spec.precision}: a few % relRMS); "
                       f"the config asks precision={EXACT} ({EXACT_BAR} against float64)")
    if ctx.decode_context_parallel_size > 1 and not spec.returns_lse:
        reasons.append(f"returns no LSE: decode context parallelism (dcp={ctx.decode_context_parallel_size}) merges "
                       "the ranks' partial outputs by it")
    if ctx.sinks and not spec.sinks:
        reasons.append("applies no attention sink: the model's learned per-head sinks would be dropped")
    if phase == DECODE and ctx.cuda_graphs and dev.is_gpu and not spec.graph_safe:
        reasons.append(f"not CUDA-graph safe and decode is captured in CUDA graphs "
                       f"({for_context(ctx).eager_flag} allows it)")
    if spec.envelope is not None and not reasons:
        try:
            reasons.extend(str(r) for r in spec.envelope(ctx, phase, profile))
        except Exception as exc:
            reasons.append(f"envelope check failed: {type(exc).__name__}: {exc}")
    return reasons


def _same_family(spec: KernelSpec, ctx: SelectionContext) -> bool:
    """``spec`` reads a cache of ``ctx``'s model family (one of the family's layouts)."""
    family = families.of_kernel(spec)
    return family is not None and family.name == ctx.family


def _candidates(
    registry: Registry, ctx: SelectionContext, phase: str, profile: ModelProfile | None
) -> tuple[list[KernelSpec], dict[str, tuple[str, ...]], bool]:
    """Kernels that can serve ``phase``, best first, and the reasons for every other one."""
    viable: list[KernelSpec] = []
    rejected: dict[str, tuple[str, ...]] = {}
    probes_skipped = False
    for spec in sorted(registry.kernels.values(), key=lambda s: -s.priority):
        if not _same_family(spec, ctx):
            continue  # a kernel reads one family's caches: no candidate for another family's layer
        reasons = envelope_reasons(spec, ctx, phase, profile)
        if not reasons:
            if ctx.device.is_planned:
                probes_skipped = probes_skipped or spec.probe is not None
            else:
                reasons = list(probe_reasons(spec, ctx.device))
        if reasons:
            rejected[spec.name] = tuple(reasons)
        else:
            viable.append(spec)
    return viable, rejected, probes_skipped


def _unknown_kernel(name: str, registry: Registry, ctx: SelectionContext) -> str | None:
    if name == AUTO or name in registry.kernels:
        return None
    if name in ENGINE_NATIVE_IMPLS:
        return f"{name} is another engine's impl, not a kernel of this plugin (a stale config carried over?)"
    return f"{name} is not a registered kernel (known: {sorted(registry.kernels)})"


def resolve_scale_format(ctx: SelectionContext, profile: ModelProfile) -> str:
    if ctx.kv_scale_format == AUTO:
        return profile.kv_scale_format
    if ctx.kv_scale_format not in SCALE_FORMATS:
        raise UnsupportedConfiguration(
            format_error(
                f"kv_scale_format={ctx.kv_scale_format!r}",
                f"auto or one of {list(SCALE_FORMATS)}",
                "fix kv_scale_format in the plugin config",
            )
        )
    return ctx.kv_scale_format


def select(ctx: SelectionContext, *, registry: Registry | None = None) -> Decision:
    """Decide one kernel per phase for ``ctx``.

    :param ctx: the combination to decide for.
    :param registry: the plugin registry; the process-wide one by default.
    :returns: the :class:`Decision`, with every rejected kernel and its reasons.
    :raises UnsupportedConfiguration: the model is not a DSA model a plugin serves, a validate
        hook refused it, a forced kernel cannot run it, or no kernel can.
    """
    reg = registry if registry is not None else get_registry()
    profile = reg.by_arch.get(ctx.model_arch)
    engine = for_context(ctx)
    if profile is None:
        archs = sorted(reg.by_arch)
        raise UnsupportedConfiguration(
            format_error(
                f"{ctx.describe()}: {ctx.model_arch} is not a sparse-MLA model this plugin serves (no model profile "
                "names the architecture)",
                f"model_arch in {archs}",
                f"serve this model without {engine.enable_flag}, or install a plugin with a profile for it",
            )
        )
    family = families.FAMILIES.get(profile.family)
    if profile.family != ctx.family or family is None or (ctx.call is not None) != family.has_call:
        raise UnsupportedConfiguration(
            format_error(
                f"{ctx.describe()}: {ctx.model_arch} is a {family.label if family else profile.family} model "
                f"(profile {profile.name}, family {profile.family}), decided as a context of family {ctx.family!r} "
                f"{'with' if ctx.call is not None else 'without'} a layer kind's call",
                "a context of the model's own family, as the family shapes it (mla_sm120_plugin.plan: one context "
                "a layer kind, carrying the family's call where the family has one)",
                "plan models with mla-sm120 check (or mla_sm120_plugin.plan.plan); a third-party plugin that builds "
                "contexts itself must set SelectionContext.family (and the family's call) as the plan does",
            )
        )
    refusals = reg.validate(ctx, profile)
    if refusals:
        raise UnsupportedConfiguration(_refusal_message(ctx, refusals))
    scale_format = resolve_scale_format(ctx, profile)
    ctx = dataclasses.replace(ctx, kv_scale_format=scale_format)

    chosen: dict[str, str] = {}
    alternates: dict[str, tuple[str, ...]] = {}
    rejections: list[Rejection] = []
    problems: list[str] = []
    failing_reasons: list[str] = []  # every reason behind a problem: the fix addresses only these
    skipped = False
    for phase in PHASES:
        viable, rejected, phase_skipped = _candidates(reg, ctx, phase, profile)
        skipped = skipped or phase_skipped
        names = [s.name for s in viable]
        forced = ctx.kernel_for(phase)
        if forced != AUTO:
            why = _unknown_kernel(forced, reg, ctx) or (
                "; ".join(rejected[forced]) if forced in rejected else None
            )
            if why is not None:
                failing_reasons.extend(rejected.get(forced, ()))
                problems.append(f"{phase} kernel {forced} ({ctx.forced_by}) cannot run: {why}; "
                                f"{phase} can run: {', '.join(names) or 'nothing'}")
                continue
            pick = forced
        elif not names:
            failing_reasons.extend(r for v in rejected.values() for r in v)
            detail = "".join(f"\n      {k}: {'; '.join(v)}" for k, v in rejected.items())
            problems.append(f"no kernel can run {phase}:{detail}")
            continue
        else:
            pick = reg.select_override(ctx, phase, names) or names[0]
        chosen[phase] = pick
        alternates[phase] = tuple(name for name in names if name != pick)
        for name, reasons in rejected.items():
            rejections.append(Rejection(name, phase, reasons))
        for name in names:
            if name != pick:
                why = "not the forced kernel" if forced != AUTO else f"lower priority than {pick}"
                rejections.append(Rejection(name, phase, (why,)))
    if problems:
        raise UnsupportedConfiguration(
            format_error(
                ctx.describe() + "".join(f"\n  - {p}" for p in problems),
                _supported_summary(reg, profile),
                _fix_for(ctx, failing_reasons),
            )
        )
    notes: list[str] = []
    if skipped:
        notes.append(
            f"device {ctx.device.label} is planned ({ctx.device.source}), not present here: kernel probes "
            "(installed packages, GPU, JIT compiler) were not run; run `mla-sm120 doctor` on that machine"
        )
    if ctx.sinks:
        notes.append(f"sinks: the model's learned per-head attention sinks are applied by {chosen[DECODE]} (decode) "
                     f"and {chosen[PREFILL]} (prefill), in the softmax denominator (out x 1 / (1 + exp(sink - lse))); "
                     f"{engine.sink_note}")
    for spec in reg.kernels.values():
        if spec.envelope_note is not None and ctx.kv_cache_dtype in spec.kv_cache_dtypes:
            try:
                note = spec.envelope_note()
            except Exception as exc:  # a note is information, never a reason to fail the decision
                note = f"envelope note failed: {type(exc).__name__}: {exc}"
            if note:
                notes.append(f"{spec.name}: {note}")
    return Decision(
        context=ctx,
        profile=profile,
        kernels=chosen,
        scale_format=scale_format,
        rejections=tuple(rejections),
        notes=tuple(notes),
        alternates=alternates,
        classes={phase: reg.kernels[name].precision for phase, name in chosen.items()},
    )


def _refusal_message(ctx: SelectionContext, refusals: list[tuple[str, Refusal]]) -> str:
    """One message for every validate refusal; a third party's reason carries its plugin's name."""
    def origin(label: str) -> str:
        return "" if label.startswith("builtin") else f" (refused by plugin {label})"

    given = ctx.describe() + "".join(f"\n  - {r.reason}{origin(label)}" for label, r in refusals)
    supported = "; ".join(dict.fromkeys(r.supported for _, r in refusals if r.supported)) or "what those plugins allow"
    fix = "; ".join(dict.fromkeys(r.fix for _, r in refusals if r.fix)) or "see the reasons above"
    return format_error(given, supported, fix)


def _supported_summary(reg: Registry, profile: ModelProfile) -> str:
    parts = []
    for spec in sorted(reg.kernels.values(), key=lambda s: -s.priority):
        family = families.of_kernel(spec)
        if family is None or family.name != profile.family:
            continue
        dev = "/".join(sorted(spec.vendors))
        if spec.sm_families is not None:
            dev += " SM" + "/".join(f"{f}x" for f in sorted(spec.sm_families))
        parts.append(f"{spec.name} ({dev}, kv {'/'.join(sorted(spec.kv_cache_dtypes))}, heads {spec.heads[0]}-{spec.heads[1]})")
    return f"for {profile.name}: " + ", ".join(parts)


def _fix_for(ctx: SelectionContext, reasons: list[str]) -> str:
    """The fixes that apply to this refusal only, most direct first."""
    engine = for_context(ctx)
    fixes = []
    if ctx.prefill_kernel != AUTO or ctx.decode_kernel != AUTO:
        fixes.append(f"remove the kernel override ({ctx.forced_by}) or set it to one listed as able to run")
    fp8_cache = ctx.kv_cache_dtype in LAYOUTS and LAYOUTS[ctx.kv_cache_dtype].fp8
    if not fp8_cache and any(r.startswith("reads kv_cache_dtype") for r in reasons):
        fixes.append(f"use {engine.fp8_flag} for the kernels that read only the fp8 cache")
    if any("pip install" in r for r in reasons):
        fixes.append("install what a probe above reports missing")
    if any(r.startswith("not CUDA-graph safe") for r in reasons):
        fixes.append(f"run with {engine.eager_flag}, or install a graph-safe kernel")
    if any(r.startswith("computes with a single fp8 q") for r in reasons):
        fixes.append('set precision = "fast" in the plugin config (single-fp8 q/p kernels too, within their stated bounds)')
    if not fixes:
        fixes.append("change the combination to one a kernel above supports (each rejection says what it needs)")
    return "; ".join(fixes)


def choose_kernel_for_shape(
    *, kv_layout: str, num_heads: int, topk: int, num_tokens: int, device_type: str
) -> str:
    """Pick a kernel for bare tensors (``sparse_mla_forward(kernel="auto")``).

    Uses the same specs and probes as :func:`select`, without a model profile.

    :param kv_layout: ``"fp8_ds_mla"`` or ``"bf16"``.
    :param num_heads: heads of q.
    :param topk: width of the index tensor.
    :param num_tokens: rows of q.
    :param device_type: ``torch.device.type`` of the tensors (``"cuda"``, ``"cpu"``).
    :returns: a kernel name.
    :raises UnsupportedConfiguration: no registered kernel can run this shape here.
    """
    from . import device as device_mod

    dev = device_mod.device_for_tensor_type(device_type)
    phase = DECODE if num_tokens <= DECODE_TOKENS_MAX else PREFILL
    ctx = SelectionContext(
        model_arch="<tensors>",
        kv_cache_dtype=kv_layout,
        num_heads=num_heads,
        index_topk=topk,
        device=dev,
        max_decode_tokens=num_tokens,
        max_prefill_tokens=num_tokens,
        forced_by="kernel='auto'",
    )
    viable, rejected, _ = _candidates(get_registry(), ctx, phase, None)
    if not viable:
        detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in rejected.items())
        raise UnsupportedConfiguration(
            format_error(
                f"{ctx.describe()}: no kernel can run {phase} ({detail})",
                "see each kernel's reasons",
                "pass kernel= explicitly, or install what a probe reports missing",
            )
        )
    return viable[0].name
