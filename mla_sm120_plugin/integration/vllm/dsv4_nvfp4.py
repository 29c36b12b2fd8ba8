"""DeepSeek-V4's 384-byte NVFP4 cache in vLLM 0.33 and 0.34: ``--kv-cache-dtype nvfp4_ds_mla`` with the opt-in.

vLLM takes ``nvfp4_ds_mla`` on its command line and in its config for an MLA model; its DeepSeek-V4
layer refuses it at build (``_resolve_dsv4_kv_cache_dtype`` accepts only fp8 spellings for the
packed layout), and nothing in vLLM writes or reads FlashInfer's 384-byte record. With
``--attention-backend CUSTOM`` every DeepSeek-V4 layer is the plugin's class
(:mod:`.dsv4`); when the plan's record is NVFP4 (:func:`mla_sm120_plugin.plan.plan`) that class:

- builds vLLM's layer with the record resolved as ``("nvfp4_ds_mla", uint8)`` (:func:`resolver`,
  answering for vLLM's resolver while the plugin's layer is built, and only then);
- sizes both pools' cache specs at 384 bytes an entry (the window cache's, which its
  ``DeepseekV4SWACache`` reports, and the compressed cache's, which the layer reports), so vLLM's
  block accounting gives 584 / 384 = 1.52x the entries in the same memory;
- writes the window rows (:func:`insert_window`, in place of vLLM's fused fp8 insert: q normed and
  roped as vLLM's op returns it, the KV row roped and stored as the record) and the compressed rows
  (:class:`Nvfp4Compressor`, vLLM's own override point ``_compress_norm_rope_store``);
- reads the record: each phase's kernel gets ``kv_cache_format="nvfp4"`` (vLLM's call passes no
  format; FlashInfer's default is the 584-byte one).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable

from ...kernels.dsv4.layout import NVFP4_DSV4, NVFP4_RECORD

RESOLVER = "_resolve_dsv4_kv_cache_dtype"
NVFP4_SPELLING = "nvfp4_ds_mla"  # vLLM's own name for an NVFP4 MLA cache (its CacheDType)

# The record the plugin's layer being built writes (None outside the plugin's layer __init__).
_building: contextvars.ContextVar[str | None] = contextvars.ContextVar("mla_sm120_dsv4_record", default=None)


def building(record: str) -> contextvars.Token:
    """Mark the plugin's layer ``__init__`` as building a layer of ``record`` (reset with the token)."""
    return _building.set(record)


def done_building(token: contextvars.Token) -> None:
    _building.reset(token)


def wrap_resolver(module: Any) -> None:
    """Let ``module._resolve_dsv4_kv_cache_dtype`` resolve the NVFP4 spelling while the plugin's
    layer with an NVFP4 plan is built; vLLM's function everywhere else (once)."""
    original = getattr(module, RESOLVER, None)
    if original is None or getattr(original, "_mla_sm120", False):
        return

    def _resolve_dsv4_kv_cache_dtype(use_fp8_ds_mla_layout: bool, kv_cache_dtype: str, *args: Any,
                                     **kwargs: Any) -> tuple[str, Any]:
        return resolver(original, use_fp8_ds_mla_layout, kv_cache_dtype, *args, **kwargs)

    _resolve_dsv4_kv_cache_dtype._mla_sm120 = True  # type: ignore[attr-defined]
    _resolve_dsv4_kv_cache_dtype.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, RESOLVER, _resolve_dsv4_kv_cache_dtype)


def resolver(original: Callable[..., tuple[str, Any]], use_fp8_ds_mla_layout: bool, kv_cache_dtype: str,
             *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """``("nvfp4_ds_mla", torch.uint8)`` for the plugin's NVFP4 layer on the packed layout, else vLLM's answer."""
    if _building.get() == NVFP4_DSV4 and use_fp8_ds_mla_layout and kv_cache_dtype == NVFP4_SPELLING:
        import torch

        return NVFP4_SPELLING, torch.uint8
    return original(use_fp8_ds_mla_layout, kv_cache_dtype, *args, **kwargs)


def adopt(layer: Any) -> None:
    """Make a freshly built vLLM DeepSeek-V4 layer hold the NVFP4 record: its window cache's entry size
    and page alignment, its compressor's writer."""
    swa = layer.swa_cache_layer
    swa.packed_bytes_per_token = NVFP4_RECORD.token_bytes
    swa.packed_page_alignment = NVFP4_RECORD.page_align
    if layer.compressor is not None:
        layer.compressor.__class__ = compressor_class(type(layer.compressor))


def compressed_spec(spec: Any) -> Any:
    """vLLM's compressed-cache spec for the layer (``None``: a window-only layer) at 384 bytes an entry."""
    if spec is None:
        return None
    import torch

    # page_size_padded=None: the spec's own __post_init__ pads the new page to the new alignment
    return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=NVFP4_RECORD.token_bytes,
                               alignment=NVFP4_RECORD.page_align, page_size_padded=None)


def insert_window(layer: Any, q: Any, kv: Any, positions: Any, attn_metadata: Any) -> Any:
    """What vLLM's fused insert does on the packed path, writing the NVFP4 record: returns q
    ([T, padded_heads, 512] bf16, normed and roped) after storing the roped KV rows."""
    from ...kernels.dsv4 import nvfp4_writer

    swa_metadata = attn_metadata.get(layer.swa_cache_layer.prefix)
    if swa_metadata is None:
        from ...errors import KernelInputError, format_error

        raise KernelInputError(format_error(
            f"attention metadata without the window cache's entry {layer.swa_cache_layer.prefix!r}",
            "vLLM's DeepseekSparseSWAMetadata for the layer's window cache", "run the layer under vLLM's forward"))
    cos_sin = layer.rotary_emb.cos_sin_cache
    nvfp4_writer.insert_rows(layer.swa_cache_layer.kv_cache, kv, swa_metadata.slot_mapping, positions, cos_sin)
    return nvfp4_writer.normed_roped_query(q, positions, cos_sin, layer.padded_heads, layer.eps)


class Nvfp4Compressor:
    """Mixed in before vLLM's ``DeepseekCompressor``: its compress / norm / rope step stores the NVFP4 record."""

    def _compress_norm_rope_store(self, state_metadata: Any, state_cache: Any, state_width: int, positions: Any,
                                  rotary_emb: Any, attn_metadata: dict[str, Any], pdl_kwargs: dict) -> None:
        from ...kernels.dsv4 import nvfp4_writer

        tokens = state_metadata.slot_mapping.shape[0]
        kv_cache = self._static_forward_context[self.k_cache_prefix].kv_cache  # type: ignore[attr-defined]
        nvfp4_writer.compress_insert(
            kv_cache, attn_metadata[self.k_cache_prefix].slot_mapping[:tokens],  # type: ignore[attr-defined]
            state_cache=state_cache, state_slots=state_metadata.slot_mapping,
            token_to_req=state_metadata.token_to_req_indices, block_table=state_metadata.block_table,
            state_block=state_metadata.block_size, state_width=state_width, positions=positions,
            ratio=self.compress_ratio, overlap=self.overlap, norm_weight=self.norm.weight,  # type: ignore[attr-defined]
            eps=self.rms_norm_eps, cos_sin_cache=rotary_emb.cos_sin_cache)  # type: ignore[attr-defined]


_compressors: dict[type, type] = {}


def compressor_class(base: type) -> type:
    """The plugin's subclass of vLLM's compressor class ``base`` (made once)."""
    if getattr(base, "_mla_sm120_nvfp4", False):
        return base
    if base not in _compressors:
        _compressors[base] = type(f"MlaSm120Nvfp4{base.__name__}", (Nvfp4Compressor, base),
                                  {"__module__": __name__, "_mla_sm120_nvfp4": True})
    return _compressors[base]
