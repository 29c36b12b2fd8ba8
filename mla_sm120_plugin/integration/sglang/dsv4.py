"""The DeepSeek-V4 binding: SGLang 0.5.23's DeepSeek-V4 defaults, backend and SM12x call, served by the plan.

- ``apply_deepseek_v4_defaults`` (AROUND, launcher, before any weight loads; V4.1 runs under V4's
  architecture there): once SGLang resolved its DeepSeek-V4 settings, plans every (layer kind,
  phase) (:func:`.translate.plan_from_sglang`), refuses at launch what cannot be served and exports
  the plan for the schedulers.
- ``DeepseekV4AttnBackend.__init__`` (AROUND, each scheduler): binds each kind's kernels from the
  launcher's plan and self-checks them (:func:`bound_state`), and sets aside the split partials'
  scratch on the backend's device (:func:`scratch_for`), before SGLang captures its graphs.
- ``flash_mla_with_kvcache_sm120`` (AROUND, every DeepSeek-V4 attention call on SM12x): the call's
  layer kind is its compressed cache's page (none: the window), its phase SGLang's own split (more
  than ``SM120_DECODE_MAX_TOKENS`` tokens: the prefill form); where the plan gives FlashInfer's
  kernel SGLang's own call runs, where it gives the plugin's Triton kernel that kernel runs on the
  same arguments.
"""

from __future__ import annotations

import logging
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import KernelInputError, format_error
from ...report import log_line
from ...selection import select
from ...types import DECODE, PREFILL, Decision
from . import hooks, translate
from .names import LOGGER, enabled

logger = logging.getLogger(LOGGER)

DEFAULTS = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"
BACKEND_INIT = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend.__init__"
# Every DeepSeek-V4 attention call on SM12x (its backend imports it from the module at call time).
CALL = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
# SGLang's own decode / prefill split of that call (read, not hooked).
DECODE_MAX = "sglang.kernels.ops.attention.flash_mla_sm120.SM120_DECODE_MAX_TOKENS"
# FlashInfer's DeepSeek-V4 kernel, which SGLang's call runs (the self-check runs it as bound there).
FLASHINFER_CALL = "flashinfer.decode:trtllm_batch_decode_sparse_mla_dsv4"

_bound: dict[str, Any] = {}  # "state": this process's BoundState
_scratch: dict[Any, Any] = {}  # device -> the split partials' persistent bytes (torch.Tensor)


def around_defaults(original_fn: Callable[..., Any], server_args: Any, model_arch: Any, *args: Any,
                    **kwargs: Any) -> Any:
    """AROUND ``apply_deepseek_v4_defaults`` (the launcher, before any weight loads): once SGLang has
    resolved its DeepSeek-V4 settings (the dsv4 backend, 256-token pages, the KV dtype), plan every
    (layer kind, phase), stop start-up with given / supported / fix where one cannot be served, and
    export the plan; each scheduler binds and self-checks it (:func:`around_backend_init`) and every
    call is routed by it (:func:`around_call`)."""
    result = original_fn(server_args, model_arch, *args, **kwargs)
    if not enabled():
        return result
    view = translate.resolved_view(server_args)
    planned = translate.plan_from_sglang(view, translate.model_config(view), translate.gpu_capability())
    translate.export(planned)
    logger.warning("%s", log_line(planned))
    return result


@dataclass(frozen=True)
class BoundState:
    """This scheduler's DeepSeek-V4 routes: compressed page (0: window-only) -> (layer kind, phase ->
    the plugin kernel to run, None for SGLang's own FlashInfer call); and SGLang's decode bound."""

    plan: dict[str, Decision]
    routes: dict[int, tuple[str, dict[str, Any]]]
    decode_max_tokens: int


def bound_state() -> BoundState:
    """Bind each layer kind's kernels from the launcher's plan and self-check them, once per process.

    :raises UnsupportedConfiguration: the plan did not reach this process, or a kind's kernels and
        their alternates all failed the self-check.
    """
    if "state" in _bound:
        return _bound["state"]
    hooks.require(HOOKS)
    contexts = translate.imported("DeepSeek-V4 plan", "applying its DeepSeek-V4 defaults")
    from ...dispatch import selfcheck
    from ...dispatch.binding import bind
    from ...dispatch.catalog import FLASHINFER_DSV4

    decisions = {kind: select(ctx) for kind, ctx in contexts.items()}
    direct = pkgutil.resolve_name(FLASHINFER_CALL) if any(
        FLASHINFER_DSV4 in d.kernels.values() for d in decisions.values()) else None
    routes: dict[int, tuple[str, dict[str, Any]]] = {}
    for kind, decision in decisions.items():
        call = decision.context.dsv4
        # the pages this call site passes (the plan's): SGLang's own, the split into 64 is its FlashInfer path's
        kernels, line = selfcheck.verify_at_init(decision, {FLASHINFER_DSV4: direct} if direct else {})
        logger.info("%s", line)
        routes[call.extra_page] = (kind, {phase: None if name == FLASHINFER_DSV4 else bind(name).fn
                                          for phase, name in kernels.items()})
    _bound["state"] = BoundState(decisions, routes, int(pkgutil.resolve_name(DECODE_MAX)))
    return _bound["state"]


def scratch_for(device: Any) -> Any:
    """The bytes every plugin-kernel call on ``device`` carves its split partials from, made once.

    SGLang's call passes no workspace, and a CUDA graph captured around an allocation replays into
    memory the allocator may since have handed out; so the most any planned call needs
    (:func:`~mla_sm120_plugin.kernels.dsv4.plan.scratch_bound`, about 22 MB) is allocated once, at
    backend init (before capture), outside inference mode (an inference tensor cannot be written
    by a later call made outside it).
    """
    scratch = _scratch.get(device)
    if scratch is None:
        import torch

        from ...kernels.dsv4.plan import scratch_bound

        with torch.inference_mode(False):
            scratch = _scratch[device] = torch.empty(scratch_bound(), dtype=torch.uint8, device=device)
    return scratch


def around_backend_init(original_fn: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``DeepseekV4AttnBackend.__init__``: bind and self-check the plan's kernels in this
    scheduler, and set aside the split partials' scratch on the backend's device."""
    result = original_fn(backend, *args, **kwargs)
    if enabled():
        bound_state()
        scratch_for(backend.device)
    return result


def around_call(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``flash_mla_with_kvcache_sm120`` (keywords only): the plan's kernel for this call.

    q: [T, 1, H, 512] bfloat16 (H: SGLang's heads for the call, padded or not); k_cache:
    [pages, 256, 1, 584] float8_e4m3fn window pages (stride(0): the padded page bytes); indices:
    [T, 1, W] int32 global slots, -1 padded; topk_length: [T] int32; attn_sink: [H] float32;
    extra_k_cache: [pages, 256 / ratio, 1, 584] or None, with extra_indices_in_kvcache [T, 1, K] and
    extra_topk_length [T]. Returns (out [T, 1, H, 512] bfloat16, None), as SGLang's FlashInfer path
    (a new ``out``, as there: SGLang passes none); split partials go to :func:`scratch_for`'s bytes.
    """
    if not enabled() or args:
        return original_fn(*args, **kwargs)
    state = bound_state()
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
             extra_sparse_topk_lens=kwargs.get("extra_topk_length"), workspace_buffer=_scratch.get(q.device))
    return out.unsqueeze(1), None


def reset_for_tests() -> None:
    """Forget this process's bound state and scratch (tests; SGLang binds once a process)."""
    _bound.clear()
    _scratch.clear()


HOOKS: dict[str, Callable[..., Any]] = {  # SGLang internal -> the hook AROUND it
    DEFAULTS: around_defaults,
    BACKEND_INIT: around_backend_init,
    CALL: around_call,
}
