"""DeepSeek-V4 in vLLM 0.33 and 0.34: with the opt-in, the plugin's subclass of vLLM's SM120 layer class.

vLLM picks a DeepSeek-V4 layer's attention class itself (``_select_dsv4_attn_cls``, a global of
``vllm.models.deepseek_v4.nvidia.model`` and of ``vllm.models.deepseek_v41.nvidia.model``, which
the target, MTP and DSpark decoder layers all look up by name), never through the attention
selector, so ``--attention-backend CUSTOM`` alone does not reach it. :func:`install`, run by
``register()`` in every vLLM process, wraps that function in each module as vLLM imports it (an
import hook: ``register()`` imports no DeepSeek-V4 module). The wrapper:

- without the opt-in (CUSTOM not selected, or CUSTOM another plugin's), returns what vLLM's own
  function returns: nothing changes;
- with it, plans the deployment while vLLM builds the model, before any weight loads
  (:func:`mla_sm120_plugin.plan.plan`, the plan ``mla-sm120 check`` prints: a refusal stops
  start-up with given / supported / fix, SM90 included), logs the plan line once a process, and
  returns the plugin's subclass of vLLM's ``DeepseekV4FlashInferSM120Attention`` (V4's or V4.1's).

The subclass keeps vLLM's layer whole (its caches, metadata, index construction, o-projection)
and changes one thing: the kernel each (layer kind, phase) calls. Where the plan gives
FlashInfer's DeepSeek-V4 kernels, vLLM's own call runs; where it gives the plugin's Triton kernel
(a shape or a precision FlashInfer's kernels do not serve, or FlashInfer's SM120 module not
building here), the same call, with the same arguments, goes to
:func:`mla_sm120_plugin.dispatch.dsv4.triton_dsv4`. Each kind's kernels pass the self-check
(:func:`mla_sm120_plugin.dispatch.selfcheck.verify_at_init`) when its first layer is built.
"""

from __future__ import annotations

import contextvars
import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any, Callable

from .names import BACKEND_PATH, LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

# The modules whose _select_dsv4_attn_cls vLLM's decoder layers call (V4; V4.1), and the
# module global their SM120 class calls FlashInfer's DeepSeek-V4 kernel through.
MODEL_MODULES = ("vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v41.nvidia.model")
SELECT = "_select_dsv4_attn_cls"
SM120_CLASS = "DeepseekV4FlashInferSM120Attention"
KERNEL_GLOBAL = "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"

# The kernel a routed layer's current call runs (None: vLLM's own FlashInfer call).
_route: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar("mla_sm120_dsv4_route",
                                                                                     default=None)
_state: dict[str, Any] = {"logged": set(), "classes": {}}


# ------------------------------------------------------------------------------ the import hook


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the module's own loader, then wraps its ``_select_dsv4_attn_cls``."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._mla_sm120_inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._mla_sm120_inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._mla_sm120_inner.exec_module(module)
        wrap_selector(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; hands :data:`MODEL_MODULES` to the next finders and wraps their loader."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MODEL_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Wrap ``_select_dsv4_attn_cls`` in the DeepSeek-V4 model modules: now where vLLM imported one
    already, else when it does. Idempotent; imports nothing."""
    for name in MODEL_MODULES:
        if name in sys.modules:
            wrap_selector(sys.modules[name])
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def wrap_selector(module: Any) -> None:
    """Replace ``module._select_dsv4_attn_cls`` with :func:`select_attention_class` around it (once)."""
    original = getattr(module, SELECT, None)
    if original is None or getattr(original, "_mla_sm120", False):
        return

    def _select_dsv4_attn_cls(vllm_config: Any) -> type:
        return select_attention_class(module, original, vllm_config)

    _select_dsv4_attn_cls._mla_sm120 = True  # type: ignore[attr-defined]
    _select_dsv4_attn_cls.__wrapped__ = original  # type: ignore[attr-defined]
    _select_dsv4_attn_cls.__doc__ = original.__doc__
    setattr(module, SELECT, _select_dsv4_attn_cls)


# ------------------------------------------------------------------------------- the decision


def opted_in(vllm_config: Any) -> bool:
    """``--attention-backend CUSTOM`` selected, and CUSTOM is this plugin's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    custom = AttentionBackendEnum.CUSTOM
    return backend == custom and custom.is_overridden() and custom.get_path() == BACKEND_PATH


def select_attention_class(module: Any, original: Callable[[Any], type], vllm_config: Any) -> type:
    """What the wrapped ``_select_dsv4_attn_cls`` returns: vLLM's choice, or with the opt-in the
    plugin's subclass of the module's SM120 class after the plan for this deployment passed.

    :raises UnsupportedConfiguration: with the opt-in, a (layer kind, phase) cannot be served, or
        the device, TP size, KV dtype or parallelism cannot.
    """
    if not opted_in(vllm_config):
        return original(vllm_config)
    plan_for(vllm_config)  # prefill context parallelism is the plan's refusal (the "pcp" engine feature)
    return plugin_class(getattr(module, SM120_CLASS))


def plan_for(vllm_config: Any) -> Any:
    """The :class:`~mla_sm120_plugin.plan.Plan` for this vLLM config (the adapter's plan cache:
    :func:`.translate.plan_from_vllm`), its line logged once a process.

    :raises UnsupportedConfiguration: as :func:`mla_sm120_plugin.plan.plan`, or no GPU capability.
    """
    from ...report import log_line
    from .translate import device_capability, plan_from_vllm

    # the whole config: V4.1's layer list may sit under its text_config, which the reader looks into
    planned = plan_from_vllm(vllm_config, vllm_config.cache_config.cache_dtype, device_capability(),
                             vllm_config.model_config.hf_config)
    if id(planned) not in _state["logged"]:
        _state["logged"].add(id(planned))
        logger.info("%s", log_line(planned))
    return planned


# ------------------------------------------------------------------------------ the layer class


def plugin_class(base: type) -> type:
    """The plugin's subclass of ``base`` (a module's ``DeepseekV4FlashInferSM120Attention``), made
    once, with that module's kernel call routed through :data:`_route`."""
    from . import dsv4_nvfp4

    classes = _state["classes"]
    if base not in classes:
        _route_kernel_global(sys.modules[base.__module__])
        for cls in base.__mro__:  # vLLM's resolver lives beside its base layer class
            dsv4_nvfp4.wrap_resolver(sys.modules[cls.__module__])
        classes[base] = type(f"MlaSm120{base.__name__}", (RoutedDsv4Attention, base),
                             {"__module__": __name__, "__qualname__": f"MlaSm120{base.__name__}"})
    return classes[base]


def _route_kernel_global(module: Any) -> None:
    """Send ``module``'s FlashInfer DeepSeek-V4 call to the routed kernel while one is set."""
    original = getattr(module, KERNEL_GLOBAL)
    if getattr(original, "_mla_sm120", False):
        return

    def routed(*args: Any, **kwargs: Any) -> Any:
        kernel = _route.get()
        return (original if kernel is None else kernel)(*args, **kwargs)

    routed._mla_sm120 = True  # type: ignore[attr-defined]
    routed.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, KERNEL_GLOBAL, routed)


def layer_kind(layer: Any) -> str:
    """The plan's name for a built layer's kind: V4 stores a window-only layer as ratio 1, V4.1 as 0."""
    from ...families.dsv4 import kind_name

    ratio = int(layer.compress_ratio)
    v41 = any(cls.__module__.startswith("vllm.models.deepseek_v41.") for cls in type(layer).__mro__)
    return kind_name(0 if (ratio <= 1 and not v41) else ratio)


class RoutedDsv4Attention:
    """Mixed in before vLLM's SM120 DeepSeek-V4 class: binds each phase's kernel from the plan."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        from . import dsv4_nvfp4

        plan = plan_for(vllm_config)
        base = type(self).__mro__[2]  # vLLM's SM120 class: (this class, the mixin, base, ...)
        # vLLM's SM120 __init__ refuses unless FlashInfer serves the layer; where the plugin's
        # kernel takes a phase, skip that gate: run the base layer's __init__ and the o-projection
        # recipe the SM120 __init__ sets (its fp8 per-tensor buffers are for a float8 cache, never
        # the uint8 record this class reads).
        token = dsv4_nvfp4.building(plan.kv_cache)
        try:
            super(base, self).__init__(vllm_config, *args, **kwargs)
        finally:
            dsv4_nvfp4.done_building(token)
        self.mla_sm120_record = plan.kv_cache
        if plan.kv_cache == dsv4_nvfp4.NVFP4_DSV4:
            dsv4_nvfp4.adopt(self)
        kind = layer_kind(self)
        decision = plan.decisions.get(kind)
        if decision is None:
            from ...errors import UnsupportedConfiguration, format_error

            raise UnsupportedConfiguration(format_error(
                f"a DeepSeek-V4 layer of kind {kind} ({self.prefix}) that the plan for {plan.facts.name} does not have",
                f"the kinds its config lists: {sorted(plan.decisions)}",
                "check the model's layer_types / compress_ratios (mla-sm120 check --model <dir>)"))
        recipe = vars(sys.modules[base.__module__])["compute_fp8_einsum_recipe"]
        block = getattr(self, "_o_proj_block_size", None)
        self._einsum_recipe, self._tma_aligned_scales = recipe() if block is None else recipe(block)
        bound = _bound(decision, sys.modules[base.__module__])
        self.mla_sm120_kernels = {phase: kernel.name for phase, kernel in bound.kernels.items()}
        self._mla_sm120_route = {phase: _route_for(bound, phase, plan.kv_cache) for phase in bound.kernels}

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        from . import dsv4_nvfp4

        spec = super().get_kv_cache_spec(vllm_config)  # type: ignore[misc]
        return dsv4_nvfp4.compressed_spec(spec) if self.mla_sm120_record == dsv4_nvfp4.NVFP4_DSV4 else spec

    def _fused_qnorm_rope_kv_insert(self, q: Any, kv: Any, positions: Any, attn_metadata: Any) -> Any:
        from . import dsv4_nvfp4

        if self.mla_sm120_record != dsv4_nvfp4.NVFP4_DSV4 or not isinstance(attn_metadata, dict):
            # vLLM's own: the fp8 record, or a profile run (no metadata: q padded, nothing written)
            return super()._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)  # type: ignore[misc]
        return dsv4_nvfp4.insert_window(self, q, kv, positions, attn_metadata)

    def _mla_sm120_routed(self, phase: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        token = _route.set(self._mla_sm120_route[phase])
        try:
            return method(*args, **kwargs)
        finally:
            _route.reset(token)

    def _forward_decode(self, *args: Any, **kwargs: Any) -> Any:
        return self._mla_sm120_routed("decode", super()._forward_decode, *args, **kwargs)  # type: ignore[misc]

    def _forward_prefill(self, *args: Any, **kwargs: Any) -> Any:
        return self._mla_sm120_routed("prefill", super()._forward_prefill, *args, **kwargs)  # type: ignore[misc]


def _bound(decision: Any, module: Any) -> Any:
    """``decision`` verified, bound and logged (:func:`mla_sm120_plugin.dispatch.bound.bind_decision`),
    with FlashInfer's DeepSeek-V4 kernel as ``module`` calls it (vLLM's own call, unrouted)."""
    from ...dispatch.bound import bind_decision
    from ...dispatch.catalog import FLASHINFER_DSV4

    original = getattr(getattr(module, KERNEL_GLOBAL), "__wrapped__", getattr(module, KERNEL_GLOBAL))
    return bind_decision(decision, logger=logger, engine_fns={FLASHINFER_DSV4: original})


def _route_for(bound: Any, phase: str, record: str) -> Callable[..., Any] | None:
    """What a phase's kernel call runs: None (vLLM's own FlashInfer call, unchanged) for FlashInfer's
    kernel on the fp8 record; else the kernel, told the record (vLLM's call passes no kv_cache_format)."""
    import functools

    from ...kernels.dsv4.layout import FLASHINFER_FORMAT, FP8_DSV4

    if bound.engine_runs(phase) and record == FP8_DSV4:
        return None
    fn = bound.kernels[phase].fn
    return fn if record == FP8_DSV4 else functools.partial(fn, kv_cache_format=FLASHINFER_FORMAT[record])


def reset_for_tests() -> None:
    """Forget this process's plans and log marks (tests)."""
    from .translate import reset_for_tests as forget_plans

    forget_plans()
    _state["logged"].clear()
