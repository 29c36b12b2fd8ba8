"""DeepSeek-V4 kernels behind the one call both engines make, and their self-check.

On SM12x both engines end a DeepSeek-V4 attention layer in one call of FlashInfer's SM120 "sparse"
surface, ``flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4`` (vLLM's
``DeepseekV4FlashInferSM120Attention`` calls it as is; SGLang's ``flash_mla_with_kvcache_sm120``
maps its keywords onto it): a window cache and an optional compressed cache, each a
``[pages, P, 1, 584]`` view of page-major 584-byte records, global slot ids ``[T, 1, K]`` and
per-token lengths for each, the per-head sink logits, the softmax scale. The plugin's DeepSeek-V4
kernels take that surface (:func:`triton_dsv4`), so an engine binding routes a (layer kind, phase)
to one without translating the engine's metadata. Their self-check case is
:mod:`.selfcheck_dsv4`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import envs
from ..errors import KernelInputError, format_error
from ..kernels.dsv4 import layout

REC = layout.FP8_RECORD
INT32_MAX = 2**31 - 1
# Keywords FlashInfer's SM120 "sparse" route accepts for call-site compatibility and does not read
# (its queries are per token and the index rows alone decide what each sees): taken and ignored.
IGNORED_KEYWORDS = ("cum_seq_lens_q", "max_q_len", "enable_pdl")
# backend -> the kv_cache_format values it serves here ("cake" is FlashInfer's NVFP4 reader route).
BACKENDS = {"auto": ("fp8", "nvfp4"), "sparse": ("fp8", "nvfp4"), "cake": ("nvfp4",)}
# FlashInfer's kv_cache_format -> the record it names.
RECORD_OF_FORMAT = {fmt: layout.RECORDS[name] for name, fmt in layout.FLASHINFER_FORMAT.items()}


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
    # The kernels read a page as P packed records (data rows, then the scale footer): a view whose
    # token axis steps by another amount describes other bytes, which would be read as packed.
    token_axis = 2 if cache.dim() == 4 and kv_layout == "HND" else 1
    if page_size > 1 and cache.stride(token_axis) != record.token_bytes:
        raise _bad(name, f"a token stride of {cache.stride(token_axis)} bytes (strides {cache.stride()})",
                   f"{record.token_bytes} bytes a token: a page's P records packed, pages any stride apart",
                   "pass the engine's cache view of its page-major pool, not a gathered or padded-row one")
    rows = cache.as_strided((cache.shape[0], page_size * record.token_bytes), (cache.stride(0), 1))
    return rows, page_size


def index_rows(name: str, indices: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[T, 1, K]`` or ``[T, K]`` slot ids as the kernels' ``[T, K]`` int32 rows of unit stride."""
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != tokens or indices.dtype not in (torch.int32, torch.int64):
        raise _bad(name, f"shape {tuple(indices.shape)}, dtype {indices.dtype}",
                   f"[{tokens}, 1, K] or [{tokens}, K] int32 global slots (-1 pads)", "pass one index row a query token")
    if indices.dtype == torch.int64:
        # Narrowing keeps the low 32 bits (2**32 + 18 would become slot 18): an id no int32 holds is
        # outside every cache, so it is masked like any out-of-range id, on the device, before.
        indices = torch.where((indices < 0) | (indices > INT32_MAX), -1, indices)
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    return indices


def _forced_splits(num_splits: int | None) -> int | None:
    """``num_splits``, else ``MLA_SM120_SPLITS``'s value, else None (the plan's), checked."""
    source = "num_splits"
    if num_splits is None:
        raw = os.environ.get(envs.SPLITS, "").strip()
        if not raw:
            return None
        source = envs.SPLITS
        try:
            num_splits = int(raw)
        except ValueError:
            num_splits = raw  # type: ignore[assignment]
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise _bad(source, repr(num_splits), "a positive integer (candidate ranges a token and head block)",
                   f"unset {envs.SPLITS} to run the launch plan's split")
    return num_splits


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
    num_splits: int | None = None,
    **unsupported: Any,
) -> torch.Tensor:
    """The plugin's Triton DeepSeek-V4 kernel on FlashInfer's SM120 call surface.

    :param query: [T, H, 512] bfloat16, after the layer's norm and rope (H: the engine's padded heads).
    :param swa_kv_cache: [pages, P, 1, 584] uint8 window cache (NHD; see :func:`pages_of`).
    :param workspace_buffer: uint8 bytes the split partials are carved from where they fit (vLLM
        passes FlashInfer's 128 MiB DeepSeek-V4 workspace), else they are allocated.
    :param sparse_indices: [T, 1, W] int32 global window slots (``page * P + row``), -1 padded (int64
        rows are narrowed, ids no int32 holds masked first).
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
    :param backend: ``"auto"`` or ``"sparse"``; ``"cake"`` (FlashInfer's NVFP4 reader route) with
        ``kv_cache_format="nvfp4"``: the same result from this kernel.
    :param num_splits: candidate ranges a (token, head block), instead of the launch plan's
        (``MLA_SM120_SPLITS`` sets it for every call); None: the plan's.
    :param unsupported: ``cum_seq_lens_q``, ``max_q_len`` and ``enable_pdl`` are taken and ignored,
        as FlashInfer's SM120 route does; any other keyword FlashInfer has (TRT-LLM, HCA, storage
        offsets, ``seq_lens`` / ``sparse_topk_lens``) would change the result, and is refused when set.
    :returns: ``out``.
    :raises KernelInputError: an argument outside this surface (named, with what is accepted).
    """
    ignored = {k: unsupported.pop(k) for k in IGNORED_KEYWORDS if k in unsupported}
    given = sorted(k for k, v in unsupported.items() if v is not None)
    if given:
        raise _bad(", ".join(given), "set", "the SM120 sparse surface (no TRT-LLM / HCA / storage-offset arguments)",
                   "call FlashInfer's own kernel for those, or leave them None")
    record = RECORD_OF_FORMAT.get(kv_cache_format)
    if record is None:
        raise _bad("kv_cache_format", repr(kv_cache_format), "'fp8' (the 584-byte record) or 'nvfp4' (the 384-byte one)",
                   "serve this cache with FlashInfer's own kernel")
    if kv_cache_format not in BACKENDS.get(backend, ()):
        accepted = "; ".join(f"{b!r} with kv_cache_format {' or '.join(map(repr, f))}" for b, f in BACKENDS.items())
        raise _bad("backend", f"{backend!r} with kv_cache_format={kv_cache_format!r}", accepted,
                   "leave backend at 'auto'")
    if backend == "cake" and ignored.get("enable_pdl"):
        # FlashInfer's NVFP4 cake route refuses it too: the same call must fail the same way here.
        raise _bad("enable_pdl", "True with backend='cake'", "None or False (FlashInfer's NVFP4 cake route "
                   "has no programmatic dependent launch)", "leave enable_pdl unset")
    if sparse_indices is None:
        raise _bad("sparse_indices", "None", "[T, 1, W] int32 window slots", "pass the window's index rows")
    if (compressed_kv_cache is None) != (extra_sparse_indices is None):
        raise _bad("compressed_kv_cache / extra_sparse_indices", "only one of them", "both or neither",
                   "pass the compressed cache with its index rows")
    num_splits = _forced_splits(num_splits)
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
                            sinks=sinks, out=out, record=record, num_splits=num_splits,
                            workspace=workspace_buffer)
    scale2 = _scale("bmm2_scale", bmm2_scale)
    if scale2 != 1.0:
        result.mul_(scale2)
    return result
