"""Every SGLang 0.5.23 internal the adapter touches: what, why, what would let it go (data only).

An SGLang upgrade is a walk down :data:`INTERNALS`. ``tests/unit/test_internals.py`` reads the
adapter's code and fails on a touched internal this list lacks (or one it lists that the code no
longer touches); ``tests/sglang_engine/test_sglang_internals.py`` resolves every name in the installed SGLang.
"""

from __future__ import annotations

from ..catalogue import Internal
from ...engines import SGLANG

_R = SGLANG.release  # the release every entry was read from

INTERNALS: tuple[Internal, ...] = (
    # --- the hook mechanism and the flags -------------------------------------------------------------
    Internal("sglang.srt.plugins.hook_registry.HookRegistry",
             "register() and --mla-sm120 register every hook (AROUND, the flags AFTER) and apply them",
             "SGLang's plugin mechanism: the only way to run code inside its launcher and schedulers",
             "nothing to let go: it is SGLang's plugin API (kept while it exists)", _R,
             ("sglang.srt.plugins.hook_registry.HookRegistry.register",
              "sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks",
              "sglang.srt.plugins.hook_registry.HookType",
              "sglang.srt.plugins.hook_registry.HookType.AFTER",
              "sglang.srt.plugins.hook_registry.HookType.AROUND")),
    Internal("sglang.srt.server_args.ServerArgs.add_cli_args",
             "AFTER it: adds --mla-sm120 and --mla-sm120-config to every parser SGLang builds",
             "the opt-in must be a flag of SGLang's own command line (and of its --config merger)",
             "a plugin-flags hook in SGLang's server args", _R),
    # --- the DSA binding --------------------------------------------------------------------------------
    Internal("sglang.srt.arg_groups.overrides._dsa_split_backend_resolution",
             "AROUND it, in the launcher: plans from the resolved arguments, exports the plan, routes both "
             "DSA phases to flashinfer_sparse_mla",
             "the one place SGLang decides the DSA backends before any weight loads; a refusal there stops start-up",
             "a DSA backend registry SGLang's resolution consults for plugin backends", _R),
    Internal("sglang.kernels.ops.attention.flash_mla_sm120._validate_flashinfer_sparse_mla_backend",
             "AROUND it, in each scheduler: the launcher's decision replaces SGLang's GLM-only check; binds and "
             "self-checks once a process",
             "SGLang refuses every non-GLM model on SM120 here, and its DSA backend's constructor calls it first",
             "a validator that accepts a plugin-served call site", _R),
    Internal("sglang.kernels.ops.attention.flash_mla_sm120.flashinfer_sparse_mla_forward",
             "AROUND it: the bound kernel of the current phase on SGLang's cache viewed as 64-row pages",
             "the call every SM120 DSA forward makes; serving it changes the kernel and nothing else",
             "a per-phase kernel callable on SGLang's DSA backend", _R),
    Internal("sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode",
             "AROUND it: marks the calls inside as decode",
             "the call site carries no phase; the plan binds a kernel per phase",
             "a phase argument on flashinfer_sparse_mla_forward", _R),
    Internal("sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend",
             "AROUND it: marks the calls inside as prefill (target-verify and draft-extend as decode, as SGLang "
             "counts them), reading its forward_batch's forward_mode",
             "as forward_decode", "as forward_decode", _R),
    Internal("sglang.srt.model_executor.forward_batch_info.ForwardBatch",
             "reads forward_batch.forward_mode (is_target_verify, is_draft_extend_v2) in forward_extend's hook",
             "target-verify and draft-extend rows are decode-shaped; SGLang counts them as decode",
             "a phase argument on flashinfer_sparse_mla_forward", _R, ("dsa: .forward_mode",)),
    Internal("sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._check_kpool_tail_backend",
             "AROUND it: lets the routed call site through for a pooled indexer (GLM-5.3-Flash)",
             "SGLang allows only fa3/tilelang/trtllm there, none of which runs on SM12x with an fp8 cache; the "
             "plugin's kernels read the expanded token slots",
             "the check admitting impls that read expanded slots", _R),
    Internal("sglang.srt.runtime_context.get_buffer",
             "claims SGLang's FlashInfer workspace name (dsa_flashinfer_sparse_mla_workspace) with an empty buffer",
             "SGLang's DSA backend allocates 384 MiB a GPU there for FlashInfer; no kernel of the plugin reads it",
             "a workspace allocated by the kernel that uses it", _R),
    # --- decode context parallelism (--dcp-size) -----------------------------------------------------------
    Internal("sglang.srt.arg_groups.overrides._invoke_provider",
             "AROUND it, in the launcher: for HY V4 under --dcp-size > 1, runs SGLang's DeepSeek-family provider on a "
             "copy of the record at --dcp-size 1, then adds its DSA DCP declarations (and refusals) for the real size",
             "SGLang refuses HY V4 under DCP inside that provider (no single owner for its sinks), before any plugin "
             "pass; the plugin gives each head's sink one owner",
             "an SGLang DCP check that asks the DSA backend whether it applies sinks once", _R,
             ("sglang.srt.arg_groups.model_overrides.deepseek_v2._deepseek_family_overrides",
              "sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides",
              "dcp: .architectures", "dcp: .dcp_size")),
    Internal("sglang.srt.layers.attention.dsa.dsa_dcp.localize_dcp_page_table",
             "calls it in each DCP call with the backend's DcpPageTableCache: the call's slots -> this rank's (owned "
             "first, -1 after) and their counts, reused across layers that share a top-k",
             "SGLang's own rule for which rank keeps a slot where (the one its DCP cache writer follows)",
             "a page table SGLang localizes before any DSA call site", _R, ("dcp: ._dcp_page_table_cache",)),
    Internal("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla.is_mla_dcp_lse_base_on_e",
             "asks it once a process for the dsa backend: the base SGLang's DCP merge reads the LSE in (2), which "
             "must be the base the plan's kernels are asked for and self-checked in (the engine fact)",
             "the merge's exp/log pair must match the LSE handed to it",
             "an LSE base the attention backend declares", _R),
    # --- the DeepSeek-V4 binding -------------------------------------------------------------------------
    Internal("sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults",
             "AROUND it, in the launcher: plans every (layer kind, phase) once SGLang resolved its DeepSeek-V4 "
             "settings, refuses what cannot be served, exports the plan",
             "the last launcher step before weights load that knows the backend, pages and KV dtype",
             "a DeepSeek-V4 backend registry for plugin kernels", _R),
    Internal("sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend.__init__",
             "AROUND it, in each scheduler: binds and self-checks each kind's kernels",
             "the first scheduler-side point that exists once per DeepSeek-V4 model", "as above", _R),
    Internal("sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120",
             "AROUND it: routes every DeepSeek-V4 call by (layer kind, phase) to FlashInfer's call or the "
             "plugin's Triton kernel on the same arguments",
             "every DeepSeek-V4 attention call on SM12x goes through it (imported at call time)",
             "a per-layer kernel callable on SGLang's DeepSeek-V4 backend", _R),
    Internal("sglang.kernels.ops.attention.flash_mla_sm120.SM120_DECODE_MAX_TOKENS",
             "reads it: the token count above which SGLang's call is the prefill form",
             "the phase of a DeepSeek-V4 call is SGLang's own split", "a phase argument on the call", _R),
    Internal("flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4",
             "resolves it (FlashInfer's, as SGLang's call reaches it) for the self-check of a kind FlashInfer serves",
             "the self-check runs the kernel SGLang's call runs", "nothing: FlashInfer's public kernel", _R),
    # --- translation: SGLang's resolved settings -> the plan's inputs -------------------------------------
    Internal("sglang.srt.arg_groups.model_override_base.ResolvedView",
             "reads SGLang's resolved arguments and its memoized model config through its views",
             "the plan needs the settings as SGLang resolved them, before its later passes write the record",
             "resolved settings passed to plugin hooks", _R,
             ("sglang.srt.arg_groups.model_override_base",
              "sglang.srt.arg_groups.model_override_base.ResolvingConfig",
              "sglang.srt.arg_groups.model_override_base._declaration_overlay",
              "sglang.srt.arg_groups.model_override_base.record_of",
              "sglang.srt.arg_groups.model_override_base.resolving_view",
              "sglang.srt.arg_groups.model_override_base.model_config_of")),
    Internal("sglang.srt.server_args.ServerArgs",
             "reads its fields on SGLang's resolved view: parallelism (tp, attention DP / CP, DCP), batching, "
             "chunked prefill, CUDA graphs, HiSparse, HiCache, PD disaggregation, speculation, the KV dtype, the "
             "model's served name and the DSA backends it resolved (the re-run check; the user's, under the view)",
             "the plan's engine limits and settings are SGLang's", "resolved settings passed to plugin hooks", _R,
             tuple(f"translate: .{name}" for name in (
                 "tp_size", "attn_dp_size", "attn_cp_size", "dcp_size", "chunked_prefill_size", "disable_cuda_graph",
                 "enable_hisparse", "enable_hierarchical_cache", "disaggregation_mode", "speculative_eagle_topk",
                 "max_running_requests", "speculative_algorithm", "speculative_num_draft_tokens",
                 "kv_cache_dtype", "served_model_name")) + ("dsa: .dsa_prefill_backend", "dsa: .dsa_decode_backend")),
    Internal("sglang.srt.arg_groups.overrides.declare_resolution",
             "runs SGLang's speculative resolution on a copy of the record (its declarations, its page-size "
             "pass, its draft-token bound), appending to the copy's own _resolved_overrides stash",
             "SGLang fixes the draft tokens after the DSA pass the plugin plans in; the decode bound needs them",
             "SGLang resolving speculative settings before model-specific adjustments", _R,
             ("sglang.srt.arg_groups.overrides",
              "sglang.srt.arg_groups.overrides.run_post_process_pass",
              "sglang.srt.arg_groups.overrides._page_size_default",
              "sglang.srt.arg_groups.overrides.max_speculative_num_draft_tokens",
              "translate: ._resolved_overrides")),
    Internal("sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias",
             "calls it and the adaptive-speculation steps on the copy", "as declare_resolution", "as declare_resolution",
             _R,
             ("sglang.srt.arg_groups.speculative_hook",
              "sglang.srt.arg_groups.speculative_hook._maybe_disable_adaptive",
              "sglang.srt.arg_groups.speculative_hook._init_adaptive_speculative_params")),
    Internal("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.handle_server_args",
             "runs the algorithm family's own handler on the copy; silences its loggers (and "
             "adaptive_spec_params') meanwhile", "as declare_resolution", "as declare_resolution", _R,
             ("sglang.srt.speculative.spec_info",
              "sglang.srt.speculative.spec_info.SpeculativeAlgorithm",
              "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string",
              "sglang.srt.speculative.adaptive_spec_params")),
    Internal("sglang.srt.environ.envs.SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR",
             "reads whether it (or the decode one) is set, by its variable's name",
             "skip-softmax changes the result; the plan refuses it (the plugin's kernels compute full softmax)",
             "nothing while SGLang offers skip-softmax", _R,
             ("sglang.srt.environ.envs.SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR",)),
)
