"""The one sparse-MLA entry, ``sparse_mla_forward(kernel="auto")``: validates every input once, then
dispatches to a kernel chosen by the plugin's registry (:mod:`.binding`).

The Triton and reference kernels trust their inputs; the FlashInfer binding checks its own extra
limits as well. Every input this module accepts is served correctly by every kernel (strided
``topk_length``, ``sink`` and ``out`` included); everything else is a :class:`KernelInputError`
naming the argument, what is supported and what was given.
"""

from __future__ import annotations

import math
import numbers

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.dispatch.binding import bind


LSE_BASES = ("e", "2")
MAX_HEADS = 128


def _fail(argument: str, given: str, supported: str, fix: str) -> KernelInputError:
    return KernelInputError(format_error(f"{argument}={given}", f"{argument} {supported}", fix))


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)} {x.dtype} on {x.device}"
    return f"{type(x).__name__} {x!r}"


def _need_tensor(name: str, x: object, supported: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _fail(name, _describe(x), supported, f"pass {name} as a torch.Tensor")
    return x


def _check_same_device(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    if x.device != q.device:
        raise _fail(name, _describe(x), f"on q's device {q.device}", f"move {name} to {q.device}")


def _check_optional(name: str, x: object, q: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                    supported: str, fix: str) -> None:
    """An optional tensor argument: a tensor of exactly ``dtype`` and ``shape`` on q's device."""
    _need_tensor(name, x, supported)
    if x.dtype != dtype or tuple(x.shape) != shape:
        raise _fail(name, _describe(x), supported, fix)
    _check_same_device(name, x, q)


def _q_width(lay: layout.CacheLayout) -> str:
    if lay.rope:
        return f"{lay.head_dim} ({lay.latent} latent + {lay.rope} rope)"
    return f"{lay.head_dim} ({lay.latent} latent; kv_layout={lay.name!r} has no rope)"


def _q_fix(q: torch.Tensor, lay: layout.CacheLayout) -> str:
    """What to do about a q whose last dim is not ``lay.head_dim``: the layouts it would fit name
    the likely mix-up (a rope-less model's q against a rope layout, or the reverse)."""
    fits = [name for name, other in layout.LAYOUTS.items() if q.dim() == 3 and other.head_dim == q.shape[-1]]
    if lay.rope:
        want = f"pass q packed as [tokens, heads, {lay.latent} latent + {lay.rope} rope]"
    else:
        want = f"pass q as [tokens, heads, {lay.latent}] (the latent part only: a rope-less model's q_pe is empty)"
    return want + (f", or pass the kv_layout the cache was written in ({' / '.join(fits)} take a "
                   f"{q.shape[-1]}-wide q)" if fits else "")


def _cache_fix(kv_cache: torch.Tensor, lay: layout.CacheLayout) -> str:
    """The fix for a cache whose last dim or dtype is not ``lay``'s: the layouts that such rows fit."""
    fits = [name for name in layout.KV_LAYOUTS
            if kv_cache.dim() in (2, 3) and pack.token_width(name) == kv_cache.shape[-1]
            and pack.cache_dtype(name) == kv_cache.dtype]
    if fits:
        return (f"pass the kv_layout the cache was written in: {kv_cache.dtype} rows of {kv_cache.shape[-1]} are "
                f"{' or '.join(repr(f) for f in fits)}")
    return f"pass the layer's cache in kv_layout={lay.name!r}: {pack.describe(lay.name)}"


def _has_internal_overlap(x: torch.Tensor) -> bool:
    """True when two index tuples of ``x`` address the same element (e.g. an ``expand``ed view)."""
    reach = 0  # elements spanned by the dims seen so far, smallest stride first
    for size, stride in sorted(((s, st) for s, st in zip(x.shape, x.stride()) if s > 1), key=lambda d: d[1]):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


# The Triton kernel takes sm_scale * log2(e) as a float32 argument.
_MAX_SM_SCALE = 3.4028234663852886e38 / math.log2(math.e)


def _validate(q, kv_cache, indices, *, sm_scale, kv_layout, topk_length, page_size, out,
              return_lse, lse_base, lse_with_sink, sink, scale_format) -> float:
    """Check every argument against the contract; returns sm_scale as a float."""
    lay = layout.LAYOUTS.get(kv_layout) if isinstance(kv_layout, str) else None
    if lay is None:
        raise _fail("kv_layout", repr(kv_layout), f"one of {layout.KV_LAYOUTS}",
                    f"pass the layout the cache was written in: {pack.describe_all()}")

    q_supported = (f"[T, H, {_q_width(lay)}] bfloat16 or float32 with 1 <= H <= {MAX_HEADS} "
                   f"for kv_layout={kv_layout!r}")
    _need_tensor("q", q, q_supported)
    if q.dim() != 3 or q.shape[2] != lay.head_dim:
        raise _fail("q", _describe(q), q_supported, _q_fix(q, lay))
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise _fail("q", _describe(q), q_supported, "cast q with .to(torch.bfloat16)")
    num_tokens, num_heads, _ = q.shape
    if not 1 <= num_heads <= MAX_HEADS:
        raise _fail("q", _describe(q), q_supported, "pass the heads of this rank (1..128)")

    width, dtype = pack.token_width(kv_layout), pack.cache_dtype(kv_layout)
    cache_supported = (f"[num_pages, page_size, {width}] or [num_slots, {width}] {dtype} "
                       f"(last dim contiguous) for kv_layout={kv_layout!r}")
    _need_tensor("kv_cache", kv_cache, cache_supported)
    if kv_cache.dim() not in (2, 3) or kv_cache.shape[-1] != width or kv_cache.dtype != dtype:
        raise _fail("kv_cache", _describe(kv_cache), cache_supported, _cache_fix(kv_cache, lay))
    if kv_cache.stride(-1) != 1:
        raise _fail("kv_cache", f"{_describe(kv_cache)} with strides {kv_cache.stride()}",
                    cache_supported, "pass a view whose rows are contiguous")
    _check_same_device("kv_cache", kv_cache, q)
    if lay.fp8:
        # The four fp32 scales of each token are read as float32: every token must start on a
        # 4-byte boundary (vLLM's caches are 16-byte aligned).
        misaligned = [v for v in (kv_cache.storage_offset(), *kv_cache.stride()[:-1]) if v % 4]
        if misaligned:
            raise _fail("kv_cache", f"{_describe(kv_cache)} with byte offset {kv_cache.storage_offset()} and "
                        f"strides {kv_cache.stride()}", "a byte offset and page/row strides that are multiples "
                        "of 4 (each token's fp32 scales aligned)", "pass the cache tensor or an aligned view of it")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise _fail("page_size", _describe(page_size), "a positive int", "pass the cache's page size")
    if kv_cache.dim() == 3 and kv_cache.shape[1] != page_size:
        raise _fail("page_size", str(page_size), f"equal to kv_cache.shape[1] = {kv_cache.shape[1]}",
                    f"pass page_size={kv_cache.shape[1]} or reshape the cache")

    idx_supported = f"[T={num_tokens}, topk >= 1] int32 global slots on q's device"
    _need_tensor("indices", indices, idx_supported)
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != num_tokens:
        raise _fail("indices", _describe(indices), idx_supported,
                    "pass one row of int32 global slot ids (page * page_size + row, -1 padded) per q token")
    if indices.shape[1] < 1:
        raise _fail("indices", _describe(indices), idx_supported, "pass at least one candidate per token")
    _check_same_device("indices", indices, q)

    if topk_length is not None:
        _check_optional("topk_length", topk_length, q, torch.int32, (num_tokens,),
                        f"None or [T={num_tokens}] int32 on q's device",
                        "pass one int32 valid-prefix length per token, or None")

    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise _fail("sm_scale", _describe(sm_scale), "a positive finite Python float",
                    "pass the layer's softmax scale as a float (vLLM: impl.scale), not a tensor")
    scale = float(sm_scale)
    if not (math.isfinite(scale) and 0 < scale <= _MAX_SM_SCALE):
        raise _fail("sm_scale", repr(sm_scale), f"a positive finite Python float <= {_MAX_SM_SCALE:.3g} "
                    "(sm_scale * log2(e) must fit in float32)", "pass the layer's softmax scale")

    if lse_base not in LSE_BASES:
        raise _fail("lse_base", repr(lse_base), f"one of {LSE_BASES}",
                    "pass 'e' for natural-log LSE (FlashMLA) or '2' for base-2 LSE (FlashInfer)")
    for name, flag in (("return_lse", return_lse), ("lse_with_sink", lse_with_sink)):
        if not isinstance(flag, bool):
            raise _fail(name, _describe(flag), "a bool", "pass True or False")

    if out is not None:
        _check_optional("out", out, q, q.dtype, (num_tokens, num_heads, lay.latent),
                        f"None or [{num_tokens}, {num_heads}, {lay.latent}] {q.dtype} on q's device",
                        f"pass an output buffer shaped like q with {lay.latent} columns (the latent's width)")
        if _has_internal_overlap(out):
            raise _fail("out", f"{_describe(out)} with strides {out.stride()}",
                        "a buffer whose elements are all distinct (no expanded or overlapping view)",
                        "pass torch.empty(...) or a non-overlapping view; each row is written once")

    if sink is not None:
        _check_optional("sink", sink, q, torch.float32, (num_heads,),
                        f"None or [H={num_heads}] float32 on q's device", "pass one float32 sink logit per head")

    if scale_format is not None and scale_format not in layout.SCALE_FORMATS:
        raise _fail("scale_format", repr(scale_format), f"None or one of {layout.SCALE_FORMATS}",
                    "pass 'pow2' for DeepSeek-V3.2 caches or 'arbitrary' for GLM caches")
    return scale


def sparse_mla_forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    kv_layout: str,
    topk_length: torch.Tensor | None = None,
    page_size: int = layout.PAGE_SIZE,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_base: str = "e",
    sink: torch.Tensor | None = None,
    scale_format: str | None = None,
    lse_with_sink: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA (DeepSeek Sparse Attention) over a paged KV cache, validated then dispatched.

    The one statement of the kernel contract; the kernels and the reference point here.

    For each token ``t`` and head ``h``: ``s_j = sm_scale * <q[t, h], K_j>`` over the valid slots of
    ``indices[t]``, ``out[t, h] = softmax(s) @ V`` with ``K_j`` the cached token (``D`` wide: the
    512-wide latent, then the rope where the layout has one) and ``V_j = K_j[:512]`` (one KV head
    shared by all heads). A slot is invalid, masked and never read, when it is -1, outside
    ``[0, num_slots)``, or at a position ``>= topk_length[t]``. A token with no valid slot gets
    ``out = 0`` and ``lse = -inf``. Cache layouts, to the byte, are in
    :mod:`mla_sm120_plugin.kernels.dsa.layout`; ``D`` and the row are the layout's ``head_dim`` and
    ``row``:

    ==================  ====  ====================================================================
    kv_layout           D     kv_cache rows
    ==================  ====  ====================================================================
    "fp8_ds_mla"        576   656 uint8: 512 fp8 latent, 4 fp32 scales, 64 bf16 rope (DSA models)
    "fp8_ds_mla_nope"   512   656 uint8: 512 fp8 latent, 4 fp32 scales, 128 reserved (vLLM, rope-less)
    "fp8_nope"          512   528 uint8: 512 fp8 latent, 4 fp32 scales (SGLang, rope-less)
    "nvfp4_ds_mla"      576   352 uint8: 512 e2m1 latent, 64 e4m3 rope, 32 e4m3 block scales (vLLM)
    "bf16"              576   576 bfloat16
    "bf16_nope"         512   512 bfloat16 (rope-less)
    ==================  ====  ====================================================================

    q: [T, H, D], bfloat16 or float32 (1 <= H <= 128); rope-less layouts (GLM-5.3-Flash) take the
        512-wide latent q alone
    kv_cache: [num_pages, page_size, row] in the layout's dtype, or [num_slots, row] flat;
        page-strided views are accepted (fp8 layouts: byte offset and strides multiples of 4)
    indices: [T, topk], int32, global slot ids ``page * page_size + row``, -1 padded, topk >= 1
    topk_length: [T], int32, optional: only the first topk_length[t] candidates are used
    sink: [H], float32, optional attention sink: out *= 1 / (1 + exp(sink - lse_natural)); a head's
        sink of -inf counts nothing (how a decode-context-parallel rank leaves another rank's heads'
        sinks out); finite or -inf (its values are not inspected: that would sync with the GPU)
    out: [T, H, 512], q's dtype, optional output buffer, written in place
    returns: out [T, H, 512] in q's dtype; with ``return_lse=True`` also lse [T, H], float32,
        ``logsumexp(s)`` in natural log (``lse_base="e"``, FlashMLA's convention, the default) or
        base 2 (``lse_base="2"``, FlashInfer's convention). The sink leaves it out unless
        ``lse_with_sink=True``: then it is one more term, ``log(exp(lse) + exp(sink))`` (a token with
        no valid slot reports the sink itself), the LSE a merge of partial softmaxes weighs by.
        Every kernel asked for a base or form returns it so (no conversion after the call).

    sm_scale: the layer's softmax scale as a Python float (never a tensor), as the engine passes it:
        never recomputed from D (GLM-5.3-Flash: 256 ** -0.5 with D = 512)
    kv_layout: one of the layouts above (``layout.KV_LAYOUTS``)
    page_size: tokens a page; must equal kv_cache.shape[1] for a paged cache
    kernel: "auto" (asks :func:`mla_sm120_plugin.selection.choose_kernel_for_shape`),
        "torch_sparse_mla", "triton_sparse_mla", "triton_sparse_mla_fast" or
        "flashinfer_sparse_mla" (each kernel's spec lists the layouts it reads)
    scale_format: "pow2", "arbitrary" or None; required by "flashinfer_sparse_mla", ignored by the
        others (they read each tile's stored scale)

    Raises :class:`mla_sm120_plugin.errors.KernelInputError` naming the argument, what was given,
    what is accepted and the fix, for any malformed input (a q or cache of another layout's width
    names the layout it fits).
    """
    scale = _validate(q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout,
                      topk_length=topk_length, page_size=page_size, out=out, return_lse=return_lse,
                      lse_base=lse_base, lse_with_sink=lse_with_sink, sink=sink, scale_format=scale_format)
    if kernel == "auto":
        from mla_sm120_plugin.selection import choose_kernel_for_shape

        kernel = choose_kernel_for_shape(
            kv_layout=kv_layout, num_heads=q.shape[1], topk=indices.shape[1],
            num_tokens=q.shape[0], device_type=q.device.type,
        )
    from mla_sm120_plugin.hooks.manager import get_registry

    known = get_registry().kernels
    if not isinstance(kernel, str) or kernel not in known:
        raise _fail("kernel", repr(kernel), f"'auto' or one of {sorted(known)}",
                    "pass one of the listed kernel names")
    bound = bind(kernel)
    kwargs = dict(sm_scale=scale, kv_layout=kv_layout, topk_length=topk_length, sink=sink, out=out,
                  return_lse=return_lse, lse_base=lse_base)
    if lse_with_sink:  # only asked of a kernel where it changes the answer
        kwargs["lse_with_sink"] = True
    # Only kernels that hand the format to native code take it (FlashInfer); the others read each
    # tile's stored scale as a value.
    if scale_format is None and bound.needs_scale_format:
        raise _fail("scale_format", "None", f"one of {layout.SCALE_FORMATS} for kernel={kernel!r}",
                    "pass 'pow2' for DeepSeek-V3.2 caches or 'arbitrary' for GLM caches")
    return bound.call(q, kv_cache, indices, scale_format=scale_format, **kwargs)
