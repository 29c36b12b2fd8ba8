"""Every vLLM internal the adapter touches under 0.33.0 and 0.34.0: what, why, what would let it go,
what changed in 0.34 (data only).

An engine upgrade is a walk down :data:`INTERNALS`. ``tests/unit/test_internals.py`` reads the
adapter's code and fails on a touched internal this list lacks (or one it lists that the code no
longer touches); ``tests/vllm/test_vllm_internals.py`` resolves every name in the installed vLLM.
DeepSeek-V4 entries name V4's modules; V4.1's (``vllm.models.deepseek_v41``) have the same names
and are patched the same way.
"""

from __future__ import annotations

from ..catalogue import Internal

_R = "0.33.0"  # the release every entry was first read from; 0.34.0's reading is in each entry's `changed`
_V34 = "0.34.0"
_SAME = {_V34: ""}  # read again in 0.34.0: nothing the adapter relies on changed
_V4 = "vllm.models.deepseek_v4"

INTERNALS: tuple[Internal, ...] = (
    # --- registration -----------------------------------------------------------------------------------
    Internal("vllm.v1.attention.backends.registry.AttentionBackendEnum",
             "register() records the backend's class path under CUSTOM (left alone when another plugin owns it)",
             "how a plugin backend becomes selectable with --attention-backend CUSTOM",
             "nothing: vLLM's documented plugin registry", _R,
             ("vllm.v1.attention.backends.registry.AttentionBackendEnum.CUSTOM",
              "vllm.v1.attention.backends.registry.register_backend"),
             changed=_SAME),
    Internal("vllm.logger",
             "logs as vllm.mla_sm120_plugin, a child of vLLM's logger",
             "vLLM puts its handler on the 'vllm' logger only, with propagate off: any other logger reaches no "
             "console in a vLLM process", "vLLM configuring the root logger", _R, ("names: child of vllm",),
             changed=_SAME),
    Internal("vllm.ray.ray_env.get_env_vars_to_copy",
             "register() adds MLA_SM120_ to VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY (additive) when a setting is set",
             "vLLM's Ray launchers copy only variables they know to the actors they start",
             "vLLM carrying plugin settings in its config objects", _R,
             ("names: $VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY",),
             changed=_SAME),
    # --- translation --------------------------------------------------------------------------------------
    Internal("vllm.config.get_current_vllm_config_or_none",
             "reads the VllmConfig in scope while vLLM builds the model",
             "validate_configuration and the impl's constructor carry no model config",
             "vLLM passing the model config to backends (vllm#40051)", _R,
             changed=_SAME),
    Internal("vllm.config.vllm.VllmConfig",
             "reads attention_config by name (with a default) beside its model, cache, parallel, scheduler, "
             "speculative and compilation configs",
             "the plan's engine limits and settings are vLLM's", "nothing: vLLM's config", _R,
             ("dsv4: .attention_config", "translate: .attention_config"),
             changed={_V34: "compute_hash became compile_factors and model runner V1 is gone; the fields read are unchanged"}),
    Internal("vllm.config.attention.AttentionConfig",
             "reads backend (the opt-in), use_non_causal (a DSpark draft) and hisparse_config by name",
             "the opt-in is CUSTOM; DSpark widens DeepSeek-V4 window rows; HiSparse changes the cache",
             "nothing: vLLM's config", _R,
             ("dsv4: .backend", "dsv4: .use_non_causal", "translate: .use_non_causal", "translate: .hisparse_config"),
             changed={_V34: "new sparse_mla_shard_q (default on): it applies to impls that set supports_shardq, which the "
                            "plugin's leaves False"}),
    Internal("vllm.config.parallel.ParallelConfig",
             "reads prefill and decode context-parallel sizes and the DCP interleave by name",
             "prefill CP is refused (the calls take no PCP metadata); the DCP size is a plan input (the heads a "
             "call sees, the cache each GPU keeps)",
             "nothing: vLLM's config", _R,
             ("dsv4: .prefill_context_parallel_size", "translate: .decode_context_parallel_size",
              "translate: .prefill_context_parallel_size", "translate: .cp_kv_cache_interleave_size"),
             changed=_SAME),
    Internal("vllm.config.model.ModelConfig",
             "reads hf_text_config (a DSA layer's geometry), beside hf_config, model and architectures",
             "the model's facts are read from the config vLLM builds the layer from", "nothing: vLLM's config", _R,
             ("translate: .hf_text_config",),
             changed=_SAME),
    Internal("vllm.platforms.current_platform",
             "reads the device capability where the selector gave none (DeepSeek-V4, a forced impl)",
             "the plan is made for this GPU's SM", "nothing: vLLM's platform API", _R,
             ("vllm.platforms.current_platform.get_device_capability",),
             changed=_SAME),
    # --- the DSA binding ------------------------------------------------------------------------------------
    Internal("vllm.v1.attention.backend.AttentionBackend",
             "subclasses it; validate_configuration(**AttentionSelectorConfig) decides the plan (then calls "
             "super()'s), raising the plugin's own error",
             "vLLM's selector calls it while the model is built, before weights load; an exception other than "
             "ImportError/OSError propagates unchanged, so the user sees the plugin's whole message",
             "vLLM passing the model config to backends", _R,
             ("vllm.v1.attention.backend.MultipleOf", "backend: super().validate_configuration"),
             changed=_SAME),
    Internal("vllm.v1.attention.backends.mla.flashinfer_mla_sparse.FlashInferMLASparseMetadataBuilder",
             "subclasses it (its metadata: block table, req_id_per_token, decode/prefill split) and sets the "
             "reorder threshold to true decodes only (1 + speculative tokens) with _init_reorder_batch_threshold",
             "decode rows go to the split-K decode kernels", "a sparse-MLA metadata builder for plugin backends", _R,
             ("vllm.v1.attention.backends.mla.flashinfer_mla_sparse.FlashInferMLASparseMetadata",
              "backend: ._init_reorder_batch_threshold"),
             changed={_V34: "the reorder threshold reads max_decode_query_len (1 + k + the drafter's extra slots), "
                            "which the plan's decode bound now reads too; metadata gains shardq / topk_start (unused: "
                            "no ShardQ); still UNIFORM_BATCH"}),
    Internal("vllm.v1.attention.backend.max_decode_query_len",
             "calls it for the plan's decode bound (translate.engine_limits)",
             "the widest request vLLM's builders count as a decode (the reorder threshold reads it): the plan must "
             "bound the same calls", "nothing: vLLM's own function", _R,
             changed={_V34: "adds the drafter's extra slots (max_num_new_slots_for_drafting: a standalone draft's "
                            "correction token); model runner V1's parallel-drafting +k term is gone with V1"}),
    Internal("vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonImpl",
             "subclasses it: its constructor and the shared topk_indices_buffer (logical positions, -1 padded). vLLM "
             "builds the impl under set_default_torch_dtype and torch.device of the load: the self-check makes its "
             "tensors with explicit devices and dtypes. Under DCP (AttentionImpl's contract): sets supports_dcp, "
             "can_return_lse_for_decode and lse_base_on_e (the engine fact's base), reads dcp_world_size / dcp_rank, "
             "and forward_mqa returns (out, lse) (the plugin's rank share: each rank counts its own heads' sinks)",
             "the indexer writes that buffer; the impl reads it. Its KV dtype canonicalisation is keyed on in-tree "
             "backend names and never fires for CUSTOM (fp8 / fp8_e4m3 are refused, naming fp8_ds_mla). vLLM's "
             "selector keeps a backend under DCP only if its impl says so; vLLM gathers q's heads over the DCP group "
             "and merges the ranks' outputs by the LSE in the declared base (cp_lse_ag_out_rs / all-to-all)",
             "a sparse-MLA impl API for plugin kernels", _R,
             changed={_V34: "MLAAttention sizes fp8_ds_mla rows by impl.get_fp8_ds_mla_row_bytes(), which the plugin's impl "
                            "answers per layout (656; 528 rope-less; 352 nvfp4); supports_shardq (False here); q may "
                            "come as one [N, H, 576] tensor (prepare_mqa_query); kv_sharing_target_layer_name is real "
                            "(Mistral Large 4)"}),
    Internal("vllm.v1.attention.backends.mla.sparse_utils.flat_kv_row_view",
             "views vLLM's cache as flat rows (and align_blocks_to_rows keeps blocks whole 64-row pages apart), "
             "then as [rows / 64, 64, C] pages",
             "vLLM may interleave other layers' pages between this layer's blocks; slots are rows of that view. "
             "vLLM's DSA writer stores power-of-two fp32 scales for every model in 0.33 (GLM included); the "
             "Triton and torch kernels read the scale as a value, FlashInfer is told the profile's format",
             "nothing: vLLM's own SM120 impl views the cache the same way", _R,
             ("vllm.v1.attention.backends.mla.sparse_utils.align_blocks_to_rows",),
             changed=_SAME),
    Internal("vllm.v1.attention.backends.mla.sparse_utils.triton_convert_req_index_to_global_index",
             "logical -> global slot ids on CUDA when the top-k width is a multiple of 128 (its assertion); "
             "otherwise the binding's logical_to_global does the same in a few graph-safe torch ops",
             "the kernels read global slots", "the indexer writing global slots", _R,
             changed=_SAME),
    Internal("vllm.v1.attention.backends.mla.sparse_utils.triton_filter_and_convert_dcp_index",
             "under DCP, keeps this rank's owned ids of each top-k row (owner = position // "
             "cp_kv_cache_interleave_size % DCP) as slots of its own cache, compacted to a prefix with valid "
             "counts; the top-k row is padded with -1 to its 128-wide tile first",
             "each rank holds 1/DCP of the cache; vLLM's own sparse-MLA base filters the same way",
             "nothing: vLLM's own DCP filter", _R, changed=_SAME),
    # --- the DeepSeek-V4 binding ------------------------------------------------------------------------------
    Internal(f"{_V4}.nvidia.model._select_dsv4_attn_cls",
             "wraps it (V4's and V4.1's nvidia.model modules, when vLLM imports them: an import hook installed by "
             "register()); with the opt-in it returns the plugin's layer class",
             "vLLM picks DeepSeek-V4's layer class itself, never through the attention selector",
             "vLLM resolving DeepSeek-V4 layers through AttentionBackendEnum.CUSTOM", _R,
             (f"{_V4}.nvidia.model", "vllm.models.deepseek_v41.nvidia.model", "dsv4: _select_dsv4_attn_cls",
              "dsv4: ._select_dsv4_attn_cls"),
             changed={_V34: "V4.1's gains a LoRA guard; the callers are still the module globals"}),
    Internal(f"{_V4}.nvidia.flashinfer_sparse.DeepseekV4FlashInferSM120Attention",
             "subclasses it (the plugin's layer): runs the base DeepseekV4Attention.__init__ without the SM120 "
             "class's FlashInfer gate; _forward_decode / _forward_prefill run as vLLM wrote them, their kernel call "
             "routed per phase", "the plan and the self-check decide each (layer kind, phase)'s kernel",
             "vLLM taking the sparse kernel as a per-layer callable", _R,
             ("dsv4: .DeepseekV4FlashInferSM120Attention", "dsv4: ._forward_decode", "dsv4: ._forward_prefill",
              "dsv4: super()._forward_decode", "dsv4: super()._forward_prefill"),
             changed={_V34: "helpers made public (get_flashinfer_dsv4_workspace, required_sm120_sparse_topk, ...); _o_proj "
                            "calls wo_a.grouped_forward with the same recipe; V4.1's compressed block is 64 on SM12x "
                            "(was 128) and its builders UNIFORM_BATCH (prefill not captured)"}),
    Internal(f"{_V4}.nvidia.flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4",
             "replaces the module global with a router: the plugin's kernel while one is set, else vLLM's call",
             "the SM120 layer calls FlashInfer's DeepSeek-V4 kernel through it", "as above", _R,
             ("dsv4: .flashinfer_trtllm_batch_decode_sparse_mla_dsv4",),
             changed=_SAME),
    Internal(f"{_V4}.nvidia.ops.o_proj.compute_fp8_einsum_recipe",
             "calls it (the module's global; V4.1's with _o_proj_block_size) and sets _einsum_recipe / "
             "_tma_aligned_scales, as the SM120 __init__ the plugin's layer skips does",
             "the o-projection needs them", "the recipe set by the base layer's __init__", _R,
             ("dsv4: .compute_fp8_einsum_recipe", "dsv4: ._einsum_recipe", "dsv4: ._tma_aligned_scales",
              "dsv4: ._o_proj_block_size"),
             changed=_SAME),
    Internal(f"{_V4}.attention.DeepseekV4Attention.get_kv_cache_spec",
             "overrides it: the NVFP4 record rebuilds the compressed cache's spec", "see AttentionSpec",
             "vLLM sizing the spec from a layer's record", _R,
             ("dsv4: .get_kv_cache_spec", "dsv4: super().get_kv_cache_spec"),
             changed=_SAME),
    Internal("vllm.v1.kv_cache_interface.AttentionSpec",
             "dataclasses.replace on the layer's spec: state_content_bytes and alignment of the 384-byte record, "
             "page_size_padded recomputed (and dtype uint8)",
             "vLLM's block accounting then gives 584 / 384 = 1.52x the entries in the same memory",
             "an NVFP4 DeepSeek-V4 cache in vLLM", _R,
             ("dsv4_nvfp4: .state_content_bytes", "dsv4_nvfp4: .alignment", "dsv4_nvfp4: .page_size_padded"),
             changed={_V34: "SlidingWindowMLASpec.merge asserts one kv_quant_mode and one alignment a group: every layer of "
                            "a group gets the NVFP4 record (the opt-in is per model)"}),
    Internal(f"{_V4}.attention.DeepseekV4Attention._fused_qnorm_rope_kv_insert",
             "overrides it for the NVFP4 record (q normed and roped as vLLM's op returns it, the KV row stored as "
             "the record); vLLM's own for fp8 and profile runs",
             "vLLM's fused insert writes the 584-byte fp8 record only", "an NVFP4 DeepSeek-V4 cache in vLLM", _R,
             ("dsv4: ._fused_qnorm_rope_kv_insert", "dsv4: super()._fused_qnorm_rope_kv_insert"),
             changed={_V34: "V4.1's gains a q-padding copy path; the NVFP4 override is V4-only"}),
    Internal(f"{_V4}.attention._resolve_dsv4_kv_cache_dtype",
             "wraps it (in every module of the layer's class hierarchy): ('nvfp4_ds_mla', uint8) while the "
             "plugin's NVFP4 layer is built, vLLM's answer everywhere else",
             "it accepts only fp8 spellings for the packed layout", "an NVFP4 DeepSeek-V4 cache in vLLM", _R,
             ("dsv4_nvfp4: _resolve_dsv4_kv_cache_dtype", "dsv4_nvfp4: ._resolve_dsv4_kv_cache_dtype"),
             changed=_SAME),
    Internal("vllm.v1.attention.backends.mla.sparse_swa.DeepseekV4SWACache",
             "writes packed_bytes_per_token and packed_page_alignment of the layer's window cache (384 / its page "
             "alignment)", "the window pool's spec is sized from them", "an NVFP4 DeepSeek-V4 cache in vLLM", _R,
             ("dsv4_nvfp4: .packed_bytes_per_token", "dsv4_nvfp4: .packed_page_alignment"),
             changed=_SAME),
    Internal(f"{_V4}.compressor.DeepseekCompressor._compress_norm_rope_store",
             "swaps the compressor's __class__ for a subclass whose _compress_norm_rope_store stores the NVFP4 "
             "record, reading the compressed cache from _static_forward_context",
             "vLLM's own override point for the compressed rows", "an NVFP4 DeepSeek-V4 cache in vLLM", _R,
             ("dsv4_nvfp4: .__class__", "dsv4_nvfp4: ._compress_norm_rope_store",
              "dsv4_nvfp4: ._static_forward_context"),
             changed=_SAME),
)
