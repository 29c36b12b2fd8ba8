"""DeepSeek-V4 kernels behind the one call both engines make, and their self-check.

On SM12x both engines end a DeepSeek-V4 attention layer in one call of FlashInfer's SM120 "sparse"
surface, ``flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4`` (vLLM's
``DeepseekV4FlashInferSM120Attention`` calls it as is; SGLang's ``flash_mla_with_kvcache_sm120``
maps its keywords onto it): a window cache and an optional compressed cache, each a
``[pages, P, 1, 584]`` view of page-major 584-byte records, global slot ids ``[T, 1, K]`` and
per-token lengths for each, the per-head sink logits, the softmax scale. The plugin's DeepSeek-V4
kernels take that surface (:func:`triton_dsv4`), so an engine binding routes a (layer kind, phase)
to one without translating the engine's metadata.

:func:`verify` proves the kernels a layer kind was given on this machine before any weight loads,
as :mod:`.selfcheck` does for the DSA kernels (same ``MLA_SM120_SELF_CHECK`` modes, same fallback
along the decision's alternates, same log line): a small two-cache case in the engine's page sizes
with -1 padding, out-of-range ids, short and empty rows and finite / -inf / large sinks, against
float64 attention over the dequantized rows, within the kernel's declared bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import KernelInputError, UnsupportedConfiguration, format_error
from ..kernels.accuracy import measure
from ..kernels.dsv4 import layout, pack
from ..kernels.dsv4.reference import dsv4_attention_reference
from . import selfcheck
from .binding import bind

REC = layout.FP8_RECORD
# FlashInfer's kv_cache_format -> the record it names.
RECORD_OF_FORMAT = {fmt: layout.RECORDS[name] for name, fmt in layout.FLASHINFER_FORMAT.items()}
# What vLLM gives FlashInfer's DeepSeek-V4 kernels a device (_FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE);
# the self-check gives FlashInfer the same.
FLASHINFER_WORKSPACE_BYTES = 128 << 20
CHECK_TOKENS = 4  # the self-check's tokens: a full row, a short one, an empty one, a window-only one


def _bad(argument: str, given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(f"{argument}: {given}", supported, fix))


def pages_of(name: str, cache: torch.Tensor, kv_layout: str,
             record: layout.Dsv4Record = REC) -> tuple[torch.Tensor, int]:
    """An engine's cache view as the kernels' ``[pages, P * 584]`` byte rows, and its page size ``P``.

    :param cache: ``[pages, P, 1, 584]`` (NHD), ``[pages, 1, P, 584]`` (HND) or ``[pages, P, 584]``,
        uint8 or float8_e4m3fn; the page stride is the tensor's ``stride(0)`` (engines pad pages
        to multiples of 576 bytes and may place them further apart). 384 for ``record`` NVFP4.
    :returns: a view of the same bytes with the same page stride, and entries a page.
    """
    if cache.dtype == torch.float8_e4m3fn:
        cache = cache.view(torch.uint8)
    if cache.dtype != torch.uint8 or cache.shape[-1] != record.token_bytes or cache.dim() not in (3, 4):
        raise _bad(name, f"shape {tuple(cache.shape)}, dtype {cache.dtype}",
                   f"[pages, P, 1, {record.token_bytes}] uint8 or float8_e4m3fn (NHD; HND: [pages, 1, P, "
                   f"{record.token_bytes}])", "pass the engine's DeepSeek-V4 cache view")
    if cache.dim() == 4 and kv_layout not in ("NHD", "HND"):
        raise _bad("kv_layout", repr(kv_layout), "'NHD' or 'HND'", "pass the layout the engine passes FlashInfer")
    page_size = cache.shape[2] if cache.dim() == 4 and kv_layout == "HND" else cache.shape[1]
    if cache.dim() == 4 and (cache.shape[1] if kv_layout == "HND" else cache.shape[2]) != 1:
        raise _bad(name, f"shape {tuple(cache.shape)} under kv_layout={kv_layout}", "one KV head",
                   "pass the engine's cache view (DeepSeek-V4 caches one 512-wide row a token)")
    if cache.stride(-1) != 1 or page_size * record.token_bytes > cache.stride(0) and cache.shape[0] > 1:
        raise _bad(name, f"strides {cache.stride()}", f"contiguous records, pages >= {page_size} x {record.token_bytes} "
                   "bytes apart", "pass the engine's cache view")
    rows = cache.as_strided((cache.shape[0], page_size * record.token_bytes), (cache.stride(0), 1))
    return rows, page_size


def index_rows(name: str, indices: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[T, 1, K]`` or ``[T, K]`` slot ids as the kernels' ``[T, K]`` int32 rows of unit stride."""
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != tokens or indices.dtype not in (torch.int32, torch.int64):
        raise _bad(name, f"shape {tuple(indices.shape)}, dtype {indices.dtype}",
                   f"[{tokens}, 1, K] or [{tokens}, K] int32 global slots (-1 pads)", "pass one index row a query token")
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    return indices


def _scale(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        # a device tensor would need a host sync; the engines pass Python floats
        raise _bad(name, f"a tensor of shape {tuple(value.shape)}", "a Python float", f"pass float({name})")
    return float(value)


def triton_dsv4(
    query: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor | None = None,
    sparse_indices: torch.Tensor | None = None,
    compressed_kv_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    swa_topk_lens: torch.Tensor | None = None,
    extra_sparse_indices: torch.Tensor | None = None,
    extra_sparse_topk_lens: torch.Tensor | None = None,
    *,
    kv_cache_format: str = "fp8",
    backend: str = "auto",
    **unsupported: Any,
) -> torch.Tensor:
    """The plugin's Triton DeepSeek-V4 kernel on FlashInfer's SM120 call surface.

    :param query: [T, H, 512] bfloat16, after the layer's norm and rope (H: the engine's padded heads).
    :param swa_kv_cache: [pages, P, 1, 584] uint8 window cache (NHD; see :func:`pages_of`).
    :param workspace_buffer: unused (the kernel keeps no split-K scratch).
    :param sparse_indices: [T, 1, W] int32 global window slots (``page * P + row``), -1 padded.
    :param compressed_kv_cache: [pages, P_c, 1, 584] uint8 compressed cache, or None (window-only layer).
    :param out: [T, H, 512] bfloat16 output, or None (allocated).
    :param bmm1_scale: the softmax scale (512 ** -0.5), a Python float.
    :param bmm2_scale: scales the output (1.0 from both engines).
    :param sinks: [H] float32 sink logits (natural log; -inf: none), or None.
    :param kv_layout: ``"NHD"`` (both engines) or ``"HND"`` (FlashInfer's default).
    :param swa_topk_lens: [T] int32 valid window slots a row, or None (the whole row).
    :param extra_sparse_indices: [T, 1, K] or [T, K] int32 compressed slots, -1 padded.
    :param extra_sparse_topk_lens: [T] int32, or None.
    :param kv_cache_format: ``"fp8"`` (the 584-byte record) or ``"nvfp4"`` (the 384-byte one: caches
        ``[pages, P, 1, 384]``).
    :returns: ``out``.
    :raises KernelInputError: an argument outside this surface (named, with what is accepted).
    """
    given = sorted(k for k, v in unsupported.items() if v is not None)
    if given:
        raise _bad(", ".join(given), "set", "the SM120 sparse surface (no TRT-LLM / HCA / storage-offset arguments)",
                   "call FlashInfer's own kernel for those, or leave them None")
    record = RECORD_OF_FORMAT.get(kv_cache_format)
    if record is None:
        raise _bad("kv_cache_format", repr(kv_cache_format), "'fp8' (the 584-byte record) or 'nvfp4' (the 384-byte one)",
                   "serve this cache with FlashInfer's own kernel")
    if backend not in ("auto", "sparse"):
        raise _bad("backend", repr(backend), "'auto' or 'sparse'", "leave backend at 'auto'")
    if sparse_indices is None:
        raise _bad("sparse_indices", "None", "[T, 1, W] int32 window slots", "pass the window's index rows")
    if (compressed_kv_cache is None) != (extra_sparse_indices is None):
        raise _bad("compressed_kv_cache / extra_sparse_indices", "only one of them", "both or neither",
                   "pass the compressed cache with its index rows")
    from ..kernels.dsv4.triton import dsv4_attention

    tokens = query.shape[0]
    swa, swa_page = pages_of("swa_kv_cache", swa_kv_cache, kv_layout, record)
    extra = extra_page = extra_idx = None
    if compressed_kv_cache is not None:
        extra, extra_page = pages_of("compressed_kv_cache", compressed_kv_cache, kv_layout, record)
        extra_idx = index_rows("extra_sparse_indices", extra_sparse_indices, tokens)
    result = dsv4_attention(query, swa, index_rows("sparse_indices", sparse_indices, tokens), swa_page,
                            sm_scale=_scale("bmm1_scale", bmm1_scale), swa_lengths=swa_topk_lens, extra_cache=extra,
                            extra_indices=extra_idx, extra_lengths=extra_sparse_topk_lens, extra_page_size=extra_page,
                            sinks=sinks, out=out, record=record)
    scale2 = _scale("bmm2_scale", bmm2_scale)
    if scale2 != 1.0:
        result.mul_(scale2)
    return result


# ---------------------------------------------------------------------------------- self-check


@dataclass(frozen=True)
class Dsv4CheckKey:
    """What one DeepSeek-V4 self-check proves: a kernel, the q heads, both page sizes, the device."""

    kernel: str
    num_heads: int
    window_page: int
    extra_page: int  # 0: a window-only layer kind
    device: str
    record: str = layout.FP8_DSV4


@dataclass(frozen=True)
class Dsv4CheckResult:
    """One check's outcome (``error`` None: passed)."""

    key: Dsv4CheckKey
    seconds: float
    error: str | None
    summary_text: str
    measured: Any = None  # the kernel's Accuracy against float64 (None: it did not run)

    @property
    def passed(self) -> bool:
        return self.error is None


_results: dict[Dsv4CheckKey, Dsv4CheckResult] = {}


def clear_cache() -> None:
    """Forget every result (tests)."""
    _results.clear()


def _case(key: Dsv4CheckKey, device: torch.device) -> dict[str, Any]:
    """The check's call on FlashInfer's surface, built on the CPU with explicit dtypes, then moved.

    Token 0: a full window row (with -1 and out-of-range ids) plus compressed slots; token 1: short
    rows; token 2: nothing valid (zeros); token 3: a large sink. Group magnitudes vary so that a
    wrong per-group scale shows.
    """
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)
    window, extra_width = 48, 40
    record = layout.RECORDS[key.record]

    def cache(page_size: int, entries: int) -> tuple[torch.Tensor, int]:
        pages = max(2, -(-entries // page_size))
        rows = torch.randn(pages * page_size, REC.head_dim, generator=gen, dtype=torch.float32, device=cpu)
        rows[:, : layout.NOPE_DIM] *= torch.tensor([0.25, 1.0, 4.0, 16.0, 0.5, 2.0, 8.0]).repeat_interleave(
            layout.SCALE_GROUP)
        buf = pack.new_cache(pages, page_size, device=cpu, record=record)
        pack.write(buf, rows, torch.arange(pages * page_size, dtype=torch.int64), page_size, record=record)
        view = buf.as_strided((pages, page_size, 1, record.token_bytes), (buf.stride(0), record.token_bytes,
                                                                           record.token_bytes, 1))
        return view, pages * page_size

    def ids(capacity: int, width: int) -> torch.Tensor:
        out = torch.randint(0, capacity, (CHECK_TOKENS, 1, width), generator=gen, dtype=torch.int32, device=cpu)
        out[0, 0, :3] = torch.tensor([-1, capacity, 2**31 - 1], dtype=torch.int32)
        return out

    swa, swa_cap = cache(key.window_page, 3 * window)
    inputs: dict[str, Any] = dict(
        query=torch.randn(CHECK_TOKENS, key.num_heads, REC.head_dim, generator=gen, device=cpu),
        swa_kv_cache=swa, sparse_indices=ids(swa_cap, window),
        swa_topk_lens=torch.tensor([window, window // 3, 0, window], dtype=torch.int32),
        bmm1_scale=REC.head_dim ** -0.5, kv_layout="NHD", kv_cache_format=layout.FLASHINFER_FORMAT[key.record])
    sinks = torch.randn(key.num_heads, generator=gen)
    sinks[::3] = float("-inf")
    sinks[1::5] = 30.0  # outweighs every score: that head's output is near zero
    inputs["sinks"] = sinks
    if key.extra_page:
        extra, extra_cap = cache(key.extra_page, 2 * extra_width)
        inputs.update(compressed_kv_cache=extra, extra_sparse_indices=ids(extra_cap, extra_width),
                      extra_sparse_topk_lens=torch.tensor([extra_width, 7, 0, 0], dtype=torch.int32))
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    moved["query"] = moved["query"].to(torch.bfloat16)
    return moved


def _truth(inputs: dict[str, Any]) -> torch.Tensor:
    """Float64 attention over the case's dequantized rows (the reference on a float64 q)."""
    record = RECORD_OF_FORMAT[inputs["kv_cache_format"]]
    swa, swa_page = pages_of("swa_kv_cache", inputs["swa_kv_cache"], "NHD", record)
    kwargs: dict[str, Any] = {"record": record}
    if "compressed_kv_cache" in inputs:
        extra, extra_page = pages_of("compressed_kv_cache", inputs["compressed_kv_cache"], "NHD", record)
        kwargs.update(extra_cache=extra, extra_indices=inputs["extra_sparse_indices"][:, 0],
                      extra_lengths=inputs["extra_sparse_topk_lens"], extra_page_size=extra_page)
    return dsv4_attention_reference(inputs["query"].double(), swa, inputs["sparse_indices"][:, 0], swa_page,
                                    sm_scale=inputs["bmm1_scale"], swa_lengths=inputs["swa_topk_lens"],
                                    sinks=inputs["sinks"], **kwargs)


def check(name: str, fn: Callable[..., Any], *, num_heads: int, window_page: int, extra_page: int,
          device: torch.device, record: str = layout.FP8_DSV4) -> Dsv4CheckResult:
    """Run kernel ``name`` (``fn``, on FlashInfer's surface) once on the check's case; cached per key."""
    from ..hooks.manager import get_registry

    key = Dsv4CheckKey(name, num_heads, window_page, extra_page, str(device), record)
    if key in _results:
        return _results[key]
    spec = get_registry().kernels[name]
    start = time.perf_counter()
    inputs = _case(key, device)
    error, text, got = None, "", None
    try:
        with selfcheck._forward_time_defaults():
            workspace = (torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                         if device.type == "cuda" else None)
            out = torch.empty_like(inputs["query"])
            fn(workspace_buffer=workspace, out=out, **inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        got = measure(out, _truth(inputs))
        over = spec.accuracy.violations(got) if spec.accuracy is not None else []
        text = got.summary()
        if over:
            error = f"{', '.join(over)} against float64 (bound {spec.accuracy.summary()})"
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is the finding
        error = selfcheck._one_line(exc)
    result = Dsv4CheckResult(key, time.perf_counter() - start, error, text, got)
    _results[key] = result
    return result


def verify(kind: str, decision: Any, engine_fns: dict[str, Callable[..., Any]], *, window_page: int,
           extra_page: int, device: torch.device) -> tuple[dict[str, str], str]:
    """Self-check the kernels ``decision`` gives layer kind ``kind``; fall back along its alternates.

    :param decision: the kind's :class:`~mla_sm120_plugin.types.Decision`.
    :param engine_fns: kernel name -> the callable that runs it on FlashInfer's surface, for kernels
        the engine runs itself (FlashInfer's); others bind from their registered entry.
    :param window_page: entries a window page holds as the kernels see it; ``extra_page`` the same for
        the compressed cache (0: none).
    :returns: phase -> the kernel to run, and one log line.
    :raises UnsupportedConfiguration: a phase's kernel and every alternate failed (or the mode is strict).
    """
    check_mode = selfcheck.mode()
    kernels = dict(decision.kernels)
    if check_mode == "off":
        return kernels, f"mla_sm120: {kind} self-check skipped ({selfcheck.ENV}=off)"
    start = time.perf_counter()
    heads = {phase: decision.context.dsv4.heads_for(phase) for phase in kernels}
    parts: list[str] = []
    for phase, name in decision.kernels.items():
        tried: list[Dsv4CheckResult] = []
        for candidate in (name, *(() if check_mode == "strict" else decision.alternates.get(phase, ()))):
            fn = engine_fns.get(candidate) or bind(candidate).fn
            result = check(candidate, fn, num_heads=heads[phase], window_page=window_page, extra_page=extra_page,
                           device=device, record=decision.context.kv_cache_dtype)
            tried.append(result)
            if result.passed:
                kernels[phase] = candidate
                fell = "; ".join(f"{r.key.kernel} FAILED ({r.error})" for r in tried[:-1])
                parts.append(f"{phase}={(fell + '; falling back to ') if fell else ''}{candidate} ok "
                             f"({result.summary_text}; {result.seconds:.2f} s)")
                break
        else:
            raise UnsupportedConfiguration(format_error(
                f"{decision.context.describe()}: DeepSeek-V4 {kind} {phase} kernel {name} failed its self-check on "
                f"{device}: " + "; ".join(f"{r.key.kernel}: {r.error}" for r in tried),
                f"a {phase} kernel that matches float64 attention within its declared bounds here",
                "force another kernel (decode_kernel / prefill_kernel in the plugin config), fix or update the failing "
                f"kernel's package, or set {selfcheck.ENV}=off to skip the check (at your own risk)"))
    return kernels, f"mla_sm120: {kind} self-check: {'; '.join(parts)}; {time.perf_counter() - start:.2f} s"
