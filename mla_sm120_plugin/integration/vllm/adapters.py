"""Every place this plugin leans on vLLM 0.33 internals, in one list.

An engine upgrade is a walk down this file. Each entry says what we use, why, and what upstream
change would let it go.

1. ``AttentionBackendEnum.CUSTOM`` + ``register_backend`` (registry.py): how a plugin backend is
   selectable at all. Stable public-ish API.
2. ``AttentionBackend.validate_configuration(**AttentionSelectorConfig)``: called by the CUDA
   selector while the model is being built, before weights load. It carries no model info, so
   the model is read from :func:`current_vllm_config` (vllm.config.get_current_vllm_config_or_none).
   Would go if vLLM passed the model config to backends (vllm#40051 asked for config plumbing).
   An exception other than ImportError/OSError propagates unchanged: we raise our own error so
   the user sees our full message rather than vLLM's "Reason: [...]" list.
3. ``FlashInferMLASparseMetadataBuilder`` (backends/mla/flashinfer_mla_sparse.py): we reuse its
   metadata (block table, req_id_per_token, decode/prefill split) and set the reorder threshold
   to true decodes only (1 + speculative tokens), so decode rows go to split-K decode kernels.
4. ``SparseMLACommonImpl`` (layers/attention/sparse_mla_attention.py): constructor and the shared
   ``topk_indices_buffer`` (logical positions, -1 padded, written by the indexer).
5. ``flat_kv_row_view`` (backends/mla/sparse_utils.py): vLLM may interleave other layers' pages
   between this layer's blocks; slots are rows of that flat view.
6. ``triton_convert_req_index_to_global_index``: logical -> global slot ids, used on CUDA when
   the top-k width is a multiple of 128 (its assertion); otherwise :func:`logical_to_global`
   below does the same in a few graph-safe torch ops.
7. KV dtype canonicalisation (``_canonicalize_sparse_mla_kv_cache_dtype`` in mla_attention.py)
   is keyed on in-tree backend names and never fires for CUSTOM: ``fp8``/``fp8_e4m3`` would
   give the plain fp8 layout, so we refuse them and name ``--kv-cache-dtype fp8_ds_mla``.
8. The DSA cache writer (models/deepseek_v32/common/kernels.py) writes power-of-two fp32 scales
   for every model in 0.33, GLM included. Our Triton and torch kernels read the fp32 scale as a
   value, so they are right for either format; FlashInfer is told the profile's format, and
   ``arbitrary_fp32`` (GLM's) reads pow2 scales correctly too.
9. Logging (vllm/logger.py): vLLM puts its handler on the ``vllm`` logger only, with
   ``propagate`` off; the adapter logs as ``vllm.mla_sm120_plugin`` so its two init lines reach
   vLLM's console in every process. Would go if vLLM configured the root logger.
10. Ray environment (vllm/ray/ray_env.py): the Ray data-parallel launcher copies only variables it
   knows to its engine-core actors; ``register()`` adds ``MLA_SM120_`` to
   ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (vLLM's additive knob) when a setting is set. Would go
   if vLLM carried plugin settings in its config objects.
11. Construction context (model_executor/model_loader/base_loader.py ``load_model``): vLLM builds the
   impl under ``set_default_torch_dtype(model dtype)`` and ``torch.device(load device)``; the
   self-check makes its tensors with explicit devices and dtypes and runs the kernels under the
   defaults a forward sees.
12. 64-row pages: the kernels get ``flat_kv_row_view`` rows as ``[rows / 64, 64, C]`` (vLLM's own
   SM120 impl passes FlashInfer the same ``view(-1, 64, C)``); ``customize_spec`` keeps blocks whole
   64-row pages apart, so the view always exists.
13. DeepSeek-V4's class choice (``_select_dsv4_attn_cls``, a global of
   ``vllm.models.deepseek_v4.nvidia.model`` and ``vllm.models.deepseek_v41.nvidia.model``, looked up by
   name by the target, MTP and DSpark decoder layers): it never consults the attention selector, so
   :mod:`.dsv4` wraps it when vLLM imports those modules (an import hook installed by ``register()``).
   Would go if vLLM resolved DeepSeek-V4 layers through ``AttentionBackendEnum.CUSTOM``.
14. ``DeepseekV4FlashInferSM120Attention`` (both versions' ``flashinfer_sparse.py``): the plugin's layer
   subclasses it; its ``__init__`` runs the base ``DeepseekV4Attention.__init__`` and the SM120 class's
   o-projection recipe (``compute_fp8_einsum_recipe``, V4.1 with ``_o_proj_block_size``) but not its
   FlashInfer gate (``has_flashinfer_sparse_mla_sm120_config``: the plan and the self-check decide);
   ``_forward_decode`` / ``_forward_prefill`` run as vLLM wrote them, their kernel call (the module
   global ``flashinfer_trtllm_batch_decode_sparse_mla_dsv4``) routed per phase. Would go if vLLM took
   the sparse kernel as a per-layer callable.
"""

from __future__ import annotations

from typing import Any


def current_vllm_config() -> Any:
    """The VllmConfig in scope, or None (outside vLLM's model construction)."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def logical_to_global(
    logical: Any, req_id_per_token: Any, block_table: Any, *, block_size: int, block_stride_rows: int
) -> Any:
    """Per-request logical token positions -> rows of the flat KV view; -1 stays -1.

    :param logical: [N, topk], int32: positions within each token's request, -1 padded.
    :param req_id_per_token: [>=N], int32: the request row of each token.
    :param block_table: [num_reqs, max_blocks], int32: physical block ids.
    :returns: [N, topk], int32 global slots; -1 where the position is -1 or past the block table.
    """
    import torch

    n = logical.shape[0]
    req = req_id_per_token[:n].long().unsqueeze(1)  # [N, 1]
    pos = logical.long()
    blk = torch.div(pos.clamp(min=0), block_size, rounding_mode="floor")  # [N, topk]
    valid = (pos >= 0) & (blk < block_table.shape[1])
    phys = block_table[req, blk.clamp(max=block_table.shape[1] - 1)].long()  # [N, topk]
    slots = phys * block_stride_rows + pos.remainder(block_size)
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
