"""The DeepSeek-V4 binding: SGLang 0.5.23's DeepSeek-V4 defaults, backend and SM12x call, served by the plan.

- ``apply_deepseek_v4_defaults`` (AROUND, launcher, before any weight loads; V4.1 runs under V4's
  architecture there): once SGLang resolved its DeepSeek-V4 settings, plans every (layer kind,
  phase) (:func:`.translate.plan_from_sglang`), refuses at launch what cannot be served and exports
  the plan for the schedulers.
- ``DeepseekV4AttnBackend.__init__`` (AROUND, each scheduler): binds each kind's kernels from the
  launcher's plan and self-checks them (:func:`bound_state`, through :mod:`.bound`), and sets aside the split partials'
  scratch on the backend's device (:func:`scratch_for`), before SGLang captures its graphs.
- ``flash_mla_with_kvcache_sm120`` (AROUND, every DeepSeek-V4 attention call on SM12x): the call's
  layer kind is its compressed cache's page (none: the window), its phase SGLang's own split (more
  than ``SM120_DECODE_MAX_TOKENS`` tokens: the prefill form); where the plan gives FlashInfer's
  kernel SGLang's own call runs, where it gives the plugin's Triton kernel that kernel runs on the
  same arguments.
"""

from __future__ import annotations

import functools
import logging
import pkgutil
from typing import Any, Callable

from ...errors import KernelInputError, format_error
from ...report import log_line
from ...types import DECODE, PREFILL, Decision
from . import bound, translate
from .bound import BoundState
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

ROOM = "dsv4"  # this room's bound state (:mod:`.bound`)
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


def bound_state() -> BoundState:
    """Each layer kind of the launcher's plan, decided, self-checked, bound and logged once a process
    (a kind FlashInfer serves is bound to FlashInfer's kernel as SGLang's call reaches it).

    :raises UnsupportedConfiguration: the plan did not reach this process, or a kind's kernels and
        their alternates all failed the self-check.
    """
    return bound.bound_state(ROOM, HOOKS, "DeepSeek-V4 plan", "applying its DeepSeek-V4 defaults",
                             engine_fns=_flashinfer_call)


def _flashinfer_call(decisions: list[Decision]) -> dict[str, Callable[..., Any]]:
    """FlashInfer's DeepSeek-V4 kernel as SGLang's call reaches it, where some decision names it."""
    from ...dispatch.catalog import FLASHINFER_DSV4

    if not any(FLASHINFER_DSV4 in d.kernels.values() for d in decisions):
        return {}
    return {FLASHINFER_DSV4: pkgutil.resolve_name(FLASHINFER_CALL)}


@functools.lru_cache(maxsize=1)
def _by_page(state: BoundState) -> dict[int, Any]:
    """The bound layer kinds by the compressed cache's page their calls pass (0: the window alone): how a
    call's kind is told apart, indexed once a bound state rather than on every call."""
    return {bound_kind.decision.context.call.extra_page: bound_kind for bound_kind in state.kinds.values()}


@functools.cache
def _decode_max_tokens() -> int:
    """SGLang's own decode / prefill split of the call (more tokens: the prefill form)."""
    return int(pkgutil.resolve_name(DECODE_MAX))


def scratch_for(device: Any) -> Any:
    """The bytes every plugin-kernel call on ``device`` carves its split partials from, made once.

    SGLang's call passes no workspace, and a CUDA graph captured around an allocation replays into
    memory the allocator may since have handed out; so the most any planned call needs
    (:func:`~mla_sm120_plugin.kernels.dsv4.plan.scratch_bound`, about 52 MB) is allocated once, at
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
    by_page = _by_page(bound_state())
    q, extra = kwargs["q"], kwargs.get("extra_k_cache")
    page = 0 if extra is None else int(extra.shape[1])
    bound_kind = by_page.get(page)
    if bound_kind is None:
        raise KernelInputError(format_error(
            f"a DeepSeek-V4 call with a compressed cache of {page} entries a page", "the launcher's plan: "
            + ", ".join(f"{b.decision.context.call.kind} ({p or 'no compressed cache'})" for p, b in by_page.items()),
            "restart SGLang so that its launcher plans this model again"))
    phase = PREFILL if q.shape[0] > _decode_max_tokens() else DECODE
    if bound_kind.engine_runs(phase):
        return original_fn(**kwargs)
    fn = bound_kind.kernels[phase].fn
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
    bound.forget(ROOM)
    _scratch.clear()


HOOKS: dict[str, Callable[..., Any]] = {  # SGLang internal -> the hook AROUND it
    DEFAULTS: around_defaults,
    BACKEND_INIT: around_backend_init,
    CALL: around_call,
}
