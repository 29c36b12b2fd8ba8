"""FlashInfer's native SM120/SM121 sparse MLA, bound to the plugin's kernel contract.

What the native kernel covers (read from ``flashinfer-python`` 0.7.2.post1):

- GPUs: SM12x only (RTX 5090 / RTX PRO 6000 = sm_120, DGX Spark GB10 = sm_121). FlashInfer wants
  torch built for CUDA >= 12.8 (sm_120a) / >= 12.9 (sm_121a), and the kernels are JIT-compiled by
  nvcc on first use unless ``flashinfer-jit-cache`` ships them (``flashinfer-cubin`` does not:
  it carries trtllm-gen cubins, not this module).
- Cache: ``fp8_ds_mla`` only (656-byte rows, see :mod:`.layout`), as ``uint8``; a ``bf16``
  cache has no SM120 sparse kernel. Pow2 scales run FlashInfer's ``dsv3_2`` family
  (``kv_scale_format="pow2_fp32"``), arbitrary fp32 scales its ``glm_nsa`` family
  (``"arbitrary_fp32"``); both are the same 576-wide kernel with a different dequantisation.
- Shapes: calls of up to 64 query tokens go to the split-K decode kernel: any head count 1..128,
  any ``topk >= 1``, page-strided caches allowed. Longer calls go to the prefill kernels, which
  need ``topk % 64 == 0``, a head count in {8, 16, 32, 64, 128} and back-to-back pages.
  :func:`envelope_reasons` says which shapes fall outside, at init, without a GPU, from the table
  packaged per FlashInfer version in :mod:`.flashinfer_table` (and from the installed flashinfer's
  own table where asked).
- Numerics: Q and the softmax probabilities P are quantised to fp8 (e4m3) inside the kernel, with
  fp32 accumulation; upstream tests compare against a reference at ``atol = rtol = 5e-3``. The
  native LSE is base 2; ``lse_scale`` gives the base the caller asks for inside the kernel.
- Sinks are native (``attn_sink``; -inf counts nothing, on every path). FlashInfer folds the sink into
  the LSE it reports (a head with nothing valid reports the sink); where the caller asks for that form
  (``lse_with_sink``, a decode-context-parallel rank) it is returned as it is, otherwise
  :func:`sink_free_lse` takes the sink back out, totally (never NaN).

Everything heavy (torch, flashinfer) is imported inside functions: the selection code imports this
module for :func:`envelope_reasons` and :func:`probe` and must stay cheap. The packaged envelope
(``source="packaged"``) imports neither.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..device import find_nvcc, nvcc_version
from ..engines import SGLANG, VLLM
from ..errors import KernelInputError, KernelUnavailable, format_error
from ..kernels.dsa import layout
from . import flashinfer_table

if TYPE_CHECKING:
    import torch

PIP_PACKAGE = "flashinfer-python"
MIN_VERSION = "0.7.2.post1"

# The FlashInfer names this binding depends on; probe() names whichever is missing.
REQUIRED_API = ("SparseMLASm120Wrapper", "supported_sparse_mla_sm120_configs")
REQUIRED_RUN_PARAMS = ("topk_length", "attn_sink", "out_lse", "return_lse", "lse_scale")


class NativeFormat(NamedTuple):
    """How FlashInfer names one of our fp8 scale formats."""

    family: str  # key of flashinfer.mla.supported_sparse_mla_sm120_configs()
    kv_scale_format: str  # SparseMLASm120Wrapper(kv_scale_format=...)


# Our scale format -> FlashInfer's family and kv_scale_format for the 576-wide DSA layout (0.7.2.post1
# accepts "auto", "pow2_fp32", "arbitrary_fp32", "ue8m0_g32"; at d_qk=576 the first two select
# DSv3.2, "arbitrary_fp32" selects GLM_NSA).
NATIVE_FORMATS: dict[str, NativeFormat] = {
    layout.SCALE_POW2: NativeFormat(family="dsv3_2", kv_scale_format="pow2_fp32"),
    layout.SCALE_ARBITRARY: NativeFormat(family="glm_nsa", kv_scale_format="arbitrary_fp32"),
}
# The rope-less layouts (GLM-5.3-Flash): one family, glm53_nope, whose only scale format is
# "arbitrary_fp32" (at d_qk=512 "auto" would select DSv4). It reads each tile's fp32 scale as a
# value, so power-of-two scales are read right too; the row may be wider than its 528 bytes (vLLM's
# 656-byte rows): the kernel takes the row stride from the tensor.
NOPE_FORMAT = NativeFormat(family="glm53_nope", kv_scale_format="arbitrary_fp32")
# The layouts FlashInfer's SM120 sparse MLA reads.
FLASHINFER_LAYOUTS = (layout.FP8_DS_MLA, layout.FP8_DS_MLA_NOPE, layout.FP8_NOPE)

# Where envelope_reasons() reads FlashInfer's envelope: the table packaged for the installed (else
# newest) flashinfer-python version, pure Python; the installed flashinfer's
# supported_sparse_mla_sm120_configs() (imports flashinfer and torch; the prefill facts, which no
# public API reports, still come from the packaged table); or both, reasons united.
PACKAGED, LIVE, BOTH = "packaged", "live", "both"
ENVELOPE_SOURCES = (PACKAGED, LIVE, BOTH)

LSE_BASES = ("e", "2")
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2

_INSTALL_FIX = f"pip install '{PIP_PACKAGE}>={MIN_VERSION}' (or mla-sm120-plugin[flashinfer])"


# --------------------------------------------------------------------------- probe


@functools.cache
def probe() -> tuple[str, ...]:
    """Why the native kernel cannot run on this machine; empty when it can.

    Cached for the process (it runs ``nvcc --version`` at most once); :func:`clear_caches`
    resets it. Looks at the current CUDA device.
    """
    if importlib.util.find_spec("flashinfer") is None:
        return (f"flashinfer is not installed ({_INSTALL_FIX})",)
    api = _api_reasons()
    if api:
        return api
    reasons: list[str] = []
    sm = _gpu_reasons(reasons)
    if not _module_prebuilt(sm):
        reasons.extend(_toolchain_reasons(sm))
    return tuple(reasons)


def _api_reasons() -> tuple[str, ...]:
    try:
        import flashinfer
        import flashinfer.mla as fi_mla
    except Exception as error:  # a broken install raises anything at import
        return (f"flashinfer fails to import ({type(error).__name__}: {error}); reinstall: {_INSTALL_FIX}",)
    version = getattr(flashinfer, "__version__", "unknown")
    for name in REQUIRED_API:
        try:
            getattr(fi_mla, name)
        except Exception:
            return (
                f"flashinfer {version} is too old: flashinfer.mla.{name} is missing "
                f"(needs >= {MIN_VERSION}); {_INSTALL_FIX}",
            )
    import inspect

    params = inspect.signature(fi_mla.SparseMLASm120Wrapper.run).parameters
    missing = [p for p in REQUIRED_RUN_PARAMS if p not in params]
    if missing:
        return (
            f"flashinfer {version}: SparseMLASm120Wrapper.run lacks {', '.join(missing)} "
            f"(needs >= {MIN_VERSION}); {_INSTALL_FIX}",
        )
    return ()


def _gpu_reasons(reasons: list[str]) -> tuple[int, int] | None:
    """Append GPU problems to ``reasons``; return the current device's (major, minor) if SM12x."""
    import torch

    if not torch.cuda.is_available():
        built = f"torch built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only torch build"
        reasons.append(f"no CUDA GPU is visible (torch.cuda.is_available() is False, {built})")
        return None
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if major != 12:
        reasons.append(
            f"GPU cuda:{index} ({name}) is sm_{major}{minor}; FlashInfer's sparse MLA SM120 kernels "
            "run only on SM12x (sm_120 RTX 50xx / RTX PRO 6000, sm_121 DGX Spark)"
        )
        return None
    need = _min_cuda((major, minor))
    if not _version_at_least(torch.version.cuda, need):
        reasons.append(
            f"torch is built for CUDA {torch.version.cuda}; sm_{major}{minor}a needs CUDA >= {need} "
            "(FlashInfer checks torch.version.cuda): install a torch wheel built for a newer CUDA"
        )
    return major, minor


def _min_cuda(sm: tuple[int, int] | None) -> str:
    return "12.9" if sm is not None and sm[1] >= 1 else "12.8"


def _version_at_least(version: str | None, need: str) -> bool:
    if not version:
        return False
    have = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    return have >= tuple(int(x) for x in need.split("."))


def _module_prebuilt(sm: tuple[int, int] | None) -> bool:
    """True when the sparse_mla_sm120 module needs no compiler (AOT jit-cache or built before)."""
    if sm is None:
        return False  # the JIT spec needs the target GPU to be built
    try:
        from flashinfer.jit.mla import gen_sparse_mla_sm120_module

        return bool(gen_sparse_mla_sm120_module().is_compiled)
    except Exception:
        return False


def _toolchain_reasons(sm: tuple[int, int] | None) -> tuple[str, ...]:
    arch = f"sm_{sm[0]}{sm[1]}a" if sm is not None else "sm_120a"
    need = _min_cuda(sm)
    cache_fix = (
        "or pip install flashinfer-jit-cache matching flashinfer and your CUDA "
        "(flashinfer-cubin alone does not carry this module)"
    )
    if importlib.util.find_spec("flashinfer_jit_cache") is not None and sm is None:
        return ()  # cannot tell without the GPU whether it covers sm_12x; the GPU reason is given
    nvcc = find_nvcc()
    if nvcc is None:
        return (
            "no nvcc to JIT-compile the kernels (looked in $CUDA_HOME, $CUDA_PATH, PATH, /usr/local/cuda) "
            f"and no prebuilt sparse_mla_sm120 module: install CUDA toolkit >= {need} for {arch}, {cache_fix}",
        )
    version = nvcc_version(nvcc)
    if version is None or not _version_at_least(version, need):
        return (
            f"{nvcc} is CUDA {version or 'of unknown version'}; JIT-compiling for {arch} needs CUDA >= {need}: "
            f"point CUDA_HOME at a newer toolkit, {cache_fix}",
        )
    return ()


# ------------------------------------------------------------------------ envelope


@functools.cache
def _sparse_configs() -> dict[str, Any]:
    """flashinfer.mla.supported_sparse_mla_sm120_configs() for fp8 caches (pure Python, no GPU)."""
    import flashinfer.mla as fi_mla

    return dict(fi_mla.supported_sparse_mla_sm120_configs())


@functools.cache
def _live_table() -> flashinfer_table.EnvelopeTable:
    """The installed flashinfer's decode table, with the packaged prefill facts (imports flashinfer)."""
    packaged = flashinfer_table.table()
    decode = {
        family: flashinfer_table.DecodeConfig.from_entry(flashinfer_table.config_entry(config))
        for family, config in _sparse_configs().items()
    }
    version = flashinfer_table.installed_version() or "(version unknown)"
    return flashinfer_table.EnvelopeTable(version, decode, packaged.prefill_heads, packaged.prefill_topk_tile)


def native_format(scale_format: str, kv_layout: str = layout.FP8_DS_MLA) -> NativeFormat:
    """FlashInfer's family and kv_scale_format for a cache of ``kv_layout`` written with ``scale_format``."""
    if kv_layout in layout.LAYOUTS and layout.get(kv_layout).rope == 0 and scale_format in layout.SCALE_FORMATS:
        return NOPE_FORMAT
    try:
        return NATIVE_FORMATS[scale_format]
    except KeyError:
        raise KernelInputError(
            format_error(
                given=f"scale_format={scale_format!r}",
                supported=f"one of {tuple(NATIVE_FORMATS)}",
                fix="pass the model's fp8 scale format: 'pow2' (DeepSeek-V3.2) or 'arbitrary' (GLM)",
            )
        ) from None


@functools.cache
def envelope_reasons(
    *,
    phase: str,
    num_heads: int,
    topk: int,
    max_tokens: int | None,
    kv_layout: str,
    scale_format: str,
    source: str = PACKAGED,
) -> tuple[str, ...]:
    """Why a shape is outside the native kernel's envelope; empty when it is inside.

    The FlashInfer family is the one that runs ``scale_format`` (:data:`NATIVE_FORMATS`: pow2 ->
    ``dsv3_2``, arbitrary -> ``glm_nsa``), so the check reads the table of the kernel the call
    launches. Calls of up to ``max_num_tokens`` (64) tokens are checked against the decode table,
    longer ones against the prefill head set and top-k tile. Cached.

    :param phase: ``"prefill"`` or ``"decode"``; FlashInfer routes by token count, not by phase, so
        this only words the messages.
    :param num_heads: query heads per GPU (after tensor parallelism).
    :param topk: indices per query token (the model's ``index_topk``).
    :param max_tokens: most query tokens one call may see; ``None`` = unbounded.
    :param kv_layout: ``"fp8_ds_mla"`` or ``"bf16"``.
    :param scale_format: ``"pow2"`` or ``"arbitrary"``, already resolved from the model.
    :param source: ``"packaged"`` (:mod:`.flashinfer_table`, imports nothing), ``"live"`` (the
        installed flashinfer's ``supported_sparse_mla_sm120_configs()``) or ``"both"`` (the
        reasons of either, each once).
    :returns: reasons, each naming the value, what is supported and what would fix it.
    """
    loaders = {
        PACKAGED: (flashinfer_table.table,),
        LIVE: (_live_table,),
        BOTH: (flashinfer_table.table, _live_table),
    }
    if source not in loaders:
        raise ValueError(format_error(f"source={source!r}", f"one of {ENVELOPE_SOURCES}", "pass one of them"))
    reasons: list[str] = []
    if kv_layout not in FLASHINFER_LAYOUTS:
        reasons.append(
            f"kv_layout={kv_layout!r}: flashinfer's SM120 sparse MLA reads only packed fp8 caches "
            f"({', '.join(FLASHINFER_LAYOUTS)}; no bf16 sparse SM120 path in {PIP_PACKAGE} "
            f"{flashinfer_table.table().flashinfer_version}); use the engine's fp8 cache or another kernel"
        )
        return tuple(reasons)
    for load in loaders[source]:
        try:
            table = load()
        except Exception as error:  # not installed / too old / broken: probe() says which
            table_reasons = [f"cannot read flashinfer's SM120 sparse-MLA table ({type(error).__name__}: {error})"]
        else:
            table_reasons = _table_reasons(table, phase, num_heads, topk, max_tokens, scale_format, kv_layout)
        reasons.extend(r for r in table_reasons if r not in reasons)
    return tuple(reasons)


def _table_reasons(
    table: flashinfer_table.EnvelopeTable,
    phase: str,
    num_heads: int,
    topk: int,
    max_tokens: int | None,
    scale_format: str,
    kv_layout: str = layout.FP8_DS_MLA,
) -> list[str]:
    """The shape reasons of :func:`envelope_reasons` against one table (the layout is checked once)."""
    try:
        family = native_format(scale_format, kv_layout).family
    except KernelInputError as error:
        return [str(error)]
    config = table.decode.get(family)
    if config is None:
        return [
            f"scale_format={scale_format!r} runs flashinfer family {family!r}, which {PIP_PACKAGE} "
            f"{table.flashinfer_version} does not have (has {sorted(table.decode)})",
        ]
    cache = layout.get(kv_layout)
    if config.d_qk != cache.head_dim or config.bytes_per_token not in (cache.used, cache.row):
        return [
            f"flashinfer family {family!r} reads d_qk={config.d_qk}, {config.bytes_per_token} B/token, "
            f"not the {cache.head_dim}-wide {cache.row}-byte {kv_layout} cache",
        ]

    reasons: list[str] = []
    heads = config.supported_num_heads()
    if num_heads not in heads:
        reasons.append(f"num_heads={num_heads} per GPU: flashinfer {family} serves {heads[0]}..{heads[-1]}")
    if config.topk_is_runtime:
        if topk < config.min_topk:
            reasons.append(f"topk={topk}: flashinfer {family} needs topk >= {config.min_topk}")
    elif topk not in config.topks:
        reasons.append(f"topk={topk}: flashinfer {family} has kernels for topk in {sorted(config.topks)}")

    limit = config.max_num_tokens
    if max_tokens is None or max_tokens > limit:
        bound = f"up to {max_tokens} tokens" if max_tokens is not None else "unbounded length"
        calls = f"{phase} calls of {bound}"
        # Decode calls can be bounded by the engine's settings; that is the fix to name. (The prefill
        # kernels' whole 64-entry index rows are no limit: the binding pads a row with -1.)
        bound_fix = (f"; decode calls of <= {limit} tokens would fit (mla-sm120 check --max-decode-tokens {limit}; "
                     f"vLLM: {VLLM.decode_bound}; SGLang: {SGLANG.decode_bound})") if phase == "decode" else ""
        if num_heads not in table.prefill_heads:
            reasons.append(
                f"num_heads={num_heads} with {calls}: calls over {limit} tokens run flashinfer's prefill kernels, "
                f"which exist for heads {sorted(table.prefill_heads)} "
                f"(decode takes 1..{heads[-1]} up to {limit} tokens a call){bound_fix}"
            )
    return reasons


def clear_caches() -> None:
    """Forget cached probe and envelope answers (for tests; the wrappers stay)."""
    probe.cache_clear()
    envelope_reasons.cache_clear()
    _sparse_configs.cache_clear()
    _live_table.cache_clear()
    flashinfer_table.clear_caches()


# ------------------------------------------------------------------------- binding

# One SparseMLASm120Wrapper per (device index, kv_scale_format). The wrapper owns FlashInfer's
# scratch arenas and per-shape plans (its "workspace"); it is created on the first eager call and
# reused, never created during CUDA graph capture.
_WRAPPERS: dict[tuple[int, str], Any] = {}


def _wrapper_init_kwargs(device: torch.device, kv_scale_format: str) -> dict[str, Any]:
    """Keyword arguments for ``flashinfer.mla.SparseMLASm120Wrapper(...)``."""
    return {
        "d_v": layout.KV_LORA_RANK,
        "kv_scale_format": kv_scale_format,
        "kv_cache_format": "fp8",
        "device": device,
    }


def _native_call_kwargs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    output: torch.Tensor,
    *,
    sm_scale: float,
    topk_length: torch.Tensor | None,
    sink: torch.Tensor | None,
    out_lse: torch.Tensor | None,
    lse_scale: float,
) -> dict[str, Any]:
    """Keyword arguments for ``SparseMLASm120Wrapper.run(...)``; tensors must already be checked.

    ``out_lse`` is always ours when an LSE is wanted: without it the wrapper returns a view of a
    buffer it reuses on the next call.
    """
    return {
        "q": q,
        "kv_cache": kv_cache,
        "indices": indices,
        "output": output,
        "sm_scale": float(sm_scale),
        "topk_length": topk_length,
        "attn_sink": sink,
        "out_lse": out_lse,
        "return_lse": False,
        "lse_scale": lse_scale,
    }


def _unavailable(reasons: tuple[str, ...]) -> KernelUnavailable:
    return KernelUnavailable(
        format_error(
            given="flashinfer_sparse_mla on this machine: " + "; ".join(reasons),
            supported="an SM120/SM121 GPU with flashinfer-python >= 0.7.2.post1 and nvcc or flashinfer-jit-cache",
            fix="fix the above, or select the triton or torch kernel",
        )
    )


def _bad_input(given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(given=f"flashinfer_sparse_mla: {given}", supported=supported, fix=fix))


def _kv_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int, bool]:
    """The cache as FlashInfer reads it, and its (page_size, num_slots, pages back to back).

    A 3-D or singleton-head 4-D cache is taken as it is. FlashInfer reads a 2-D tensor as one-token
    pages, so a flat ``[num_slots, 656]`` cache is viewed as the 64-row pages the SM120 kernels are
    built for (slot ids are unchanged), or refused when its rows do not form whole pages.
    """
    if kv_cache.dim() == 2:
        if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] or kv_cache.shape[0] % layout.PAGE_SIZE:
            raise _bad_input(
                f"flat kv_cache {tuple(kv_cache.shape)} with strides {tuple(kv_cache.stride())}",
                f"[pages, {layout.PAGE_SIZE}, row] pages, or flat rows that form whole "
                f"{layout.PAGE_SIZE}-row pages (back to back, a multiple of {layout.PAGE_SIZE} rows)",
                f"pass the cache as pages: rows.view(-1, {layout.PAGE_SIZE}, row) "
                "(mla_sm120_plugin.kernels.dsa.pack.page_view)",
            )
        kv_cache = kv_cache.view(-1, layout.PAGE_SIZE, kv_cache.shape[1])
    if kv_cache.dim() == 3:
        axis = 1
    elif kv_cache.dim() == 4 and (kv_cache.shape[1] == 1 or kv_cache.shape[2] == 1):
        axis = 2 if kv_cache.shape[1] == 1 else 1
    else:
        raise _bad_input(
            f"kv_cache shape {tuple(kv_cache.shape)}",
            "[pages, page_size, row], [pages, 1, page_size, row], [pages, page_size, 1, row] or flat "
            "[num_slots, row] uint8 rows",
            "pass the layer's paged fp8_ds_mla cache",
        )
    page_size = kv_cache.shape[axis]
    packed = kv_cache.stride(0) == page_size * kv_cache.stride(axis)
    return kv_cache, page_size, kv_cache.shape[0] * page_size, packed


def check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    topk_length: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse_base: str = "e",
    require_cuda: bool = True,
    kv_layout: str = layout.FP8_DS_MLA,
) -> torch.Tensor:
    """Everything :func:`flashinfer_sparse_mla` demands of its tensors, checked without a GPU.

    Pure Python on tensor metadata: an engine adapter's tensors can be checked on the CPU with
    ``require_cuda=False`` (which skips only the CUDA-device requirement).

    :returns: ``kv_cache`` as FlashInfer will read it (a flat cache viewed as 64-row pages).
    :raises KernelInputError: naming the argument, what was given and what is accepted.
    """
    import torch

    if kv_layout not in FLASHINFER_LAYOUTS:
        raise _bad_input(f"kv_layout={kv_layout!r}", f"one of {FLASHINFER_LAYOUTS}",
                         "route this cache to the triton or torch kernel")
    cache = layout.get(kv_layout)
    if q.dim() != 3 or q.shape[-1] != cache.head_dim or q.dtype != torch.bfloat16 or (require_cuda and not q.is_cuda):
        raise _bad_input(
            f"q {tuple(q.shape)} {q.dtype} on {q.device}",
            f"[T, H, {cache.head_dim}] torch.bfloat16" + (" on a CUDA device" if require_cuda else ""),
            f"pack q as [ql_nope ({cache.latent})" + (f", q_pe ({cache.rope})]" if cache.rope else "] (no rope)")
            + " in bfloat16",
        )
    num_tokens, num_heads, _ = q.shape
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != cache.row or kv_cache.device != q.device:
        raise _bad_input(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} on {kv_cache.device}",
            f"torch.uint8 rows of {cache.row} bytes ({kv_layout}) on q's device",
            f"pass kv_cache.view(torch.uint8) of the {kv_layout} cache",
        )
    if kv_cache.stride(-1) != 1 or kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16:
        raise _bad_input(
            f"kv_cache strides {kv_cache.stride()} at address % 16 = {kv_cache.data_ptr() % 16}",
            "contiguous rows, a 16-byte aligned origin and page stride",
            "pass the cache tensor the engine allocated (or a view that keeps its alignment)",
        )
    pages, _, _, _ = _kv_pages(kv_cache)
    if indices.dim() != 2 or indices.shape[0] != num_tokens or indices.shape[1] < 1 or indices.dtype != torch.int32:
        raise _bad_input(
            f"indices {tuple(indices.shape)} {indices.dtype}",
            f"[{num_tokens}, topk] torch.int32 global slots, -1 padded",
            "convert request-local top-k to global slots as int32",
        )
    if indices.device != q.device:
        raise _bad_input(f"indices on {indices.device}", f"q's device {q.device}", "move indices to q's device")
    if topk_length is not None and (
        topk_length.shape != (num_tokens,)
        or topk_length.dtype not in (torch.int32, torch.int64)
        or topk_length.device != q.device
    ):
        raise _bad_input(
            f"topk_length {tuple(topk_length.shape)} {topk_length.dtype} on {topk_length.device}",
            f"[{num_tokens}] int32 on q's device",
            "pass one valid-length per query token",
        )
    if sink is not None and (sink.shape != (num_heads,) or not sink.is_floating_point() or sink.device != q.device):
        raise _bad_input(
            f"sink {tuple(sink.shape)} {sink.dtype} on {sink.device}",
            f"[{num_heads}] float32 on q's device",
            "pass the layer's per-head sink logits",
        )
    if out is not None and (
        out.shape != (num_tokens, num_heads, layout.KV_LORA_RANK)
        or out.dtype != torch.bfloat16
        or out.device != q.device
        or not out.is_contiguous()
    ):
        raise _bad_input(
            f"out {tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}",
            f"[{num_tokens}, {num_heads}, {layout.KV_LORA_RANK}] contiguous torch.bfloat16 on q's device",
            "pass out=None to let the binding allocate it",
        )
    if lse_base not in LSE_BASES:
        raise _bad_input(f"lse_base={lse_base!r}", f"one of {LSE_BASES}", "pass 'e' (natural log) or '2'")
    return pages


def mask_out_of_range(indices: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``indices`` with every id at or past ``num_slots`` replaced by -1.

    FlashInfer skips ids < 0 but reads any id >= 0; one fused elementwise op (graph-safe), which
    also gives its prefill path the dense -1-padded index rows it needs.
    """
    import torch

    return torch.where(indices < num_slots, indices, -1)


def pad_to_tiles(indices: torch.Tensor, tile: int) -> torch.Tensor:
    """``indices`` widened with -1 columns to a multiple of ``tile``: FlashInfer's prefill kernels read
    whole ``tile``-entry index rows (SGLang passes 2051 ids for GLM-5.3-Flash); -1 is skipped, so the
    answer is the same. Rows already whole are returned as they are."""
    import torch

    short = -indices.shape[1] % tile
    return indices if not short else torch.nn.functional.pad(indices, (0, short), value=-1)


# Below this fraction of max(1, |sink|) (in nats), a reported LSE is the sink's within FlashInfer's own
# rounding of it: an empty row reports fl(fl(sink * log2 e) * lse_scale), a few ulp from the sink, and a
# row whose keys carry <= 2^-24 of the sink's mass reports the same bits (its fp32 sum rounds to the
# sink's term). 2^-20 is four times that ulp-scale noise, and under the 1e-5 nats the sink-free LSE must
# fold back to for |sink| <= 8 (7.6e-6 there).
SINK_NOISE = 2.0**-20


def sink_free_lse(native_lse: torch.Tensor, sink: torch.Tensor | None, lse_base: str) -> torch.Tensor:
    """The sink-free LSE of the plugin contract from the one FlashInfer reports with the sink folded
    in, ``r = log(exp(lse) + exp(sink))``, in the same base: ``lse = r + log(1 - exp(sink - r))``.
    Total: a -inf sink leaves ``r`` as it is; an empty row (``r`` the sink), a row the sink dominates
    beyond FlashInfer's fp32 rounding (``r - sink`` at most :data:`SINK_NOISE` x max(1, |sink|) nats)
    and ``r = -inf`` give -inf; never NaN.

    Accuracy against float64: the sink-free mass ``exp(lse)`` is exact to ``|d| + tau`` of the reported
    total ``exp(r)``, where ``d`` is the error of ``r`` itself (FlashInfer's fp32 arithmetic, a few ulp
    of ``r``) and ``tau = SINK_NOISE x max(1, |sink|)``; so ``lse`` is within ``(|d| + tau) / m`` nats of
    float64 for a row whose mass is a fraction ``m`` of the total (rows the sink dominates lose digits,
    as they must: ``r`` no longer holds them), and folding the sink back in gives ``r`` within ``tau``.

    native_lse: [T, H] float32, FlashInfer's LSE with the sink in it, in ``lse_base``
    sink: [H] float32 (natural log; -inf: none for that head), or None (then ``native_lse`` is returned)
    returns: [T, H] float32 in ``lse_base``
    """
    import torch

    if sink is None:
        return native_lse
    per_nat = 1.0 if lse_base == "e" else _LOG2E  # the LSE's units a nat
    sink_b = sink.to(native_lse.dtype)[None, :] * per_nat  # [1, H], the LSE's base
    gap = (native_lse - sink_b) / per_nat  # [T, H] nats by which r exceeds the sink (NaN for -inf - -inf)
    noise = SINK_NOISE * torch.clamp(sink_b.abs() / per_nat, min=1.0)  # [1, H]
    # log(1 - e^-gap) where the row's own mass stands above the noise; -inf where it does not
    kept = torch.log(-torch.expm1(-torch.clamp(gap, min=SINK_NOISE))) * per_nat
    lse = torch.where(gap > noise, native_lse + kept, torch.full_like(native_lse, float("-inf")))
    return torch.where(torch.isneginf(sink_b), native_lse, lse)


def _get_wrapper(device: torch.device, kv_scale_format: str):
    import torch

    key = (device.index if device.index is not None else torch.cuda.current_device(), kv_scale_format)
    wrapper = _WRAPPERS.get(key)
    if wrapper is not None:
        return wrapper
    if torch.cuda.is_current_stream_capturing():
        raise KernelUnavailable(
            format_error(
                given=f"first flashinfer_sparse_mla call on cuda:{key[0]} (kv_scale_format={kv_scale_format}) "
                "during CUDA graph capture",
                supported="the FlashInfer wrapper and its scratch are created on an eager call, then reused by graphs",
                fix="run each captured shape once eagerly before capture (vLLM's warm-up does this)",
            )
        )
    import flashinfer.mla as fi_mla

    with torch.cuda.device(key[0]):
        wrapper = fi_mla.SparseMLASm120Wrapper(**_wrapper_init_kwargs(torch.device("cuda", key[0]), kv_scale_format))
    _WRAPPERS[key] = wrapper
    return wrapper


@dataclass(frozen=True)
class NativeCall:
    """One ``SparseMLASm120Wrapper.run`` call, prepared: everything but the launch.

    :param kwargs: the ``run`` keyword arguments; None when there is nothing to launch (no tokens).
    :param kv_scale_format: FlashInfer's name of the cache's scale format (selects the wrapper).
    :param out: [T, H, 512] bfloat16, what ``run`` writes.
    :param native_lse: [T, H] float32 that ``run`` writes in the asked base (the sink folded in), or None.
    :param sink: [H] float32 or None. :param lse_base: what the caller asked for.
    :param lse_with_sink: the caller asked for the LSE with the sink folded in (FlashInfer's own form).
    """

    kwargs: dict[str, Any] | None
    kv_scale_format: str
    out: torch.Tensor
    native_lse: torch.Tensor | None
    sink: torch.Tensor | None
    lse_base: str
    lse_with_sink: bool = False

    def result(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What :func:`flashinfer_sparse_mla` returns once ``run`` has written ``out``."""
        if self.native_lse is None:
            return self.out
        if self.lse_with_sink:
            return self.out, self.native_lse
        return self.out, sink_free_lse(self.native_lse, self.sink, self.lse_base)


def prepare_call(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    kv_layout: str,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_base: str = "e",
    sink: torch.Tensor | None = None,
    scale_format: str,
    require_cuda: bool = True,
    lse_with_sink: bool = False,
) -> NativeCall:
    """Check a call and build the native arguments, without a GPU: input checks, FlashInfer's live
    envelope, the page-gap rule of its prefill path, out-of-range ids masked, dense lengths, the LSE
    base. Arguments as :func:`flashinfer_sparse_mla`; ``require_cuda=False`` checks CPU tensors.

    :raises KernelInputError: naming what was given and what is accepted.
    """
    import torch

    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise _bad_input(
            f"sm_scale of type {type(sm_scale).__name__}",
            "a Python float (the kernel takes it as a launch argument)",
            "pass float(layer.scaling) once at init, not a tensor",
        )
    kv_cache = check_inputs(q, kv_cache, indices, topk_length=topk_length, sink=sink, out=out, lse_base=lse_base,
                            require_cuda=require_cuda, kv_layout=kv_layout)
    num_tokens, num_heads, _ = q.shape
    fmt = native_format(scale_format, kv_layout)
    limit = _sparse_configs()[fmt.family].max_num_tokens
    outside = envelope_reasons(
        phase="decode" if num_tokens <= limit else "prefill",
        num_heads=num_heads,
        topk=indices.shape[1],
        max_tokens=num_tokens,
        kv_layout=kv_layout,
        scale_format=scale_format,
        source=LIVE,
    )
    if outside:
        raise _bad_input(
            "; ".join(outside),
            "the shapes envelope_reasons() accepts",
            "route this shape to the triton or torch kernel (the selection does so at init)",
        )
    _, _, num_slots, packed_pages = _kv_pages(kv_cache)
    if num_tokens > limit and not packed_pages:
        raise _bad_input(
            f"{num_tokens} tokens on a page-strided kv_cache (page stride {kv_cache.stride(0)} bytes)",
            f"page gaps only in calls of <= {limit} tokens (flashinfer's prefill needs back-to-back pages)",
            "split the call into <= 64-token pieces or pass a cache whose pages are contiguous",
        )
    if out is None:
        out = torch.empty(num_tokens, num_heads, layout.KV_LORA_RANK, dtype=torch.bfloat16, device=q.device)
    out_lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if sink is not None:
        sink = sink.to(torch.float32).contiguous()
    if num_tokens == 0:
        return NativeCall(None, fmt.kv_scale_format, out, out_lse, None, lse_base, lse_with_sink)
    if topk_length is not None:
        # Native code indexes it densely: a strided or expanded view is copied (T ints).
        topk_length = topk_length.to(torch.int32).contiguous()
    indices = mask_out_of_range(indices, num_slots)
    if num_tokens > limit:
        indices = pad_to_tiles(indices, flashinfer_table.table().prefill_topk_tile)
    kwargs = _native_call_kwargs(
        q.contiguous(),
        kv_cache,
        indices,
        out,
        sm_scale=sm_scale,
        topk_length=topk_length,
        sink=sink,
        out_lse=out_lse,
        lse_scale=1.0 if lse_base == "2" else _LN2,  # native base 2: the asked base, inside the kernel
    )
    return NativeCall(kwargs, fmt.kv_scale_format, out, out_lse, sink, lse_base, lse_with_sink)


def flashinfer_sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    kv_layout: str,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_base: str = "e",
    sink: torch.Tensor | None = None,
    scale_format: str,
    lse_with_sink: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA through FlashInfer's SM120/SM121 kernels (``SparseMLASm120Wrapper.run``).

    Semantics as :func:`mla_sm120_plugin.kernels.dsa.reference.torch_sparse_mla`, within fp8 Q/P
    tolerance. Graph-safe after one eager call per shape: no host sync, no allocation of FlashInfer
    state during capture.

    q: [T, H, 576] (fp8_ds_mla) or [T, H, 512] (the rope-less layouts), bfloat16, CUDA (copied once
        if not contiguous)
    kv_cache: [P, page_size, 656] uint8 fp8_ds_mla (also [P, 1, page_size, 656] / [P, page_size, 1, 656]);
        flat [num_slots, 656] rows are read as 64-row pages (num_slots a multiple of 64)
    indices: [T, topk], int32, global slots (page * page_size + row); -1 and ids outside
        [0, P * page_size) are skipped
    sm_scale: Python float, the model's softmax scale
    kv_layout: ``"fp8_ds_mla"`` (FlashInfer family dsv3_2 or glm_nsa, by ``scale_format``), or
        ``"fp8_ds_mla_nope"`` / ``"fp8_nope"`` (family glm53_nope, which reads any fp32 scales)
    topk_length: [T], int32, optional; positions >= topk_length[t] are skipped (native argument)
    out: [T, H, 512], bfloat16, contiguous, optional; written in place
    return_lse: also return lse [T, H] float32 in base ``lse_base`` (``"e"`` or ``"2"``, FlashInfer's
        ``lse_scale``): sink-free (:func:`sink_free_lse`), or with ``lse_with_sink`` FlashInfer's own
        form, the sink folded in
    sink: [H], float32, optional; out *= 1 / (1 + exp(sink - lse)) (native argument; -inf: none)
    scale_format: ``"pow2"`` (DeepSeek-V3.2) or ``"arbitrary"`` (GLM): how the cache's scales were written
    returns: out [T, H, 512] bfloat16, and lse when ``return_lse``

    Raises :class:`KernelUnavailable` when :func:`probe` finds a problem, or on the first call of a
    device or shape during graph capture; :class:`KernelInputError` for wrong inputs and shapes
    outside :func:`envelope_reasons`.
    """
    reasons = probe()
    if reasons:
        raise _unavailable(reasons)
    import torch

    call = prepare_call(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
                        out=out, return_lse=return_lse, lse_base=lse_base, sink=sink, scale_format=scale_format,
                        lse_with_sink=lse_with_sink)
    if call.kwargs is None:  # no tokens: nothing to launch
        return call.result()
    num_tokens, num_heads, _ = q.shape
    topk = indices.shape[1]
    wrapper = _get_wrapper(q.device, call.kv_scale_format)  # before any launch: may refuse under capture
    kwargs = call.kwargs
    capturing = torch.cuda.is_current_stream_capturing()
    try:
        wrapper.run(**kwargs)
    except ValueError as error:
        if capturing:
            raise KernelUnavailable(
                format_error(
                    given=f"flashinfer_sparse_mla T={num_tokens} H={num_heads} topk={topk} during CUDA graph "
                    f"capture: {error}",
                    supported="shapes run once eagerly before capture (FlashInfer plans per shape and stride)",
                    fix="warm up every captured batch size before capture",
                )
            ) from error
        raise _bad_input(
            f"T={num_tokens} H={num_heads} topk={topk}, rejected by flashinfer: {error}",
            "the shapes envelope_reasons() accepts, with flashinfer's layout rules",
            "route this shape to the triton or torch kernel",
        ) from error

    return call.result()
