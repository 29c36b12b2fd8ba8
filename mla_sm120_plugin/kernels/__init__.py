"""Sparse-MLA kernels: one entry, :func:`sparse_mla_forward`, and the cache layouts it reads.

Importing this package imports neither torch nor triton (the plugin is imported in every engine
process, most of which never run a kernel); :func:`sparse_mla_forward` imports :mod:`.api` on its
first call. Modules: :mod:`.layout` (bytes, pure Python), :mod:`.pack` (quantize / write caches),
:mod:`.reference` (torch ground truth), :mod:`.triton`, :mod:`.flashinfer`, :mod:`.bench`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_sm120_plugin.kernels import layout

if TYPE_CHECKING:
    import torch

__all__ = ["sparse_mla_forward"]


def sparse_mla_forward(
    q: "torch.Tensor",
    kv_cache: "torch.Tensor",
    indices: "torch.Tensor",
    *,
    sm_scale: float,
    kv_layout: str,
    topk_length: "torch.Tensor | None" = None,
    page_size: int = layout.PAGE_SIZE,
    kernel: str = "auto",
    out: "torch.Tensor | None" = None,
    return_lse: bool = False,
    lse_base: str = "e",
    sink: "torch.Tensor | None" = None,
    scale_format: str | None = None,
):
    """Sparse MLA (DeepSeek Sparse Attention) over a paged KV cache, validated then dispatched.

    The one statement of the kernel contract; the kernels and the reference point here.

    For each token ``t`` and head ``h``: ``s_j = sm_scale * <q[t, h], K_j>`` over the valid slots of
    ``indices[t]``, ``out[t, h] = softmax(s) @ V`` with ``K_j`` the cached token (``D`` wide: the
    512-wide latent, then the rope where the layout has one) and ``V_j = K_j[:512]`` (one KV head
    shared by all heads). A slot is invalid, masked and never read, when it is -1, outside
    ``[0, num_slots)``, or at a position ``>= topk_length[t]``. A token with no valid slot gets
    ``out = 0`` and ``lse = -inf``. Cache layouts, to the byte, are in
    :mod:`mla_sm120_plugin.kernels.layout`; ``D`` and the row are the layout's ``head_dim`` and
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
    sink: [H], float32, optional attention sink: out *= 1 / (1 + exp(sink - lse_natural))
    out: [T, H, 512], q's dtype, optional output buffer, written in place
    returns: out [T, H, 512] in q's dtype; with ``return_lse=True`` also lse [T, H], float32,
        ``logsumexp(s)`` in natural log (``lse_base="e"``, FlashMLA's convention, the default) or
        base 2 (``lse_base="2"``, FlashInfer's convention); the sink does not change lse

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
    from mla_sm120_plugin.kernels import api

    return api.sparse_mla_forward(
        q, kv_cache, indices, sm_scale=sm_scale, kv_layout=kv_layout, topk_length=topk_length,
        page_size=page_size, kernel=kernel, out=out, return_lse=return_lse, lse_base=lse_base,
        sink=sink, scale_format=scale_format,
    )
