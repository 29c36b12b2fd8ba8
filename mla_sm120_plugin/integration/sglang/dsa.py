"""The DSA binding: SGLang 0.5.23's DSA backend resolution, validator and call site, served by the plan.

- ``_dsa_split_backend_resolution`` (AROUND, launcher, before any weight loads): plans from SGLang's
  resolved arguments (:func:`.translate.plan_from_sglang`; a refusal stops start-up with given /
  supported / fix), exports the plan and routes both DSA phases to ``flashinfer_sparse_mla``.
- ``_validate_flashinfer_sparse_mla_backend`` (AROUND, each scheduler, in the DSA backend's
  constructor): the launcher's decision replaces SGLang's GLM-only check; binds, self-checks and
  logs once a process (:mod:`.bound`), then claims SGLang's FlashInfer workspace name (:data:`WORKSPACE_BUFFER`,
  384 MiB a GPU, which no kernel of the plugin reads) with an empty buffer.
- ``flashinfer_sparse_mla_forward`` (AROUND): the bound kernel of the current phase on SGLang's
  cache, viewed as 64-row pages, with SGLang's top-k slots (and its lengths when they match q's rows).
- ``forward_decode`` / ``forward_extend`` (AROUND): the phase of the calls inside (target-verify and
  draft-extend count as decode, as SGLang counts them).
- ``_check_kpool_tail_backend`` (AROUND, each forward): lets the routed call site through for a
  pooled indexer (GLM-5.3-Flash): it gets the expanded token slots every kernel here reads.
"""

from __future__ import annotations

import contextvars
import logging
import pkgutil
from typing import Any, Callable

from ...errors import KernelInputError, format_error
from ...families.dsa import KIND
from ...kernels.dsa.layout import get as get_layout
from ...report import log_line
from ...selection import DECODE_TOKENS_MAX
from ...types import DECODE, PREFILL, SelectionContext
from . import bound, dcp, hooks, translate
from .bound import BoundState
from .dcp import Site
from .names import LOGGER, enabled

logger = logging.getLogger(LOGGER)

# SGLang's name for the call site the plugin serves: both DSA phases are routed to it.
ROUTE = "flashinfer_sparse_mla"

RESOLUTION = "sglang.srt.arg_groups.overrides._dsa_split_backend_resolution"
VALIDATOR = "sglang.kernels.ops.attention.flash_mla_sm120._validate_flashinfer_sparse_mla_backend"
CALL = "sglang.kernels.ops.attention.flash_mla_sm120.flashinfer_sparse_mla_forward"
DECODE_ENTRY = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode"
EXTEND_ENTRY = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend"
# Per forward, SGLang refuses every impl but fa3/tilelang/trtllm for a pooled indexer (GLM-5.3-Flash);
# the plugin's kernels read the token slots SGLang expands the pools to.
KPOOL_TAIL_CHECK = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._check_kpool_tail_backend"
# SGLang's named persistent buffer for the DSA call site's FlashInfer workspace, and where it lives.
WORKSPACE_BUFFER = "dsa_flashinfer_sparse_mla_workspace"
BUFFERS = "sglang.srt.runtime_context.get_buffer"

_phase: contextvars.ContextVar[str | None] = contextvars.ContextVar("mla_sm120_phase", default=None)
# The call's [heads] fp32 sink logits (a model with learned sinks), from forward_decode / forward_extend.
_sink: contextvars.ContextVar[Any] = contextvars.ContextVar("mla_sm120_sink", default=None)
# Where the call comes from (backend, layer, top-k ids): what a DCP rank's share needs (:mod:`.dcp`).
_site: contextvars.ContextVar[Site] = contextvars.ContextVar("mla_sm120_site", default=Site())
ROOM = "dsa"  # this room's bound state (:mod:`.bound`)


# ------------------------------------------------------------------------------- the launcher


def around_resolution(original_fn: Callable[..., dict], view: Any, *args: Any, **kwargs: Any) -> dict:
    """AROUND ``_dsa_split_backend_resolution``: decide in the launcher, before any weight loads."""
    if not enabled():
        return original_fn(view, *args, **kwargs)
    hooks.require(HOOKS)
    routed = getattr(view, "dsa_prefill_backend", None) == ROUTE == getattr(view, "dsa_decode_backend", None)
    if routed and translate.exported():
        # A re-run on the record already resolved (SGLang re-validates it on restart and in its
        # children): the plan is in the environment and the view shows our own routing.
        return {}
    planned = translate.plan_from_sglang(view, translate.model_config(view), translate.gpu_capability())
    translate.export(planned)  # UnsupportedConfiguration stopped SGLang's start-up above
    logger.warning("%s", log_line(planned))
    return {"dsa_prefill_backend": ROUTE, "dsa_decode_backend": ROUTE}


# ------------------------------------------------------------------------------- each scheduler


def bound_state() -> BoundState:
    """The launcher's DSA decision, decided, self-checked, bound and logged once a process.

    :raises UnsupportedConfiguration: the plan did not reach this process (or holds no DSA kind),
        the decision refuses here, or every kernel for a phase failed its self-check.
    """
    return bound.bound_state(ROOM, HOOKS, "decision", "resolving the DSA backends", kinds=(KIND,))


def pages(ctx: SelectionContext, kv_cache: Any) -> Any:
    """SGLang's ``[slots, 1, C]`` pool buffer as ``[slots / 64, 64, C]`` pages (slot ids unchanged).

    ``C`` is the row of the context's layout: 656 fp8 bytes (DSA), 528 (SGLang's packed rope-less
    rows), or 576 / 512 bf16. SGLang's DSA pool holds whole pages (it views the buffer as
    ``[-1, page_size, C]`` itself, with a physical page size of 64, 64 x index_kpool logical); a
    buffer that is not whole 64-row pages is refused with the sizes.
    """
    import torch

    from ...kernels.dsa.pack import page_view

    cache = get_layout(ctx.kv_cache_dtype)
    rows = kv_cache.view(torch.uint8) if cache.fp8 else kv_cache
    return page_view(rows.reshape(-1, cache.row))


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
    unused). Returns [T, H, 512] bfloat16; under ``--dcp-size`` N (H: the DCP group's heads) this rank's
    share and its LSE, as SGLang's merge takes them (:func:`.dcp.rank_share`).
    """
    if not enabled():
        return original_fn(q, kv_cache, indices, seq_lens, workspace_buffer, **kwargs)
    if kwargs.get("skip_softmax_threshold_scale_factor") is not None:
        raise KernelInputError(format_error(
            f"skip_softmax_threshold_scale_factor={kwargs['skip_softmax_threshold_scale_factor']!r}",
            "None: the plugin's kernels compute full softmax",
            "unset SGLANG_SKIP_SOFTMAX_PREFILL/DECODE_THRESHOLD_SCALE_FACTOR"))
    bound_kind = bound_state().kinds[KIND]
    ctx = bound_kind.decision.context
    phase = _phase.get() or (DECODE if q.shape[0] <= DECODE_TOKENS_MAX else PREFILL)
    # SGLang's metadata rows should match q's; where they do not (DP/CP padding), SGLang runs its
    # kernels without lengths (full width: -1 padding is masked anyway), and so do we.
    lengths = seq_lens if seq_lens is not None and seq_lens.shape[0] == q.shape[0] else None
    sink = _sink.get()
    if (sink is not None) != ctx.sinks:
        raise KernelInputError(format_error(
            f"a call {'with' if sink is not None else 'without'} attention sinks for a model planned "
            f"{'with' if ctx.sinks else 'without'} them",
            "the sinks the launcher's plan read from the model's config (learnable_sink)",
            "restart SGLang so that its launcher plans this model again"))
    site = _site.get()
    if site.size != ctx.decode_context_parallel_size:
        raise KernelInputError(format_error(
            f"a call at dcp_size={site.size} (SGLang's DSA backend) for a plan at --dcp-size "
            f"{ctx.decode_context_parallel_size}", "the DCP size the launcher planned for",
            "restart SGLang so that its launcher plans this --dcp-size"))
    kernel, cache = bound_kind.kernels[phase], pages(ctx, kv_cache)

    def call(q_: Any, slots: Any, topk_length: Any, **extra: Any) -> Any:
        return kernel.call(q_, cache, slots, sm_scale=float(kwargs["sm_scale"]), kv_layout=ctx.kv_cache_dtype,
                           topk_length=topk_length, scale_format=bound_kind.decision.scale_format, **extra)

    if site.size > 1:
        return dcp.rank_share(call, site, q, indices, sink)
    return call(q, indices, lengths, **({} if sink is None else {"sink": sink}))


def around_kpool_tail_check(original_fn: Callable[..., Any], backend: Any, topk_indices: Any, dsa_impl: str,
                            *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_check_kpool_tail_backend``: the call site the plugin serves reads expanded token slots."""
    if enabled() and dsa_impl == ROUTE:
        return None
    return original_fn(backend, topk_indices, dsa_impl, *args, **kwargs)


def _in_phase(phase: str, original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not enabled():
        return original_fn(*args, **kwargs)
    # A model with learned sinks (HY V4) hands its [heads] fp32 sink parameter here; SGLang's
    # backend would refuse it for any kernel but flashmla_sparse (SM90a / SM100f), so the plugin
    # carries it to its own kernel call instead (around_call).
    token, sink_token = _phase.set(phase), _sink.set(kwargs.pop("attn_sink", None))
    # forward_* (self, q, k, v, layer, forward_batch, ...): SGLang's backend, the layer, the top-k ids.
    site_token = _site.set(Site(args[0] if args else None, args[4] if len(args) > 4 else kwargs.get("layer"),
                                kwargs.get("topk_indices")))
    try:
        return original_fn(*args, **kwargs)
    finally:
        _phase.reset(token)
        _sink.reset(sink_token)
        _site.reset(site_token)


def around_forward_decode(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``DeepseekSparseAttnBackend.forward_decode``: calls inside are decode."""
    return _in_phase(DECODE, original_fn, *args, **kwargs)


def around_forward_extend(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``forward_extend``: prefill, except target-verify and draft-extend (decode, as in SGLang)."""
    batch = kwargs.get("forward_batch", args[5] if len(args) > 5 else None)
    mode = getattr(batch, "forward_mode", None)
    as_decode = mode is not None and (mode.is_target_verify() or mode.is_draft_extend_v2())
    return _in_phase(DECODE if as_decode else PREFILL, original_fn, *args, **kwargs)


def reset_for_tests() -> None:
    """Forget this process's bound state (tests; SGLang binds once a process)."""
    bound.forget(ROOM)


HOOKS: dict[str, Callable[..., Any]] = {  # SGLang internal -> the hook AROUND it (BUFFERS is resolved)
    RESOLUTION: around_resolution,
    VALIDATOR: around_validator,
    CALL: around_call,
    DECODE_ENTRY: around_forward_decode,
    EXTEND_ENTRY: around_forward_extend,
    KPOOL_TAIL_CHECK: around_kpool_tail_check,
}
