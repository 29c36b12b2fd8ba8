"""How close a kernel's output is to the truth, in FlashMLA's metrics (docs/facts.md#accuracy-metrics-and-regimes).

The truth is float64 attention over the *dequantized* cache rows, so only a kernel's own arithmetic
counts (the cache's rounding is the same for every kernel). Three numbers over the whole output:

* ``cos_diff = 1 - 2 <a, b> / (|a|^2 + |b|^2)`` (FlashMLA's ``kernelkit/compare.py``; about
  ``rel_rms ** 2 / 2``): FlashMLA's tests hold its sparse fp8 decode to 5e-6;
* ``rel_rms = |a - b| / |b|``: the error's energy against the output's;
* ``max_rel = max |a - b| / max |b|``: the worst element against the largest (it swings with
  few-candidate cases, so it is reported, and bounded loosely).

A kernel declares an :class:`AccuracyBound` in these metrics (its class: ``exact`` kernels hold
cos_diff <= 5e-6 and rel_rms <= 0.3 %, or tighter); tests, ``bench``, the accuracy benchmark and
the engines' self-check measure and report the same three numbers. Where a caller reads the kernel's
LSE too (a decode-context-parallel merge weighs each rank by it), the bound holds it within
``lse_abs`` nats of float64's (:func:`measure_lse`: -inf exactly where float64 has nothing, never NaN).

Importing this module imports nothing heavy; :func:`measure` takes torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_sm120_plugin.errors import KernelInputError, PluginError, format_error

if TYPE_CHECKING:
    import torch

# FlashMLA's bar for sparse fp8 decode (cos_diff) and the relative RMS it implies.
EXACT_COS_DIFF = 5e-6
EXACT_REL_RMS = 3e-3
# The LSE a kernel returns, against float64's, in nats (what a merge's weight e^lse is off by, relatively).
# Exact class: the Triton kernels and the reference are within 1.9e-6 nats of float64 on the self-check's DCP
# case (a bf16 q, fp32 scores; measured under Triton's interpreter, both bases, fp8 and bf16 caches); the
# bound leaves 500x that and is far under what a wrong base (0.44 x |lse|), a sink counted twice
# (>= log 1.27 = 0.24 for a sink within a nat of the row's LSE) or a dropped candidate costs.
EXACT_LSE_ABS = 1e-3
# A single e4m3 q (per head and 128-wide tile, power-of-two scale: FlashInfer's SM120 kernels) moves the
# LSE by up to 0.10 nats on the self-check's case (emulated in float64 on the CPU: top-k 128-2048, 3 seeds,
# the case's softmax scale and tile gains; 0.64 at a peaked scale of 0.135); 2.5x that.
FAST_LSE_ABS = 0.25
# The bar as the messages and tables print it.
EXACT_BAR = f"cos_diff <= {EXACT_COS_DIFF:.0e}, relRMS <= {EXACT_REL_RMS:.2%}"


@dataclass(frozen=True)
class Accuracy:
    """One comparison's result (see the module docstring); all three are >= 0, ``inf`` when the
    output is nonzero or not finite where the reference is all zero or finite."""

    cos_diff: float
    rel_rms: float
    max_rel: float

    def summary(self) -> str:
        return f"cos_diff {self.cos_diff:.2e}, relRMS {self.rel_rms:.3%}, max {self.max_rel:.3%}"


@dataclass(frozen=True)
class LseAccuracy:
    """One LSE comparison (:func:`measure_lse`).

    :param max_abs: the largest |kernel - float64| in nats where both are finite (0 with none).
    :param nan: entries the kernel reports as NaN.
    :param inf_mismatch: entries that are -inf on one side only (where the comparison needs both).
    """

    max_abs: float
    nan: int = 0
    inf_mismatch: int = 0

    def summary(self) -> str:
        extra = "".join(f", {n} {what}" for n, what in ((self.nan, "NaN"), (self.inf_mismatch, "-inf mismatched"))
                        if n)
        return f"LSE max {self.max_abs:.1e} nats{extra}"


@dataclass(frozen=True)
class AccuracyBound:
    """What a kernel promises against float64 over the dequantized rows (:class:`Accuracy`'s
    metrics, and ``lse_abs``: the LSE it returns within so many nats, :class:`LseAccuracy`; None: its
    class's, :data:`EXACT_LSE_ABS` or :data:`FAST_LSE_ABS`). Validates itself: each bound is a finite
    number > 0 (else :class:`PluginError`)."""

    cos_diff: float
    rel_rms: float
    max_rel: float
    lse_abs: float | None = None

    def __post_init__(self) -> None:
        for name in ("cos_diff", "rel_rms", "max_rel", "lse_abs"):
            value = getattr(self, name)
            if name == "lse_abs" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise PluginError(format_error(f"AccuracyBound.{name}={value!r}", "a finite number > 0",
                                               f"state the {name} the kernel meets against float64 (exact class: "
                                               f"cos_diff {EXACT_COS_DIFF:.0e}, rel_rms {EXACT_REL_RMS:g})"))

    @property
    def exact_class(self) -> bool:
        """Whether the bound is within FlashMLA's bar (cos_diff <= 5e-6 and rel_rms <= 0.3 %)."""
        return self.cos_diff <= EXACT_COS_DIFF and self.rel_rms <= EXACT_REL_RMS

    @property
    def lse_bound(self) -> float:
        """The LSE bound in nats: the stated one, else the class's."""
        return self.lse_abs if self.lse_abs is not None else EXACT_LSE_ABS if self.exact_class else FAST_LSE_ABS

    def lse_violations(self, got: LseAccuracy, form: str = "LSE") -> list[str]:
        """What of ``got`` breaks the bound, each as ``"<form>: ..."``; empty when within."""
        out = []
        if got.nan:
            out.append(f"{form}: {got.nan} NaN")
        if got.inf_mismatch:
            out.append(f"{form}: {got.inf_mismatch} entries -inf on one side only (float64's -inf: nothing valid)")
        if not got.max_abs <= self.lse_bound:
            out.append(f"{form}: max |error| {got.max_abs:.3g} nats > {self.lse_bound:g}")
        return out

    def violations(self, got: Accuracy) -> list[str]:
        """Each metric of ``got`` over its bound, as ``"relRMS 4.1% > 0.30%"``; empty when within."""
        out = []
        if not got.cos_diff <= self.cos_diff:
            out.append(f"cos_diff {got.cos_diff:.2e} > {self.cos_diff:.0e}")
        if not got.rel_rms <= self.rel_rms:
            out.append(f"relRMS {got.rel_rms:.3%} > {self.rel_rms:.2%}")
        if not got.max_rel <= self.max_rel:
            out.append(f"max {got.max_rel:.3%} > {self.max_rel:.2%}")
        return out

    def summary(self) -> str:
        return f"cos_diff <= {self.cos_diff:.0e}, relRMS <= {self.rel_rms:.2%}, max <= {self.max_rel:.1%}"


# What the exact-class kernels declare (the Triton kernels and the reference): the bar, and the worst
# element within 1 % of the largest (a bf16 output alone is 0.2-0.5 % there; few-candidate cases
# put a few bf16 steps on one element).
EXACT_CLASS_BOUND = AccuracyBound(cos_diff=EXACT_COS_DIFF, rel_rms=EXACT_REL_RMS, max_rel=1e-2)


def measure(out: "torch.Tensor", ref: "torch.Tensor") -> Accuracy:
    """Compare ``out`` (any float dtype) with ``ref`` (float64 truth) over all elements.

    out, ref: the same shape (e.g. [T, H, 512]); both are widened to float64 here.
    """
    a = out.detach().to(device="cpu", dtype=_float64())
    b = ref.detach().to(device="cpu", dtype=_float64())
    if a.shape != b.shape:
        raise KernelInputError(format_error(f"measure(out {tuple(a.shape)}, ref {tuple(b.shape)})",
                                            "out and ref of the same shape (e.g. [T, H, 512] both)",
                                            "compare the kernel's output with a reference of the same call"))
    if not bool(a.isfinite().all()):
        return Accuracy(math.inf, math.inf, math.inf)
    diff = a - b
    ref_sq = float((b * b).sum())
    out_sq = float((a * a).sum())
    diff_norm = float(diff.norm())
    ref_max = float(b.abs().max()) if b.numel() else 0.0
    if ref_sq == 0.0:
        zero = out_sq == 0.0
        return Accuracy(0.0 if zero else math.inf, 0.0 if zero else math.inf, 0.0 if zero else math.inf)
    cos_diff = max(0.0, 1.0 - 2.0 * float((a * b).sum()) / (out_sq + ref_sq))
    return Accuracy(cos_diff=cos_diff, rel_rms=diff_norm / math.sqrt(ref_sq),
                    max_rel=float(diff.abs().max()) / ref_max)


def measure_lse(got: "torch.Tensor", want: "torch.Tensor", sink: "torch.Tensor | None" = None) -> LseAccuracy:
    """Compare a kernel's LSE ``got`` with float64's ``want``, both in natural log.

    got, want: [T, H]; sink: [H], given when ``got`` is the sink-free LSE of a call with sinks: then a
        head's entries are compared with the sink counted in on both sides (``log(e^lse + e^sink)``), so
        the error is that of the row's mass against the whole denominator (a row the sink dominates
        holds few digits of its own LSE: :func:`mla_sm120_plugin.dispatch.flashinfer.sink_free_lse`);
        heads with a -inf sink are compared as they are.
    """
    import torch

    raw = got.detach().to(device="cpu", dtype=torch.float64)
    b = want.detach().to(device="cpu", dtype=torch.float64)
    if raw.shape != b.shape:
        raise KernelInputError(format_error(f"measure_lse(got {tuple(raw.shape)}, want {tuple(b.shape)})",
                                            "two [T, H] LSEs of the same call", "compare the same call's LSEs"))
    nan = torch.isnan(raw)
    nothing = torch.isneginf(b)  # float64 has no valid candidate (and, with the sink in, no sink)
    a = raw
    if sink is not None:
        s = sink.detach().to(device="cpu", dtype=torch.float64)[None, :].expand_as(b)
        counted = ~torch.isneginf(s)
        a = torch.where(counted, torch.logaddexp(raw, s), raw)
        b = torch.where(counted, torch.logaddexp(b, s), b)
    both = torch.isfinite(a) & torch.isfinite(b)
    # anything but both finite or both -inf (a kernel's +inf included), and something where float64 has nothing
    mismatch = (~(both | (torch.isneginf(a) & torch.isneginf(b))) | (nothing & ~torch.isneginf(raw))) & ~nan
    worst = float((a - b)[both].abs().max()) if bool(both.any()) else 0.0
    return LseAccuracy(max_abs=worst, nan=int(nan.sum()), inf_mismatch=int(mismatch.sum()))


def _float64():
    import torch

    return torch.float64
