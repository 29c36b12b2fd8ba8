"""The hooks on SGLang 0.5.23 that serve DSA models with the plugin's kernels, and what they read.

Registered only when the plugin is enabled (:func:`mla_sm120_plugin.integration.sglang.enabled`):

- ``_dsa_split_backend_resolution`` (AROUND, launcher, before any weight loads): builds one
  :class:`~mla_sm120_plugin.types.SelectionContext` from SGLang's resolved arguments through the
  shared context builder, decides (a refusal stops start-up with given / supported / fix), exports
  the context for the schedulers and routes both DSA phases to SGLang's ``flashinfer_sparse_mla``
  call site, which the next hooks serve.
- ``_validate_flashinfer_sparse_mla_backend`` (AROUND, each scheduler, in the DSA backend's
  constructor): replaces SGLang's GLM-only check with the launcher's decision, binds the kernels,
  self-checks them and logs one line per process. Right after it returns, the constructor takes
  its FlashInfer workspace from SGLang's named buffers (``get_buffer``, :data:`WORKSPACE_BUFFER`,
  ``SGLANG_FLASHINFER_WORKSPACE_SIZE``: 384 MiB a GPU); no kernel of the plugin reads it (the
  FlashInfer binding keeps its own wrapper's scratch), so the hook claims that name first with an
  empty buffer.
- ``flashinfer_sparse_mla_forward`` (AROUND): runs the bound kernel of the current phase on
  SGLang's cache (``[slots, 1, 656]`` fp8 bytes or ``[slots, 1, 576]`` bf16, viewed as the 64-row
  pages every kernel binding takes) with SGLang's top-k slots, and its per-row lengths when they
  match q's rows (SGLang's own rule: it drops them otherwise).
- ``DeepseekSparseAttnBackend.forward_decode`` / ``forward_extend`` (AROUND): say which phase a
  call belongs to (target-verify and draft-extend count as decode, as SGLang counts them).
- ``apply_deepseek_v4_defaults`` (AROUND, launcher, before any weight loads): for DeepSeek-V4
  (V4.1 runs under V4's architecture there), once SGLang resolved its settings, plans every
  (layer kind, phase) (:mod:`mla_sm120_plugin.plan`), refuses at launch what cannot be
  served and exports each kind's context for the schedulers.
- ``DeepseekV4AttnBackend.__init__`` (AROUND, each scheduler): binds each kind's kernels from the
  launcher's plan and self-checks them (:func:`dsv4_bound_state`).
- ``flash_mla_with_kvcache_sm120`` (AROUND, every DeepSeek-V4 attention call on SM12x): the call's
  layer kind is its compressed cache's page (none: the window), its phase SGLang's own split (more
  than 64 tokens: the prefill form); where the plan gives FlashInfer's kernels SGLang's own call
  runs, where it gives the plugin's Triton kernel that kernel runs on the same arguments.
- ``DeepseekSparseAttnBackend._check_kpool_tail_backend`` (AROUND, each forward): SGLang allows only
  fa3/tilelang/trtllm for a pooled indexer (GLM-5.3-Flash), none of which runs on SM12x with an fp8
  cache; the routed call site gets the expanded token slots, which every kernel here reads.

No servability rule lives here: the adapter translates, the matrix decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import logging
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from ...context import EngineLimits, build_context, context_from_json, context_to_json, plugin_config
from ...device import from_capability
from ...errors import KernelInputError, PluginError, UnsupportedConfiguration, format_error
from ...hooks.manager import get_registry
from ...kernels.dsa.layout import get as get_layout
from ...modelinfo import facts_from_hf_config
from ...report import decision_line, log_line
from ...selection import DECODE_TOKENS_MAX, select
from ...types import DECODE, PREFILL, Decision, SelectionContext
from . import BUILT_FOR, ENABLE_ENV, FLAG, INLINE_CONFIG_ENV, enabled

logger = logging.getLogger("mla_sm120_plugin")

CONTEXT_ENV = "MLA_SM120_SGLANG_CONTEXT"  # the launcher's decision context, for the schedulers
# SGLang's name for the call site the plugin serves: both DSA phases are routed to it.
ROUTE = "flashinfer_sparse_mla"

RESOLUTION = "sglang.srt.arg_groups.overrides._dsa_split_backend_resolution"
VALIDATOR = "sglang.kernels.ops.attention.flash_mla_sm120._validate_flashinfer_sparse_mla_backend"
CALL = "sglang.kernels.ops.attention.flash_mla_sm120.flashinfer_sparse_mla_forward"
DECODE_ENTRY = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode"
# Per forward, SGLang refuses every impl but fa3/tilelang/trtllm for a pooled indexer (GLM-5.3-Flash);
# the plugin's kernels read the token slots SGLang expands the pools to.
KPOOL_TAIL_CHECK = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._check_kpool_tail_backend"
# SGLang's named persistent buffer for the DSA call site's FlashInfer workspace, and where it lives.
WORKSPACE_BUFFER = "dsa_flashinfer_sparse_mla_workspace"
BUFFERS = "sglang.srt.runtime_context.get_buffer"
EXTEND_ENTRY = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend"
# DeepSeek-V4: SGLang's launcher applies its DeepSeek-V4 defaults here (imported at call time).
DSV4_DEFAULTS = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"
DSV4_BACKEND_INIT = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend.__init__"
# Every DeepSeek-V4 attention call on SM12x (its backend imports it from the module at call time).
DSV4_CALL = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
DSV4_PLAN_ENV = "MLA_SM120_SGLANG_DSV4_PLAN"  # the launcher's per-kind contexts, for the schedulers

_phase: contextvars.ContextVar[str | None] = contextvars.ContextVar("mla_sm120_phase", default=None)
_registered: dict[str, bool] = {}
_bound: dict[str, Any] = {}  # "state": this process's BoundState


# ------------------------------------------------------------------------------- context


def _engine_features(view: Any, hf_config: Any) -> frozenset[str]:
    """SGLang settings that change how the cache is written or top-k ids are read."""
    features = set()
    if getattr(view, "enable_hisparse", False):
        features.add("hisparse")
    if (getattr(view, "dcp_size", 1) or 1) > 1:
        features.add("dcp")
    if any(os.environ.get(f"SGLANG_SKIP_SOFTMAX_{phase}_THRESHOLD_SCALE_FACTOR") for phase in ("PREFILL", "DECODE")):
        features.add("skip_softmax")
    return frozenset(features)


# Speculative algorithms whose draft-token count SGLang's own per-family handler resolves
# (``SpeculativeAlgorithm.handle_server_args`` -> ``_handle_eagle_family`` / ``_handle_ngram``), after
# its upper-casing and NEXTN -> EAGLE alias. Any other algorithm (DFLASH, DSPARK, UNO, FROZEN_KV_MTP,
# a plugin-registered one) gets no bound: token-bounded kernels then refuse with the reason.
_RESOLVED_FAMILIES = frozenset({"EAGLE", "EAGLE3", "STANDALONE", "NGRAM"})
# Loggers SGLang's speculative resolution writes to; silenced while it runs on the plugin's copy, so
# its warnings ("Max running requests is reset to 48", ...) are logged once, by SGLang's own pass.
_RESOLUTION_LOGGERS = ("sglang.srt.arg_groups.speculative_hook", "sglang.srt.arg_groups.overrides",
                       "sglang.srt.arg_groups.model_override_base", "sglang.srt.speculative.spec_info",
                       "sglang.srt.speculative.adaptive_spec_params")


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


def _speculative_decode_bound(view: Any) -> tuple[int, int] | None:
    """(max running requests, draft tokens a request) as SGLang's speculative pass will resolve them.

    The plugin decides in the DSA backend pass (``_dsa_split_backend_resolution``, run by
    ``handle_model_specific_adjustments``), but SGLang resolves its draft tokens later in the same
    pipeline (``handle_speculative_decoding``: auto-chosen steps / top-k / draft tokens, draft tokens
    raised to steps + 1 at top-k 1, 48 running requests by default). So the plugin runs SGLang's own
    resolution for the algorithm's family on a copy of the record and reads the result; the user's
    record, its declarations, the environment and SGLang's log are left as they were.

    :returns: None where that cannot be done (not SGLang's record, an algorithm outside
        :data:`_RESOLVED_FAMILIES`, a resolver that raises or writes the environment, no draft-token
        count at the end): the caller then assumes no bound.
    """
    try:
        from sglang.srt.arg_groups import overrides, speculative_hook
        from sglang.srt.arg_groups.model_override_base import ResolvedView, ResolvingConfig, record_of
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        if not isinstance(view, (ResolvedView, ResolvingConfig)):
            return None
        record = record_of(view)
        overlay = dict(object.__getattribute__(view, "_overlay")) if isinstance(view, ResolvedView) else {}
        # A shallow copy (ServerArgs.__reduce__: fields plus bookkeeping) that shares the memoized
        # ModelConfig, with a stash of its own: SGLang's handlers only append declarations to it.
        clone = copy.copy(record)
        clone._resolved_overrides = [(source, dict(fields))
                                     for source, fields in getattr(record, "_resolved_overrides", None) or ()]
        if overlay:
            clone._resolved_overrides.append(("mla_sm120_plugin.view", overlay))
        env = dict(os.environ)
        with _quiet(_RESOLUTION_LOGGERS):
            cfg = overrides.resolving_view(clone)
            if cfg.speculative_draft_model_path is not None and cfg.speculative_draft_model_revision is None:
                overrides.declare_resolution(clone, "handle_speculative_decoding", speculative_draft_model_revision="main")
            kwargs = {}
            if (cfg.decrypted_draft_config_file or "").strip():
                kwargs["_configuration_file"] = cfg.decrypted_draft_config_file.strip()
            algorithm = speculative_hook._resolve_speculative_algorithm_alias(
                cfg.speculative_algorithm.upper(), cfg.speculative_draft_model_path,
                trust_remote_code=cfg.trust_remote_code, kwargs=kwargs)
            if algorithm not in _RESOLVED_FAMILIES:
                return None
            overrides.declare_resolution(clone, "handle_speculative_decoding", speculative_algorithm=algorithm)
            if cfg.speculative_adaptive:
                speculative_hook._maybe_disable_adaptive(clone)
                if cfg.speculative_adaptive:
                    speculative_hook._init_adaptive_speculative_params(clone)
            # SGLang's page-size default runs between the two passes; the family handler validates against it.
            overrides.run_post_process_pass(clone, overrides._page_size_default)
            SpeculativeAlgorithm.from_string(algorithm).handle_server_args(clone)
            running = cfg.max_running_requests
            # SGLang's own "largest draft-token width this algorithm may use" (adaptive: its top step + 1).
            per_request = overrides.max_speculative_num_draft_tokens(clone)
        if dict(os.environ) != env:  # a resolver that writes the environment: undo it, assume nothing
            os.environ.clear()
            os.environ.update(env)
            return None
    except Exception as exc:  # SGLang reports its own errors in its own pass; never crash here
        logger.debug("SGLang's speculative resolution did not run on a copy (%s): no decode bound", exc)
        return None
    if not running or not per_request:
        return None
    return int(running), int(per_request)


def engine_limits(view: Any, hf_config: Any) -> EngineLimits:
    """SGLang's parallelism, batching and cache settings, as the selection needs them."""
    tp = int(getattr(view, "tp_size", 1) or 1)
    # Attention heads split over the attention-TP group: TP divided by attention DP and CP.
    attn_tp = max(1, tp // max(1, int(getattr(view, "attn_dp_size", 1) or 1))
                  // max(1, int(getattr(view, "attn_cp_size", 1) or 1)))
    chunk = getattr(view, "chunked_prefill_size", None)
    if getattr(view, "speculative_algorithm", None):
        # Resolved on a copy: SGLang fixes its draft tokens only after this pass (see
        # _speculative_decode_bound); unknown to the plugin or not resolvable: unbounded.
        resolved = _speculative_decode_bound(view)
        max_decode = resolved[0] * resolved[1] if resolved else None
    else:
        running = getattr(view, "max_running_requests", None)
        per_request = int(getattr(view, "speculative_num_draft_tokens", None) or 1)
        # Unknown until SGLang sizes its pools: unbounded then (the stricter assumption).
        max_decode = int(running) * per_request if running else None
    return EngineLimits(
        tensor_parallel_size=attn_tp,
        max_decode_tokens=max_decode,
        max_prefill_tokens=int(chunk) if chunk and chunk > 0 else None,
        cuda_graphs=not getattr(view, "disable_cuda_graph", False),
        features=_engine_features(view, hf_config),
        engine="sglang",  # its kv dtype spellings and its cache writer's scale format
    )


def context_from_sglang(view: Any, hf_config: Any, capability: tuple[int, int]) -> SelectionContext:
    """The selection context for SGLang's resolved arguments on a GPU of ``capability``.

    ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` are read as forced kernels: the plugin's
    kernel names are SGLang's (``flashinfer_sparse_mla``, ``triton_sparse_mla``); another engine
    impl (``flashmla_kv``) gets the "cannot run here, these can" refusal.
    """
    reg = get_registry()
    facts = facts_from_hf_config(hf_config, name=str(getattr(view, "served_model_name", None) or view.model_path),
                                 registry=reg)
    inline: dict[str, Any] = json.loads(os.environ.get(INLINE_CONFIG_ENV) or "{}")
    for key, field in (("prefill_kernel", "dsa_prefill_backend"), ("decode_kernel", "dsa_decode_backend")):
        if getattr(view, field, None):
            inline[key] = getattr(view, field)
    settings = plugin_config(inline or None, kernel_names=reg.kernels,
                             inline_label=f"{FLAG}-config / --dsa-*-backend").for_model(facts.name, facts.arch)
    device = from_capability(*capability, source="sglang")
    return build_context(facts, settings, device, getattr(view, "kv_cache_dtype", None), engine_limits(view, hf_config))


# ------------------------------------------------------------------------------- hooks


def around_resolution(original_fn: Callable[..., dict], view: Any, *args: Any, **kwargs: Any) -> dict:
    """AROUND ``_dsa_split_backend_resolution``: decide in the launcher, before any weight loads."""
    if not enabled():
        return original_fn(view, *args, **kwargs)
    _require_hooks()
    import torch
    from sglang.srt.arg_groups.overrides import model_config_of

    routed = getattr(view, "dsa_prefill_backend", None) == ROUTE == getattr(view, "dsa_decode_backend", None)
    if routed and os.environ.get(CONTEXT_ENV):
        # A re-run on the record already resolved (SGLang re-validates it on restart and in its
        # children): the decision is in the environment and the view shows our own routing.
        return {}
    hf_config = model_config_of(view).hf_config
    ctx = context_from_sglang(view, hf_config, tuple(torch.cuda.get_device_capability()))
    decision = select(ctx)  # UnsupportedConfiguration stops SGLang's start-up here
    os.environ[CONTEXT_ENV] = context_to_json(ctx)
    logger.warning("%s", decision_line(decision))
    return {"dsa_prefill_backend": ROUTE, "dsa_decode_backend": ROUTE}


def around_dsv4_defaults(original_fn: Callable[..., Any], server_args: Any, model_arch: Any, *args: Any,
                         **kwargs: Any) -> Any:
    """AROUND ``apply_deepseek_v4_defaults`` (the launcher, before any weight loads): once SGLang has
    resolved its DeepSeek-V4 settings (the dsv4 backend, 256-token pages, the KV dtype), plan every
    (layer kind, phase) and stop start-up with given / supported / fix where one cannot be served.
    Nothing is bound: SGLang calls ``flash_mla_with_kvcache_sm120`` itself."""
    result = original_fn(server_args, model_arch, *args, **kwargs)
    if not enabled():
        return result
    import torch
    from sglang.srt.arg_groups.overrides import ResolvedView, _declaration_overlay, model_config_of

    view = ResolvedView(server_args, overlay=_declaration_overlay(server_args))
    plan = dsv4_plan_from_sglang(view, model_config_of(view).hf_config, tuple(torch.cuda.get_device_capability()))
    os.environ[DSV4_PLAN_ENV] = json.dumps({kind: context_to_json(d.context) for kind, d in plan.decisions.items()})
    logger.warning("%s", log_line(plan))
    return result


def dsv4_plan_from_sglang(view: Any, hf_config: Any, capability: tuple[int, int]) -> Any:
    """The DeepSeek-V4 plan for SGLang's resolved arguments on a GPU of ``capability``.

    :raises UnsupportedConfiguration: a (layer kind, phase) cannot be served, or the TP size, the
        KV dtype or the device cannot.
    """
    from ...plan import plan

    reg = get_registry()
    facts = facts_from_hf_config(hf_config, name=str(getattr(view, "served_model_name", None) or view.model_path),
                                 registry=reg)
    inline: dict[str, Any] = json.loads(os.environ.get(INLINE_CONFIG_ENV) or "{}")
    settings = plugin_config(inline or None, kernel_names=reg.kernels,
                             inline_label=f"{FLAG}-config").for_model(facts.name, facts.arch)
    algorithm = str(getattr(view, "speculative_algorithm", None) or "").upper()
    drafts = int(getattr(view, "speculative_num_draft_tokens", None) or 0) if algorithm else 0
    return plan(facts, settings, from_capability(*capability, source="sglang"), getattr(view, "kv_cache_dtype", None),
                engine_limits(view, hf_config), speculative_tokens=drafts, dspark=algorithm == "DSPARK",
                registry=reg)


def around_validator(original_fn: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
    """AROUND SGLang's SM120 validator: the launcher's decision replaces its GLM-only rule."""
    if not enabled():
        return original_fn(*args, **kwargs)
    bound_state()
    _claim_workspace()
    return True  # SGLang routes both phases to the call site the plugin serves


def _claim_workspace() -> None:
    """Give SGLang's FlashInfer workspace name an empty buffer before its constructor allocates one."""
    import torch

    from ...dispatch.selfcheck import engine_device

    get_buffer = pkgutil.resolve_name(BUFFERS)
    get_buffer(WORKSPACE_BUFFER, lambda: torch.empty(0, dtype=torch.uint8, device=engine_device()))


def around_call(original_fn: Callable[..., Any], q: Any, kv_cache: Any, indices: Any, seq_lens: Any,
                workspace_buffer: Any = None, **kwargs: Any) -> Any:
    """AROUND ``flashinfer_sparse_mla_forward``: the bound kernel of the current phase.

    q: [T, H, 576] bfloat16 ([T, H, 512] for a rope-less model); kv_cache: [slots, 1, 656]
    float8_e4m3fn bytes or [slots, 1, 576] bfloat16 (rope-less: [slots, 1, 528] bytes or
    [slots, 1, 512] bfloat16); indices: [T, topk] int32 global slots, -1 padded (2051 wide for
    GLM-5.3-Flash); seq_lens: [T] int32 valid top-k entries a row, or rows of another count (then
    unused). Returns [T, H, 512] bfloat16.
    """
    if not enabled():
        return original_fn(q, kv_cache, indices, seq_lens, workspace_buffer, **kwargs)
    if kwargs.get("skip_softmax_threshold_scale_factor") is not None:
        raise KernelInputError(format_error(
            f"skip_softmax_threshold_scale_factor={kwargs['skip_softmax_threshold_scale_factor']!r}",
            "None: the plugin's kernels compute full softmax",
            "unset SGLANG_SKIP_SOFTMAX_PREFILL/DECODE_THRESHOLD_SCALE_FACTOR"))
    state = bound_state()
    phase = _phase.get() or (DECODE if q.shape[0] <= DECODE_TOKENS_MAX else PREFILL)
    # SGLang's metadata rows should match q's; where they do not (DP/CP padding), SGLang runs its
    # kernels without lengths (full width: -1 padding is masked anyway), and so do we.
    lengths = seq_lens if seq_lens is not None and seq_lens.shape[0] == q.shape[0] else None
    return state.kernels[phase].call(q, state.pages(kv_cache), indices, sm_scale=float(kwargs["sm_scale"]),
                                     kv_layout=state.kv_layout, topk_length=lengths,
                                     scale_format=state.scale_format)


def around_kpool_tail_check(original_fn: Callable[..., Any], backend: Any, topk_indices: Any, dsa_impl: str,
                            *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_check_kpool_tail_backend``: the call site the plugin serves reads expanded token slots."""
    if enabled() and dsa_impl == ROUTE:
        return None
    return original_fn(backend, topk_indices, dsa_impl, *args, **kwargs)


def _in_phase(phase: str, original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    token = _phase.set(phase)
    try:
        return original_fn(*args, **kwargs)
    finally:
        _phase.reset(token)


def around_forward_decode(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``DeepseekSparseAttnBackend.forward_decode``: calls inside are decode."""
    return _in_phase(DECODE, original_fn, *args, **kwargs)


def around_forward_extend(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``forward_extend``: prefill, except target-verify and draft-extend (decode, as in SGLang)."""
    batch = kwargs.get("forward_batch", args[5] if len(args) > 5 else None)
    mode = getattr(batch, "forward_mode", None)
    as_decode = mode is not None and (mode.is_target_verify() or mode.is_draft_extend_v2())
    return _in_phase(DECODE if as_decode else PREFILL, original_fn, *args, **kwargs)


def around_dsv4_backend_init(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``DeepseekV4AttnBackend.__init__``: bind and self-check the plan's kernels in this scheduler."""
    result = original_fn(*args, **kwargs)
    if enabled():
        dsv4_bound_state()
    return result


def around_dsv4_call(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``flash_mla_with_kvcache_sm120`` (keywords only): the plan's kernel for this call.

    q: [T, 1, H, 512] bfloat16 (H: SGLang's heads for the call, padded or not); k_cache:
    [pages, 256, 1, 584] float8_e4m3fn window pages (stride(0): the padded page bytes); indices:
    [T, 1, W] int32 global slots, -1 padded; topk_length: [T] int32; attn_sink: [H] float32;
    extra_k_cache: [pages, 256 / ratio, 1, 584] or None, with extra_indices_in_kvcache [T, 1, K] and
    extra_topk_length [T]. Returns (out [T, 1, H, 512] bfloat16, None), as SGLang's FlashInfer path.
    """
    if not enabled() or args:
        return original_fn(*args, **kwargs)
    state = dsv4_bound_state()
    q, extra = kwargs["q"], kwargs.get("extra_k_cache")
    page = 0 if extra is None else int(extra.shape[1])
    routes = state.routes.get(page)
    if routes is None:
        raise KernelInputError(format_error(
            f"a DeepSeek-V4 call with a compressed cache of {page} entries a page", "the launcher's plan: "
            + ", ".join(f"{kind} ({p or 'no compressed cache'})" for p, (kind, _) in state.routes.items()),
            "restart SGLang so that its launcher plans this model again"))
    kind, fns = routes
    fn = fns[PREFILL if q.shape[0] > state.decode_max_tokens else DECODE]
    if fn is None:
        return original_fn(**kwargs)
    if kwargs.get("head_dim_v", q.shape[-1]) != q.shape[-1]:
        raise KernelInputError(format_error(f"head_dim_v={kwargs['head_dim_v']} for q of width {q.shape[-1]}",
                                            "V = K: the whole 512-wide row", "pass head_dim_v=512"))
    scale = kwargs.get("softmax_scale")
    out = fn(query=q[:, 0], swa_kv_cache=kwargs["k_cache"], sparse_indices=kwargs["indices"],
             swa_topk_lens=kwargs.get("topk_length"), sinks=kwargs.get("attn_sink"),
             bmm1_scale=q.shape[-1] ** -0.5 if scale is None else scale, kv_layout="NHD", compressed_kv_cache=extra,
             extra_sparse_indices=kwargs.get("extra_indices_in_kvcache"),
             extra_sparse_topk_lens=kwargs.get("extra_topk_length"))
    return out.unsqueeze(1), None


HOOKS: dict[str, Callable[..., Any]] = {  # SGLang internal -> the hook on it (BUFFERS is read, not hooked)
    RESOLUTION: around_resolution,
    VALIDATOR: around_validator,
    CALL: around_call,
    DECODE_ENTRY: around_forward_decode,
    EXTEND_ENTRY: around_forward_extend,
    KPOOL_TAIL_CHECK: around_kpool_tail_check,
    DSV4_DEFAULTS: around_dsv4_defaults,
    DSV4_BACKEND_INIT: around_dsv4_backend_init,
    DSV4_CALL: around_dsv4_call,
}


def register_engine_hooks(*, apply_now: bool = False) -> list[str]:
    """Register the hooks above with SGLang's registry (once a process).

    :param apply_now: apply them at once (the flag is parsed after ``load_plugins()`` applied
        what was registered then) and check each one took.
    :returns: the targets that are not hooked (empty when ``apply_now`` is False).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not _registered:
        for target, hook in HOOKS.items():
            HookRegistry.register(target, hook, HookType.AROUND)
        _registered["done"] = True
    if not apply_now:
        return []
    HookRegistry.apply_hooks()
    return missing_hooks()


def _hooked(target: str, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is somewhere in the wrapper chain SGLang installed at ``target``."""
    try:
        fn = pkgutil.resolve_name(target)
    except Exception:
        return False
    seen = 0
    while fn is not None and seen < 32:  # SGLang's wrappers keep the inner function as __wrapped__
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(cell, "cell_contents", None) is hook for cell in cells):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def missing_hooks() -> list[str]:
    """Targets where the plugin's hook is not installed (SGLang logs and swallows hook failures)."""
    return [target for target, hook in HOOKS.items() if not _hooked(target, hook)]


def missing_hooks_message(missing: list[str]) -> str:
    from importlib.metadata import version

    return format_error(
        f"{FLAG} is on but SGLang did not apply the plugin's hooks on {', '.join(missing)} (sglang {version('sglang')})",
        f"sglang {BUILT_FOR}, the release the hooks were written for",
        f"install sglang=={BUILT_FOR} (pip install 'mla-sm120-plugin[sglang]'), or serve without {FLAG}",
    )


def _require_hooks() -> None:
    missing = missing_hooks()
    if missing:
        raise PluginError(missing_hooks_message(missing))


# ------------------------------------------------------------------------ bound kernels


def _from_launcher(env: str, what: str, where: str) -> str:
    """What the launcher exported in ``env`` for this scheduler (the hooks must be in place too).

    :raises UnsupportedConfiguration: it did not reach this process.
    """
    _require_hooks()
    text = os.environ.get(env)
    if not text:
        raise UnsupportedConfiguration(format_error(
            f"{ENABLE_ENV} is on in this process but the launcher's {what} ({env}) did not reach it",
            f"SGLang's launcher {where} with the plugin enabled",
            f"start SGLang with {FLAG} (or {ENABLE_ENV}=1 set before the launcher starts)"))
    return text


@dataclass(frozen=True)
class BoundState:
    """This process's decision, its bound kernels (after the self-check) and how to view the cache."""

    decision: Decision
    kernels: dict[str, Any]
    kv_layout: str
    scale_format: str

    def pages(self, kv_cache: Any) -> Any:
        """SGLang's ``[slots, 1, C]`` pool buffer as ``[slots / 64, 64, C]`` pages (slot ids unchanged).

        ``C`` is the layout's row: 656 fp8 bytes (DSA), 528 (SGLang's packed rope-less rows), or 576 /
        512 bf16. SGLang's DSA pool holds whole pages (it views the buffer as ``[-1, page_size, C]``
        itself, with a physical page size of 64, 64 x index_kpool logical); a buffer that is not whole
        64-row pages is refused with the sizes.
        """
        import torch

        from ...kernels.dsa.pack import page_view

        cache = get_layout(self.kv_layout)
        rows = kv_cache.view(torch.uint8) if cache.fp8 else kv_cache
        return page_view(rows.reshape(-1, cache.row))


def bound_state() -> BoundState:
    """Decide from the launcher's context, bind, self-check and log, once per process.

    :raises UnsupportedConfiguration: no context reached this process, the decision refuses here,
        or every kernel for a phase failed its self-check.
    """
    if "state" in _bound:
        return _bound["state"]
    text = _from_launcher(CONTEXT_ENV, "decision", "resolving the DSA backends")
    from ...dispatch import selfcheck
    from ...dispatch.binding import bind

    ctx = context_from_json(text)
    decision = select(ctx)
    names, line = selfcheck.verify_at_init(decision)
    kernels = {phase: bind(names[phase]) for phase in (DECODE, PREFILL)}
    logger.info("%s", decision_line(decision))
    logger.info("%s", line)
    _bound["state"] = BoundState(decision, kernels, ctx.kv_cache_dtype, decision.scale_format)
    return _bound["state"]


@dataclass(frozen=True)
class Dsv4BoundState:
    """This scheduler's DeepSeek-V4 routes: compressed page (0: window-only) -> (layer kind, phase ->
    the plugin kernel to run, None for SGLang's own FlashInfer call); and SGLang's decode bound."""

    plan: dict[str, Decision]
    routes: dict[int, tuple[str, dict[str, Any]]]
    decode_max_tokens: int


def dsv4_bound_state() -> Dsv4BoundState:
    """Bind each layer kind's kernels from the launcher's plan and self-check them, once per process.

    :raises UnsupportedConfiguration: the plan did not reach this process, or a kind's kernels and
        their alternates all failed the self-check.
    """
    if "dsv4" in _bound:
        return _bound["dsv4"]
    text = _from_launcher(DSV4_PLAN_ENV, "DeepSeek-V4 plan", "applying its DeepSeek-V4 defaults")
    from ...dispatch import selfcheck
    from ...dispatch.binding import bind
    from ...dispatch.catalog import FLASHINFER_DSV4

    decisions = {kind: select(context_from_json(ctx)) for kind, ctx in json.loads(text).items()}
    direct = pkgutil.resolve_name("flashinfer.decode:trtllm_batch_decode_sparse_mla_dsv4") if any(
        FLASHINFER_DSV4 in d.kernels.values() for d in decisions.values()) else None
    routes: dict[int, tuple[str, dict[str, Any]]] = {}
    for kind, decision in decisions.items():
        call = decision.context.dsv4
        # the pages this call site passes (the plan's): SGLang's own, the split into 64 is its FlashInfer path's
        kernels, line = selfcheck.verify_at_init(decision, {FLASHINFER_DSV4: direct} if direct else {})
        logger.info("%s", line)
        routes[call.extra_page] = (kind, {phase: None if name == FLASHINFER_DSV4 else bind(name).fn
                                          for phase, name in kernels.items()})
    decode_max = int(pkgutil.resolve_name("sglang.kernels.ops.attention.flash_mla_sm120.SM120_DECODE_MAX_TOKENS"))
    _bound["dsv4"] = Dsv4BoundState(decisions, routes, decode_max)
    return _bound["dsv4"]


def reset_for_tests() -> None:
    """Forget this process's bound state (tests; SGLang binds once a process)."""
    _bound.clear()
