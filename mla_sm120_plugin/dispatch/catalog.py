"""The built-in kernels' specs, registered through ``mla_sm120_kernels`` like any plugin's.

Each spec states its envelope as data; probes and dynamic envelopes import their packages
lazily, so yielding the specs costs nothing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Iterator

from ..hooks.specs import hookimpl
from ..types import DECODE, EXACT, FAST, PREFILL, DeviceInfo, KernelSpec, ModelProfile, SelectionContext
from .flashinfer import FLASHINFER_LAYOUTS  # pure Python at import: torch/flashinfer load inside its functions
from ..kernels.accuracy import EXACT_CLASS_BOUND, AccuracyBound
from ..kernels.dsa.layout import BF16, BF16_NOPE, FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE, NVFP4_DS_MLA
from ..kernels.dsv4.layout import FP8_DSV4, NVFP4_DSV4

FLASHINFER = "flashinfer_sparse_mla"
FLASHINFER_DSV4 = "flashinfer_dsv4_sm120"
TRITON_DSV4 = "triton_dsv4"
TRITON_FAST = "triton_sparse_mla_fast"
TRITON = "triton_sparse_mla"
TORCH = "torch_sparse_mla"
BUILTIN_KERNELS = (FLASHINFER, TRITON_FAST, TRITON, TORCH, FLASHINFER_DSV4, TRITON_DSV4)

# A kernel that rounds q and the probabilities to a single fp8 e4m3 each for fp8 MMAs (FlashInfer's
# SM120 kernels) differs from float64 by the format's own error: 3.0-4.9 % relRMS, cos_diff
# 4.7e-4 - 1.2e-3, up to 13.3 % of the output's largest value on the self-check's cases (measured on
# the single-e4m3 Triton kernel under the interpreter, which ran those numerics exactly). A wrong
# per-tile scale costs ~100 %.
FP8_QP_TOLERANCE = 0.15
FP8_QP_ACCURACY = AccuracyBound(cos_diff=3e-3, rel_rms=8e-2, max_rel=FP8_QP_TOLERANCE)

# SM families the Triton kernel is written for: mma.sync-class tensor cores (SM80+) and no
# reliance on wgmma/tcgen05, which SM12x lacks.
TRITON_SM_FAMILIES = frozenset({8, 9, 10, 12})


def _missing_package(module: str, pip_name: str) -> tuple[str, ...]:
    if importlib.util.find_spec(module) is None:
        return (f"{module} is not installed (pip install {pip_name})",)
    return ()


def _flashinfer_probe(device: DeviceInfo) -> tuple[str, ...]:
    # The binding's own probe reports a missing package too; its module imports nothing heavy.
    from . import flashinfer

    return tuple(flashinfer.probe())


def _flashinfer_envelope(ctx: SelectionContext, phase: str, profile: ModelProfile | None) -> tuple[str, ...]:
    # FlashInfer's table ships with the plugin (dispatch/flashinfer_table.py): a planned check and a
    # core-only install decide as the engine does, without importing flashinfer or torch. Where the
    # device is this machine's and flashinfer is installed, its own table is read too (the probe
    # gates binding on that install anyway) and the reasons of both count. The FlashInfer family
    # comes from the resolved scale format alone: the one the call will run.
    from . import flashinfer

    live = not ctx.device.is_planned and importlib.util.find_spec("flashinfer") is not None
    return flashinfer.envelope_reasons(
        phase=phase,
        num_heads=ctx.num_heads,
        topk=ctx.index_topk,
        max_tokens=ctx.max_tokens_for(phase),
        kv_layout=ctx.kv_cache_dtype,
        scale_format=ctx.kv_scale_format,
        source=flashinfer.BOTH if live else flashinfer.PACKAGED,
    )


def _flashinfer_table_note() -> str | None:
    from . import flashinfer_table

    return flashinfer_table.table_note()


def _gpu_or_interpreter(device: DeviceInfo) -> tuple[str, ...]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ()
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA GPU on this machine (TRITON_INTERPRET=1 runs it on the CPU, for testing only)",)
    major, minor = torch.cuda.get_device_capability()
    if major not in TRITON_SM_FAMILIES:
        return (f"GPU is sm_{major}{minor}; the Triton kernel targets SM families {sorted(TRITON_SM_FAMILIES)}",)
    return ()


def _triton_probe(device: DeviceInfo) -> tuple[str, ...]:
    return _missing_package("torch", "torch") or _missing_package("triton", "triton") or _gpu_or_interpreter(device)


def _torch_probe(device: DeviceInfo) -> tuple[str, ...]:
    return _missing_package("torch", "torch")


FLASHINFER_SPEC = KernelSpec(
    name=FLASHINFER,
    phases=frozenset({PREFILL, DECODE}),
    kv_cache_dtypes=frozenset(FLASHINFER_LAYOUTS),
    vendors=frozenset({"nvidia"}),
    sm_families=frozenset({12}),
    priority=300,
    entry="mla_sm120_plugin.dispatch.flashinfer:flashinfer_sparse_mla",
    probe=_flashinfer_probe,
    envelope=_flashinfer_envelope,
    envelope_note=_flashinfer_table_note,
    graph_safe=True,
    sinks=True,
    returns_lse=True,
    description="FlashInfer's native SM120/SM121 sparse MLA (fp8 Q/P internally)",
    precision=FAST,
    # Q and P are quantized to a single fp8 e4m3 each inside (3 mantissa bits).
    tolerance=FP8_QP_TOLERANCE,
    accuracy=FP8_QP_ACCURACY,
)

TRITON_FAST_SPEC = KernelSpec(
    name=TRITON_FAST,
    phases=frozenset({PREFILL, DECODE}),
    # Not nvfp4_ds_mla: its 16-value e4m3 block scales are not the e8m0-per-32 scales tl.dot_scaled
    # takes, so the exact kernel (which dequantizes e2m1 x e4m3 exactly into bf16) serves it, under
    # precision "fast" too.
    kv_cache_dtypes=frozenset({FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE}),
    vendors=frozenset({"nvidia", "cpu"}),
    sm_families=TRITON_SM_FAMILIES,
    priority=250,
    entry="mla_sm120_plugin.kernels.dsa.triton_fast:triton_sparse_mla_fast",
    probe=_triton_probe,
    graph_safe=True,
    sinks=True,
    returns_lse=True,
    description="Triton fp8-MMA kernel (block-scaled QMMA on SM12x, emulated on sm_90): e4m3 hi+lo q/p, fp32 partials",
    # q and the probabilities as e4m3 hi + lo pairs: exact class (triton_fast.ACCURACY, the same bound;
    # that module imports torch).
    precision=EXACT,
    tolerance=EXACT_CLASS_BOUND.max_rel,
    accuracy=EXACT_CLASS_BOUND,
)

TRITON_SPEC = KernelSpec(
    name=TRITON,
    phases=frozenset({PREFILL, DECODE}),
    kv_cache_dtypes=frozenset({FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE, NVFP4_DS_MLA, BF16, BF16_NOPE}),
    # "cpu" only through Triton's interpreter (the probe checks TRITON_INTERPRET=1).
    vendors=frozenset({"nvidia", "cpu"}),
    sm_families=TRITON_SM_FAMILIES,
    priority=200,
    entry="mla_sm120_plugin.kernels.dsa.triton:triton_sparse_mla",
    probe=_triton_probe,
    graph_safe=True,
    sinks=True,
    returns_lse=True,
    description="portable Triton kernel, split-K decode, in-kernel fp8 dequant",
    # bf16 dot operands on a GPU (probabilities rounded to 8 bits): 0.4-0.7 % max error measured on an
    # H200 against the fp32 reference; against float64, under the interpreter (which now rounds dot
    # operands to bf16 as a GPU does): cos_diff <= 3e-6, relRMS <= 0.24 %. The same for nvfp4_ds_mla:
    # its dequantized keys and values (e2m1 x e4m3 block scale, <= 5 significant bits; e4m3 rope) are
    # exact in bf16, so only q and the probabilities round, as for the other layouts.
    tolerance=EXACT_CLASS_BOUND.max_rel,
    accuracy=EXACT_CLASS_BOUND,
)

TORCH_SPEC = KernelSpec(
    name=TORCH,
    phases=frozenset({PREFILL, DECODE}),
    kv_cache_dtypes=frozenset({FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE, NVFP4_DS_MLA, BF16, BF16_NOPE}),
    vendors=frozenset({"nvidia", "amd", "cpu"}),
    priority=100,
    entry="mla_sm120_plugin.kernels.dsa.reference:torch_sparse_mla",
    probe=_torch_probe,
    # Chunked loops and boolean masks: not capturable, and far too slow to serve from a graph.
    graph_safe=False,
    sinks=True,
    returns_lse=True,
    description="torch reference: ground truth, any device, memory-bounded",
    # The ground truth itself, in fp32: what its self-check sees is the rounding of a bf16 output
    # (<= 2**-8 of the magnitude, relRMS ~0.16 %) and fp32 summation order; it proves that it runs
    # on this device.
    tolerance=EXACT_CLASS_BOUND.max_rel,
    accuracy=EXACT_CLASS_BOUND,
)


def _flashinfer_dsv4_envelope(ctx: SelectionContext, phase: str, profile: ModelProfile | None) -> list[str]:
    from . import flashinfer_dsv4

    return flashinfer_dsv4.envelope_reasons(ctx, phase)


def _flashinfer_dsv4_probe(device: DeviceInfo) -> tuple[str, ...]:
    from . import flashinfer_dsv4

    return flashinfer_dsv4.probe(device)


FLASHINFER_DSV4_SPEC = KernelSpec(
    name=FLASHINFER_DSV4,
    phases=frozenset({PREFILL, DECODE}),
    kv_cache_dtypes=frozenset({FP8_DSV4, NVFP4_DSV4}),
    vendors=frozenset({"nvidia"}),
    sm_families=frozenset({12}),
    priority=300,
    # The engines call it themselves; where it serves a (layer kind, phase), the plugin leaves
    # their call as it is (the self-check calls this entry on the same surface).
    entry="flashinfer.decode:trtllm_batch_decode_sparse_mla_dsv4",
    probe=_flashinfer_dsv4_probe,
    envelope=_flashinfer_dsv4_envelope,
    envelope_note=_flashinfer_table_note,
    graph_safe=True,
    sinks=True,
    description="FlashInfer's SM120/SM121 DeepSeek-V4 kernels (window + compressed cache, sinks; JIT-built)",
    # Its prefill form multiplies a bf16 q with fp8 probabilities (QkBF16PvFP8); its decode numerics
    # are not measured here (no SM12x GPU): it is not claimed exact. The DSA kernels' fp8 q/p bound.
    precision=FAST,
    tolerance=FP8_QP_TOLERANCE,
    accuracy=FP8_QP_ACCURACY,
)


TRITON_DSV4_SPEC = KernelSpec(
    name=TRITON_DSV4,
    phases=frozenset({PREFILL, DECODE}),
    kv_cache_dtypes=frozenset({FP8_DSV4, NVFP4_DSV4}),
    # "cpu" only through Triton's interpreter (the probe checks TRITON_INTERPRET=1).
    vendors=frozenset({"nvidia", "cpu"}),
    sm_families=TRITON_SM_FAMILIES,
    priority=200,
    entry="mla_sm120_plugin.dispatch.dsv4:triton_dsv4",  # FlashInfer's SM120 call surface
    probe=_triton_probe,
    graph_safe=True,
    sinks=True,
    description="portable Triton DeepSeek-V4 kernel: window + compressed cache in one pass, sinks, in-kernel "
                "fp8 / NVFP4 dequant (one program a token, 16 heads and a range of the candidates: split-K "
                "where one wave leaves CTA slots free, partials merged by the shared combine)",
    # Exact keys and values in bf16, bf16 q and probabilities, fp32 accumulation: against float64
    # (benchmarks/dsv4_accuracy.py) cos_diff <= 2.4e-6, relRMS <= 0.22 %.
    precision=EXACT,
    tolerance=EXACT_CLASS_BOUND.max_rel,
    accuracy=EXACT_CLASS_BOUND,
)


@hookimpl
def mla_sm120_kernels() -> Iterator[KernelSpec]:
    yield FLASHINFER_SPEC
    yield TRITON_FAST_SPEC
    yield TRITON_SPEC
    yield TORCH_SPEC
    yield FLASHINFER_DSV4_SPEC
    yield TRITON_DSV4_SPEC
