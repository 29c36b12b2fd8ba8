"""Prove a bound kernel on this machine, at engine init, before any weight loads.

A kernel that does not compile here (a Triton or FlashInfer JIT failure) or reads the cache wrong
(a scale-format mix-up: vllm#54563) would otherwise show at the engine's first forward, after the
weights have loaded, or never. :func:`check` runs the kernel once on a small deterministic case in
the real cache layout and scale format, with the real heads per rank, top-k and q dtype, and
adversarial candidates (-1, out of range, duplicates, a short ``topk_length``), and compares it
with float64 attention over the case's dequantized rows (the torch reference run in float64) in
FlashMLA's metrics - cos_diff, relRMS and max error (:mod:`mla_sm120_plugin.kernels.accuracy`) -
against the kernel's declared ``KernelSpec.accuracy`` (``KernelSpec.tolerance``, a max error, for
a kernel that declares none). An exact-class kernel is held to cos_diff <= 5e-6 and relRMS <= 0.3 %:
sharp enough that a wrong scale in one step of one tile, or a dropped low half of an fp8 pair,
fails it. Results are kept per process and per :class:`CheckKey`, so 78 layers pay for one check.

:func:`verify` applies it to a decision: a kernel that fails is replaced by the next kernel the
decision allows for that phase (that passes its own check), or the engine stops with
:class:`~mla_sm120_plugin.errors.UnsupportedConfiguration`. ``MLA_SM120_SELF_CHECK`` chooses:
``on`` (default), ``off`` (skip, logged) or ``strict`` (a failure raises, no fallback).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from mla_sm120_plugin.errors import UnsupportedConfiguration, format_error
from mla_sm120_plugin.kernels.accuracy import Accuracy, AccuracyBound, measure
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.dispatch.binding import BoundKernel, bind
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla

ENV = "MLA_SM120_SELF_CHECK"
MODES = ("on", "off", "strict")
NUM_PAGES = 4
# Tokens a call checks, per phase. On a GPU, prefill takes more than 64 tokens: FlashInfer's
# prefill path starts there. The CPU (Triton's interpreter) checks a few tokens per phase.
TOKENS_GPU = {"decode": 2, "prefill": 65}
TOKENS_CPU = {"decode": 2, "prefill": 3}
_TILE_GAINS = (0.5, 1.0, 2.0, 4.0)  # tiles of different magnitude, so a wrong per-tile scale shows


def adversarial_ids(num_slots: int) -> tuple[int, ...]:
    """The first candidates of token 0 in every case: padding, the first slot past the cache, one far
    past it and a valid slot. The candidate after them repeats the next one (a duplicate counts twice)."""
    return (-1, num_slots, num_slots + 1000, 3)


@dataclass(frozen=True)
class CheckKey:
    """What makes two self-checks different; one check per key and process."""

    kernel: str
    phase: str
    kv_layout: str
    scale_format: str  # what the kernel is told
    written_format: str  # how the case's cache scales are written
    num_heads: int
    topk: int
    q_dtype: str
    device: str


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one self-check.

    :param key: what was checked.
    :param ran: the kernel ran (compiled and returned); False when it raised.
    :param max_error: max |kernel - reference| / max |reference|; None when it did not run.
    :param tolerance: the kernel's declared max error.
    :param seconds: wall time of the kernel call and the comparison (first compilation included).
    :param error: why it failed, in one line; None when it passed.
    :param accuracy: cos_diff, relRMS and max error against float64; None when it did not run.
    :param bound: the kernel's declared :class:`AccuracyBound`; None when it declares only a tolerance.
    """

    key: CheckKey
    ran: bool
    max_error: float | None
    tolerance: float
    seconds: float
    error: str | None
    accuracy: Accuracy | None = None
    bound: AccuracyBound | None = None

    @property
    def passed(self) -> bool:
        return self.error is None

    def summary(self) -> str:
        if self.passed:
            if self.accuracy is not None and self.bound is not None:
                return f"{self.key.kernel} ok ({self.accuracy.summary()}; bound {self.bound.summary()}; {self.seconds:.2f} s)"
            return f"{self.key.kernel} ok (max error {self.max_error:.2e} <= {self.tolerance:.0e}, {self.seconds:.2f} s)"
        fp8 = self.key.kv_layout in layout.FP8_LAYOUTS
        where = f" on {self.key.written_format}-written scales" if fp8 else ""
        return f"{self.key.kernel} FAILED{where} ({self.error})"


_results: dict[CheckKey, CheckResult] = {}


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


def _case(key: CheckKey, device: torch.device) -> dict[str, Any]:
    """The deterministic inputs of a check, in the geometry the engines pass: 64-row pages.

    Any layout of ``layout.LAYOUTS``: q and the cached tokens are as wide as its ``head_dim`` (576,
    or 512 for GLM-5.3-Flash's rope-less rows), the rows are written by :func:`pack.pack` with the
    key's ``written_format`` (fp8 layouts), reserved bytes as zeros.

    Every tensor is made on the CPU with an explicit dtype, then moved to ``device``: the engines
    build the impl inside their own default device and dtype (vLLM: ``torch.device("cuda")`` and the
    model's bf16), which must change neither the case nor where its generator runs.
    """
    lay = layout.get(key.kv_layout)
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)
    num_slots = NUM_PAGES * layout.PAGE_SIZE
    latent = torch.randn(num_slots, lay.head_dim, generator=gen, dtype=torch.float32, device=cpu)  # [S, D]
    gains = torch.tensor(_TILE_GAINS, dtype=torch.float32, device=cpu).repeat_interleave(layout.FP8_TILE)  # [512]
    latent[:, : lay.latent] *= gains
    rows = pack.pack(latent, key.kv_layout, key.written_format)  # [S, row], uint8 (fp8) or bf16
    tokens = (TOKENS_GPU if device.type == "cuda" else TOKENS_CPU)[key.phase]
    indices = torch.randint(0, num_slots, (tokens, key.topk), generator=gen, dtype=torch.int32, device=cpu)  # [T, topk]
    special = adversarial_ids(num_slots)[: key.topk]
    indices[0, : len(special)] = torch.tensor(special, dtype=torch.int32, device=cpu)
    if key.topk > len(special) + 1:
        indices[0, len(special) + 1] = indices[0, len(special)]  # a duplicate counts twice
    topk_length = torch.full((tokens,), key.topk, dtype=torch.int32, device=cpu)
    if tokens > 1:
        topk_length[1] = max(1, key.topk // 3)
    q = torch.randn(tokens, key.num_heads, lay.head_dim, generator=gen, dtype=torch.float32, device=cpu)  # [T, H, D]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[key.q_dtype]
    return dict(q=q.to(dtype=dtype, device=device), kv_cache=pack.page_view(rows).to(device),  # [P, 64, C]
                indices=indices.to(device), topk_length=topk_length.to(device),
                sm_scale=lay.head_dim**-0.5, kv_layout=key.kv_layout)


@contextlib.contextmanager
def _forward_time_defaults():
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _run_and_compare(kernel: BoundKernel, key: CheckKey, inputs: dict[str, Any], tolerance: float,
                     start: float, bound: AccuracyBound | None = None) -> CheckResult:
    """Call the kernel on the case and compare it with float64 attention over the dequantized rows."""
    device = torch.device(key.device)
    try:
        out = kernel.call(inputs["q"], inputs["kv_cache"], inputs["indices"], sm_scale=inputs["sm_scale"],
                          kv_layout=key.kv_layout, topk_length=inputs["topk_length"], scale_format=key.scale_format)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is the finding
        return CheckResult(key, False, None, tolerance, time.perf_counter() - start, _one_line(exc))
    # The truth: the torch reference on a float64 q computes in float64 throughout, over the rows as
    # the cache dequantizes them, so only the kernel's own arithmetic counts.
    try:
        ref = torch_sparse_mla(inputs["q"].double(), inputs["kv_cache"], inputs["indices"], sm_scale=inputs["sm_scale"],
                               kv_layout=key.kv_layout, topk_length=inputs["topk_length"])
    except Exception as exc:  # noqa: BLE001 - no ground truth on this device: the kernel is unproven
        return CheckResult(key, True, None, tolerance, time.perf_counter() - start,
                           f"the torch reference could not run on {device}: {_one_line(exc)}", bound=bound)
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return CheckResult(key, True, None, tolerance, time.perf_counter() - start,
                           f"output shape {shape}, expected {tuple(ref.shape)}", bound=bound)
    got = measure(out, ref)
    error = None
    if bound is not None:
        over = bound.violations(got)
        if over:
            error = f"{', '.join(over)} against float64 (bound {bound.summary()})"
    elif not got.max_rel <= tolerance:  # NaN fails too
        error = f"max error {got.max_rel:.3g} of the output's magnitude > tolerance {tolerance:g}"
    return CheckResult(key, True, got.max_rel, tolerance, time.perf_counter() - start, error, got, bound)


def check(kernel: BoundKernel, *, phase: str, kv_layout: str, scale_format: str, num_heads: int, topk: int,
          q_dtype: str = "bf16", device: torch.device | str = "cpu", written_format: str | None = None) -> CheckResult:
    """Run ``kernel`` once on this machine against the torch reference (cached per key).

    :param kernel: the bound kernel.
    :param phase: "decode" or "prefill" (sets the number of tokens).
    :param kv_layout: any layout of ``layout.KV_LAYOUTS``.
    :param scale_format: the scale format the kernel is told ("pow2" or "arbitrary").
    :param num_heads: heads per rank.
    :param topk: the index top-k.
    :param q_dtype: "bf16" (what engines pass) or "fp32".
    :param device: where the engine runs the kernel.
    :param written_format: how the case's scales are written (default: ``scale_format``).
    :returns: the :class:`CheckResult`; never raises for a failing kernel.
    """
    from mla_sm120_plugin.hooks.manager import get_registry

    device = torch.device(device)
    key = CheckKey(kernel.name, phase, kv_layout, scale_format, written_format or scale_format, num_heads, topk,
                   q_dtype, str(device))
    if key in _results:
        return _results[key]
    spec = get_registry().kernels[kernel.name]
    tolerance, bound = spec.tolerance, spec.accuracy
    start = time.perf_counter()
    inputs: dict[str, Any] = {}
    with _forward_time_defaults():
        try:
            inputs = _case(key, device)
        except Exception as exc:  # noqa: BLE001 - a case this device cannot hold fails the check, never the engine
            result = CheckResult(key, False, None, tolerance, time.perf_counter() - start,
                                 f"could not build the self-check case on {device}: {_one_line(exc)}", bound=bound)
        else:
            result = _run_and_compare(kernel, key, inputs, tolerance, start, bound)
    del inputs
    _results[key] = result
    return result


def verify(decision: Any, kernels: dict[str, BoundKernel], *, q_dtype: str, device: torch.device | str,
           strict: bool) -> tuple[dict[str, BoundKernel], str]:
    """Self-check each phase's bound kernel; fall back along ``decision.alternates`` on failure.

    :param decision: the :class:`~mla_sm120_plugin.types.Decision` the kernels were bound from.
    :param kernels: phase -> bound kernel.
    :param q_dtype: the q dtype the engine passes ("bf16").
    :param device: the engine's device.
    :param strict: raise on the first failure instead of falling back.
    :returns: phase -> the kernel to run (rebound where a fallback took over), and one log line
        with every result, each fallback and the time spent.
    :raises UnsupportedConfiguration: a phase whose kernel failed has no alternate that passes
        (or ``strict``).
    """
    ctx = decision.context
    start = time.perf_counter()
    chosen: dict[str, BoundKernel] = {}
    parts: list[str] = []
    # A kernel told "arbitrary" must also read power-of-two scales right: vLLM 0.33's DSA cache
    # writer stores pow2 scales for every model, GLM included, and GLM-5.3-Flash's rope-less rows
    # (concat_and_cache_mla) may hold either. One told "pow2" reads only pow2.
    written = [decision.scale_format]
    if ctx.kv_cache_dtype in layout.FP8_LAYOUTS and decision.scale_format == layout.SCALE_ARBITRARY:
        written.append(layout.SCALE_POW2)

    def run(kernel: BoundKernel, phase: str) -> CheckResult:
        """The kernel's first failing check for ``phase``, or its last passing one."""
        for fmt in written:
            result = check(kernel, phase=phase, kv_layout=ctx.kv_cache_dtype, scale_format=decision.scale_format,
                           written_format=fmt, num_heads=ctx.num_heads, topk=ctx.index_topk, q_dtype=q_dtype,
                           device=device)
            if not result.passed:
                return result
        return result

    for phase, bound in kernels.items():
        result = run(bound, phase)
        if result.passed:
            chosen[phase] = bound
            parts.append(f"{phase}={result.summary()}")
            continue
        failures = [result]
        if not strict:
            for name in decision.alternates.get(phase, ()):
                alternate = bind(name)
                alt_result = run(alternate, phase)
                if alt_result.passed:
                    chosen[phase] = alternate
                    parts.append(f"{phase}={result.summary()}; falling back to {alt_result.summary()}")
                    break
                failures.append(alt_result)
        if phase not in chosen:
            tried = "; ".join(f"{r.key.kernel}: {r.error}" for r in failures)
            raise UnsupportedConfiguration(format_error(
                f"{ctx.describe()}: {phase} kernel {bound.name} failed its self-check on {device} "
                f"({result.error})" + ("" if strict else f"; alternates tried: {tried if len(failures) > 1 else 'none'}"),
                f"a {phase} kernel that matches float64 attention within its declared bounds here",
                "force another kernel (decode_kernel / prefill_kernel in the plugin config), fix or update the "
                f"failing kernel's package, or set {ENV}=off to skip the check (at your own risk)"
                + ("" if not strict else f"; {ENV}=on falls back instead of raising"),
            ))
    line = f"mla_sm120: self-check: {'; '.join(parts)}; {time.perf_counter() - start:.2f} s"
    return chosen, line


def engine_device() -> torch.device:
    """Where an engine worker runs the kernels: its current CUDA device, or the CPU without one."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_at_init(decision: Any, kernels: dict[str, BoundKernel]) -> tuple[dict[str, BoundKernel], str]:
    """What an engine adapter runs when it binds: :func:`verify` on bf16 q on the worker's device,
    as :data:`ENV` says (``off`` skips it, ``strict`` refuses instead of falling back).

    :returns: phase -> the kernel to run, and the self-check's log line.
    :raises UnsupportedConfiguration: as :func:`verify`.
    """
    check_mode = mode()
    if check_mode == "off":
        return kernels, f"mla_sm120: self-check skipped ({ENV}=off)"
    return verify(decision, kernels, q_dtype="bf16", device=engine_device(), strict=check_mode == "strict")
