"""Prove a bound kernel on this machine, at engine init, before any weight loads: the one runner.

A kernel that does not compile here (a Triton or FlashInfer JIT failure) or reads the cache wrong
(a scale-format mix-up: vllm#54563) would otherwise show at the engine's first forward, after the
weights have loaded, or never. :func:`check` runs a kernel once on a small deterministic case in
the real cache layout, heads and page sizes, with adversarial candidates, and compares it with
float64 attention over the case's dequantized rows in FlashMLA's metrics
(:mod:`mla_sm120_plugin.kernels.accuracy`), against the kernel's declared ``KernelSpec.accuracy``
(its ``tolerance``, a max error, for a kernel that declares none). Where the engine's caller reads
the kernel's LSE too (decode context parallelism: the merge weighs each rank by it), the case runs the
call as that caller makes it and holds the LSE to float64's as well (``AccuracyBound.lse_bound`` nats,
-inf exactly where float64 has nothing, never NaN). The case is its family's
(:mod:`.selfcheck_dsa`, :mod:`.selfcheck_dsv4`); the modes, the key, the result, the cache, the
fallback along a decision's alternates (:func:`verify`), the refusal and the ``doctor --self-check``
sweep (:func:`sweep`) are this module's, for every family. Results are kept per process and
:class:`CheckKey`, so 78 layers pay for one check. ``MLA_SM120_SELF_CHECK``: ``on`` (default),
``off`` (skip, logged) or ``strict`` (a failure raises, no fallback).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from .. import families
from ..envs import SELF_CHECK as ENV
from ..errors import MlaSm120Error, PluginError, UnsupportedConfiguration, format_error
from ..kernels.accuracy import Accuracy, AccuracyBound, LseAccuracy, measure, measure_lse
from ..kernels.dsa import layout as dsa_layout
from ..types import Decision, KernelSpec
from .binding import BoundKernel, bind

MODES = ("on", "off", "strict")


def case_of(family: families.Family) -> Any:
    """A family's self-check case: the module (:attr:`~mla_sm120_plugin.families.base.Family.selfcheck_case`)
    that builds, runs and measures its call (``build`` / ``run`` / ``truth`` / ``keys`` / ``sweep_keys`` /
    ``ORDER``)."""
    return importlib.import_module(family.selfcheck_case)


def _kernel_case(spec: KernelSpec) -> Any:
    """The self-check case of the family whose layouts ``spec`` reads.

    :raises PluginError: the kernel reads no family's layouts.
    """
    family = families.of_kernel(spec)
    if family is None:
        raise PluginError(format_error(f"kernel {spec.name} reads {sorted(spec.kv_cache_dtypes)}",
                                       "a kernel that reads one family's cache layouts",
                                       "fix the kernel's kv_cache_dtypes"))
    return case_of(family)

# `doctor --self-check`'s heads: GLM-5 at TP4 (DSA), V4-Flash at TP4 (DeepSeek-V4).
SWEEP_HEADS = 16


@dataclass(frozen=True)
class CheckKey:
    """What makes two self-checks different; one check per key and process.

    :param kernel: the kernel's registered name.
    :param phase: ``"decode"`` / ``"prefill"`` (sets a DSA case's tokens), ``"both"`` (a case that
        serves both phases: a family whose call is one for both).
    :param kv_layout: the cache layout (or record) the family's kernels read.
    :param num_heads: q heads of the call.
    :param device: where it runs (``"cpu"``, ``"cuda:0"``).
    :param q_dtype: ``"bf16"`` (what the engines pass) or ``"fp32"``.
    :param scale_format: what a DSA kernel is told of fp8 scales (None: no fp8 scales to tell).
    :param written_format: how the case's fp8 scales are written.
    :param topk: a DSA case's index top-k.
    :param pages: the entries a page holds in each cache the family's call reads, in the call's order,
        as the engine's call passes them (empty: the case's own; a one-cache case has 64-row pages).
    :param sinks: a DSA case carries a learned sink logit per head (a model with sinks, HY V4).
    :param lengths: the caller hands the kernel per-row top-k lengths (:attr:`Engine.call_lengths`;
        always under DCP: the owned counts).
    :param lse: the base the caller reads the LSE in (``"e"`` / ``"2"``): the case is a decode-context-
        parallel rank's call and its LSE is checked; None: the caller reads none.
    :param dcp: the DCP size of that call (its heads are ``dcp`` ranks' heads; the rank counts its own
        heads' sinks, :func:`mla_sm120_plugin.dispatch.dcp.call_sinks`).
    """

    kernel: str
    phase: str
    kv_layout: str
    num_heads: int
    device: str
    q_dtype: str = "bf16"
    scale_format: str | None = None
    written_format: str | None = None
    topk: int = 0
    pages: tuple[int, ...] = ()
    sinks: bool = False
    lengths: bool = True
    lse: str | None = None
    dcp: int = 1


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one self-check.

    :param key: what was checked.
    :param ran: the kernel ran (compiled and returned); False when it raised.
    :param tolerance: the kernel's declared max error.
    :param seconds: wall time of the kernel call and the comparison (first compilation included).
    :param error: why it failed, in one line; None when it passed.
    :param accuracy: cos_diff, relRMS and max error against float64; None when it did not run.
    :param bound: the kernel's declared :class:`AccuracyBound`; None when it declares only a tolerance.
    :param lse: the worst of the LSE forms checked (the key's ``lse``); None when none was.
    """

    key: CheckKey
    ran: bool
    tolerance: float
    seconds: float
    error: str | None
    accuracy: Accuracy | None = None
    bound: AccuracyBound | None = None
    lse: LseAccuracy | None = None

    @property
    def passed(self) -> bool:
        return self.error is None

    @property
    def max_error(self) -> float | None:
        """max |kernel - reference| / max |reference|; None when it did not run."""
        return None if self.accuracy is None else self.accuracy.max_rel

    def summary(self) -> str:
        if self.passed:
            lse = "" if self.lse is None else f"; {self.lse.summary()} (base {self.key.lse}) <= {_lse_bound(self.bound):g}"
            if self.accuracy is not None and self.bound is not None:
                return (f"{self.key.kernel} ok ({self.accuracy.summary()}; bound {self.bound.summary()}{lse}; "
                        f"{self.seconds:.2f} s)")
            return (f"{self.key.kernel} ok (max error {self.max_error:.2e} <= {self.tolerance:.0e}{lse}, "
                    f"{self.seconds:.2f} s)")
        fp8 = self.key.kv_layout in dsa_layout.FP8_LAYOUTS and self.key.written_format is not None
        where = f" on {self.key.written_format}-written scales" if fp8 else ""
        return f"{self.key.kernel} FAILED{where} ({self.error})"


_results: dict[CheckKey, CheckResult] = {}
# The LSE bound of a kernel that declares only a tolerance: the fast class's (a tolerance says nothing of it).
_TOLERANCE_ONLY = AccuracyBound(cos_diff=1.0, rel_rms=1.0, max_rel=1.0)


def _lse_bound(bound: AccuracyBound | None) -> float:
    return (bound or _TOLERANCE_ONLY).lse_bound


def mode() -> str:
    """``MLA_SM120_SELF_CHECK``: on (default), off or strict.

    :raises UnsupportedConfiguration: any other value.
    """
    value = os.environ.get(ENV, "on").strip().lower() or "on"
    if value not in MODES:
        raise UnsupportedConfiguration(format_error(f"{ENV}={os.environ.get(ENV)!r}", f"one of {list(MODES)}",
                                                    f"unset {ENV}, or set it to off or strict"))
    return value


def clear_cache() -> None:
    """Forget every result (tests)."""
    _results.clear()


def engine_device() -> torch.device:
    """Where an engine worker runs the kernels: its current CUDA device, or the CPU without one."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def engine_kernel(name: str, fn: Callable[..., Any]) -> BoundKernel:
    """A kernel the engine calls itself (FlashInfer's DeepSeek-V4 kernel, as the engine imported it),
    as the runner calls it."""
    return BoundKernel(name=name, fn=fn, takes_scale_format=False, needs_scale_format=False, graph_safe=True,
                       engine_own=True)


@contextlib.contextmanager
def forward_time_defaults():
    """Run with the defaults a forward runs under, not the engine's construction context.

    vLLM builds the impl (and so runs this check) inside ``set_default_torch_dtype(bf16)`` and
    ``torch.device("cuda")``; its forward runs outside both. A kernel that makes a tensor without
    an explicit device or dtype must behave here as it will at the first request.
    """
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _compare(kernel: BoundKernel, key: CheckKey, case: Any, inputs: dict[str, Any], tolerance: float,
             bound: AccuracyBound | None, start: float) -> CheckResult:
    """Call the kernel on the case and compare it with float64 attention over the dequantized rows."""
    device = torch.device(key.device)

    def result(ran: bool, error: str | None, got: Accuracy | None = None, lse: LseAccuracy | None = None) -> CheckResult:
        return CheckResult(key, ran, tolerance, time.perf_counter() - start, error, got, bound, lse)

    try:
        observed = case.run(kernel, key, inputs)  # out, or (out, {LSE form: lse in natural log})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is the finding
        return result(False, one_line(exc))
    try:
        truth = case.truth(key, inputs)  # ref, or (ref, {LSE form: (float64 lse, sink to fold or None)})
    except Exception as exc:  # noqa: BLE001 - no ground truth on this device: the kernel is unproven
        return result(True, f"the torch reference could not run on {device}: {one_line(exc)}")
    out, lses = observed if isinstance(observed, tuple) else (observed, {})
    ref, want = truth if isinstance(truth, tuple) else (truth, {})
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return result(True, f"output shape {shape}, expected {tuple(ref.shape)}")
    got = measure(out, ref)
    over: list[str] = []
    violated = bound.violations(got) if bound is not None else []
    if violated:
        over.append(f"{', '.join(violated)} against float64 (bound {bound.summary()})")
    elif bound is None and not got.max_rel <= tolerance:  # NaN fails too
        over = [f"max error {got.max_rel:.3g} of the output's magnitude > tolerance {tolerance:g}"]
    worst = None
    for form, (lse64, fold) in want.items():
        lse = lses.get(form)
        if not isinstance(lse, torch.Tensor) or lse.shape != lse64.shape:
            over.append(f"{form}: the kernel returned {type(lse).__name__ if lse is None else tuple(lse.shape)}, "
                        f"expected an LSE of {tuple(lse64.shape)}")
            continue
        measured = measure_lse(lse, lse64, fold)
        over += (bound or _TOLERANCE_ONLY).lse_violations(measured, form)
        if worst is None or not measured.max_abs <= worst.max_abs or measured.nan or measured.inf_mismatch:
            worst = measured
    return result(True, "; ".join(over) or None, got, worst)


def check(kernel: BoundKernel, *, phase: str, kv_layout: str, num_heads: int, device: torch.device | str = "cpu",
          q_dtype: str = "bf16", scale_format: str | None = None, written_format: str | None = None, topk: int = 0,
          pages: tuple[int, ...] = (), **call: Any) -> CheckResult:
    """Run ``kernel`` once on this machine against float64 (cached per :class:`CheckKey`; the
    arguments are its fields, ``written_format`` defaulting to ``scale_format``; ``call``: the fields
    that say how the caller makes the call, ``sinks``, ``lengths``, ``lse`` and ``dcp``).

    :returns: the :class:`CheckResult`; never raises for a failing kernel.
    """
    key = CheckKey(kernel.name, phase, kv_layout, num_heads, str(torch.device(device)), q_dtype, scale_format,
                   written_format or scale_format, topk, tuple(pages), **call)
    return run(kernel, key)


def run(kernel: BoundKernel, key: CheckKey) -> CheckResult:
    """:func:`check` for a key already made."""
    from ..hooks.manager import get_registry

    if key in _results:
        return _results[key]
    spec = get_registry().kernels[kernel.name]
    case = _kernel_case(spec)
    tolerance, bound = spec.tolerance, spec.accuracy
    start = time.perf_counter()
    inputs: dict[str, Any] = {}
    with forward_time_defaults():
        try:
            inputs = case.build(key, torch.device(key.device))
        except Exception as exc:  # noqa: BLE001 - a case this device cannot hold fails the check, never the engine
            result = CheckResult(key, False, tolerance, time.perf_counter() - start,
                                 f"could not build the self-check case on {key.device}: {one_line(exc)}", bound=bound)
        else:
            result = _compare(kernel, key, case, inputs, tolerance, bound, start)
    del inputs
    _results[key] = result
    return result


def _proof(kernel: BoundKernel, keys: Iterable[CheckKey]) -> CheckResult:
    """The kernel's first failing check among ``keys``, or its last passing one."""
    result = None
    for key in keys:
        result = run(kernel, key)
        if not result.passed:
            return result
    assert result is not None, "a case module gives every phase at least one key"
    return result


def _bound_kernel(name: str, engine_fns: Mapping[str, Callable[..., Any]]) -> BoundKernel:
    fn = engine_fns.get(name)
    return engine_kernel(name, fn) if fn is not None else bind(name)


def verify(decision: Decision, *, device: torch.device | str, strict: bool, q_dtype: str = "bf16",
           engine_fns: Mapping[str, Callable[..., Any]] | None = None,
           phases: Iterable[str] | None = None) -> tuple[dict[str, str], str]:
    """Self-check each phase's kernel of ``decision``; fall back along its alternates on failure.

    :param decision: the :class:`~mla_sm120_plugin.types.Decision` (its context says the family, the
        layout, the heads and, for a family with call shapes, the pages the engine's call passes).
    :param device: the engine's device.
    :param strict: refuse on the first failure instead of falling back.
    :param q_dtype: the q dtype the engine passes ("bf16").
    :param engine_fns: kernel name -> the callable that runs it as the engine calls it, for kernels
        the engine runs itself (FlashInfer's two-cache kernel); others bind from their entry.
    :param phases: the phases to check (default: every phase of the decision).
    :returns: phase -> the kernel to run (an alternate where a fallback took over), and one log line
        with every result, each fallback and the time spent.
    :raises UnsupportedConfiguration: a phase whose kernel failed has no alternate that passes
        (or ``strict``).
    """
    ctx = decision.context
    case = case_of(families.get(ctx.family))
    fns = engine_fns or {}
    device = torch.device(device)
    start = time.perf_counter()
    chosen: dict[str, str] = {}
    parts: list[str] = []
    for phase in (phases or [p for p in case.ORDER if p in decision.kernels]):
        name = decision.kernels[phase]
        failures: list[CheckResult] = []
        for candidate in (name, *(() if strict else decision.alternates.get(phase, ()))):
            keys = [CheckKey(**fields) for fields in case.keys(decision, phase, candidate, q_dtype=q_dtype,
                                                               device=str(device))]
            try:
                result = _proof(_bound_kernel(candidate, fns), keys)
            except MlaSm120Error as exc:  # its entry does not import here
                result = CheckResult(keys[0], False, 0.0, 0.0, one_line(exc))
            if result.passed:
                chosen[phase] = candidate
                fell = "".join(f"{r.summary()}; falling back to " for r in failures)
                parts.append(f"{phase}={fell}{result.summary()}")
                break
            failures.append(result)
        else:
            raise UnsupportedConfiguration(_refusal(decision, phase, failures, device, strict))
    line = f"mla_sm120: {_label(decision)}self-check: {'; '.join(parts)}; {time.perf_counter() - start:.2f} s"
    return chosen, line


def _label(decision: Decision) -> str:
    call = decision.context.call
    return "" if call is None else f"{call.kind} "


def _refusal(decision: Decision, phase: str, failures: list[CheckResult], device: torch.device, strict: bool) -> str:
    call = decision.context.call
    words = "" if call is None else f"{families.get(decision.context.family).label} {call.kind} "
    first = failures[0]
    tried = "; ".join(f"{r.key.kernel}: {r.error}" for r in failures)
    return format_error(
        f"{decision.context.describe()}: {words}{phase} kernel {first.key.kernel} failed its self-check on {device} "
        f"({first.error})" + ("" if strict else f"; alternates tried: {tried if len(failures) > 1 else 'none'}"),
        f"a {phase} kernel that matches float64 attention within its declared bounds here",
        "force another kernel (decode_kernel / prefill_kernel in the plugin config), fix or update the failing "
        f"kernel's package, or set {ENV}=off to skip the check (at your own risk)"
        + ("" if not strict else f"; {ENV}=on falls back instead of raising"))


def verify_at_init(decision: Decision, engine_fns: Mapping[str, Callable[..., Any]] | None = None
                   ) -> tuple[dict[str, str], str]:
    """What an engine adapter runs when it binds: :func:`verify` on bf16 q on the worker's device, as
    :data:`ENV` says (``off`` skips it, ``strict`` refuses instead of falling back).

    :returns: phase -> the kernel to run, and the self-check's log line.
    :raises UnsupportedConfiguration: as :func:`verify`.
    """
    check_mode = mode()
    if check_mode == "off":
        return dict(decision.kernels), f"mla_sm120: {_label(decision)}self-check skipped ({ENV}=off)"
    return verify(decision, device=engine_device(), strict=check_mode == "strict", engine_fns=engine_fns)


def _bound_row(bound: AccuracyBound | None) -> dict[str, float] | None:
    """A kernel's declared accuracy bound as JSON (None when it declares only a tolerance)."""
    if bound is None:
        return None
    return dict(cos_diff=bound.cos_diff, rel_rms=bound.rel_rms, max_error=bound.max_rel)


def sweep(device: torch.device | str) -> list[dict[str, Any]]:
    """``doctor --self-check``: every registered kernel that can run here, on each case its family
    sweeps (each layout it reads; DSA: each scale format and phase), as JSON-ready rows."""
    from ..device import detect
    from ..hooks.manager import get_registry
    from ..selection import probe_reasons

    here = detect(use_torch=True)
    target = str(torch.device(device))
    rows = []
    for name, spec in get_registry().kernels.items():
        if probe_reasons(spec, here):
            continue  # `doctor` already says why it cannot run here
        for fields, shown in _kernel_case(spec).sweep_keys(name, spec, num_heads=SWEEP_HEADS, device=target):
            key = CheckKey(**fields)
            row = dict(kernel=name, phase=key.phase, kv_layout=key.kv_layout, heads=key.num_heads, device=target,
                       **shown)
            try:
                result = run(bind(name), key)
            except MlaSm120Error as exc:  # the entry does not import
                row.update(ran=False, passed=False, cos_diff=None, rel_rms=None, max_error=None, lse_error=None,
                           lse_bound=None, tolerance=spec.tolerance, bound=_bound_row(spec.accuracy), seconds=0.0,
                           error=f"{type(exc).__name__}: {exc}")
            else:
                got = result.accuracy
                row.update(ran=result.ran, passed=result.passed, cos_diff=None if got is None else got.cos_diff,
                           rel_rms=None if got is None else got.rel_rms, max_error=result.max_error,
                           lse_error=None if result.lse is None else result.lse.max_abs,
                           lse_bound=None if key.lse is None else _lse_bound(result.bound),
                           tolerance=result.tolerance, bound=_bound_row(result.bound), seconds=result.seconds,
                           error=result.error)
            rows.append(row)
    return rows
