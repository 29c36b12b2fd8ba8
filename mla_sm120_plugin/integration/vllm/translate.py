"""vLLM's config in the plan's terms: engine limits, the model's facts, the plugin's settings, the plan.

:func:`plan_from_vllm` reads a ``VllmConfig`` (the one in scope while vLLM builds the model:
:func:`current_vllm_config`) into the plan's inputs and plans through
:func:`mla_sm120_plugin.plan.plan`, for every model family alike: the DSA binding takes the plan's
one decision, the DeepSeek-V4 binding a decision per layer kind. A plan is made once a process for
the same inputs (the adapter's one plan cache: vLLM's selector, each impl and each DeepSeek-V4 layer
ask again), and :func:`device_capability` answers with the capability vLLM's selector validated
against, where it did. No servability rule lives here: the adapter translates, the matrix decides.
Imports nothing of vLLM at module level.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import device as device_mod
from ...config import ADDITIONAL_CONFIG_KEY
from ...context import EngineLimits, plugin_config
from ...engines import installed_release, release_refusal
from ...errors import UnsupportedConfiguration, format_error
from ...hooks.manager import get_registry
from ...modelinfo import facts_from_hf_config
from ...plan import Plan, plan

# The adapter's state in this process: plans by their inputs, and the device capability vLLM's
# selector validated against (the impls it builds next plan for the same device; on a machine whose
# platform reports none, as in CPU tests, it is the only one).
_plans: dict[tuple[Any, ...], Plan] = {}
_selector: dict[str, tuple[int, int]] = {}


def current_vllm_config() -> Any:
    """The VllmConfig in scope, or None (outside vLLM's model construction)."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def release() -> str:
    """The installed vLLM's release, as the plan keys its facts.

    :raises UnsupportedConfiguration: a release the plugin does not support (``register()`` logged
        the same words and registered nothing, so this is reached only by a forced path).
    """
    installed = installed_release("vllm")
    refusal = release_refusal("vllm", installed)
    if refusal is not None:
        raise UnsupportedConfiguration(refusal)
    return installed


def engine_limits(vllm_config: Any) -> EngineLimits:
    """vLLM's parallelism, scheduling and attention settings, as the selection needs them."""
    from vllm.v1.attention.backend import max_decode_query_len

    model_config = vllm_config.model_config
    sched = vllm_config.scheduler_config
    # The widest request vLLM's builders count as a decode (their reorder threshold reads the same
    # function): 1 + speculative tokens, plus what the release's drafters append.
    decode_q = max_decode_query_len(vllm_config)
    comp = vllm_config.compilation_config
    parallel = vllm_config.parallel_config
    features = set()
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        features.add("hisparse")
    if (getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        features.add("pcp")
    return EngineLimits(
        tensor_parallel_size=parallel.tensor_parallel_size,
        # The heads of the DCP group are gathered for each call (MLADCPManager), so the plan sizes
        # every kernel choice and the self-check by heads per rank x this.
        decode_context_parallel_size=getattr(parallel, "decode_context_parallel_size", 1) or 1,
        cp_kv_cache_interleave_size=getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1,
        max_decode_tokens=min(sched.max_num_seqs * decode_q, sched.max_num_batched_tokens),
        max_prefill_tokens=sched.max_num_batched_tokens,
        cuda_graphs=(not model_config.enforce_eager and comp.cudagraph_mode is not None
                     and comp.cudagraph_mode.has_full_cudagraphs()),
        features=frozenset(features),
        engine="vllm",
        release=release(),
    )


def model_and_settings(vllm_config: Any, hf_config: Any) -> tuple[Any, Any]:
    """The model's facts from ``hf_config`` (named and archited as vLLM serves it) and the plugin
    settings for it (``--additional-config mla_sm120``, then the environment's config)."""
    model_config = vllm_config.model_config
    reg = get_registry()
    facts = facts_from_hf_config(hf_config, name=str(model_config.model), registry=reg)
    if model_config.architectures:
        facts = dataclasses.replace(facts, arch=model_config.architectures[0])
    inline = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    return facts, plugin_config(inline, kernel_names=reg.kernels).for_model(facts.name, facts.arch)


def _text_config(vllm_config: Any) -> Any:
    """The text model's config (a DSA model's geometry is there; the reader looks into a
    ``text_config`` itself, so DeepSeek-V4's whole config is read as given)."""
    model_config = vllm_config.model_config
    return model_config.hf_text_config if hasattr(model_config, "hf_text_config") else model_config.hf_config


def validated_against(capability: tuple[int, int]) -> None:
    """Remember the device capability vLLM's selector validated against in this process."""
    _selector["capability"] = capability


def device_capability() -> tuple[int, int]:
    """This GPU's compute capability: the one vLLM's selector validated against in this process, else
    what vLLM's platform reports.

    :raises UnsupportedConfiguration: neither has one.
    """
    if "capability" in _selector:
        return _selector["capability"]
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    if cap is None:
        raise UnsupportedConfiguration(format_error(
            "--attention-backend CUSTOM: vLLM's platform reports no GPU compute capability",
            "an NVIDIA SM120/SM121 GPU", "run on an SM12x GPU, or serve without --attention-backend CUSTOM"))
    return cap.major, cap.minor


def plan_from_vllm(vllm_config: Any, kv_cache_dtype: str | None, capability: tuple[int, int],
                   hf_config: Any = None) -> Plan:
    """The plan (layer kind -> decision) for vLLM's config on a device of ``capability``, made once a
    process for the same inputs.

    :param kv_cache_dtype: the cache dtype as the layer sees it (the selector's for a DSA layer,
        the cache config's for DeepSeek-V4).
    :param hf_config: the config the layer is built from: the text model's by default (a DSA
        layer's); DeepSeek-V4's binding passes the whole config (V4.1's layer list may sit under its
        ``text_config``, which the reader looks into).
    :raises UnsupportedConfiguration: some (layer kind, phase) cannot be served, or the device, TP
        size or KV dtype cannot (given / supported / fix, as ``mla-sm120 check`` says it).
    :raises ConfigError: the plugin config (inline or file) is malformed.
    """
    facts, settings = model_and_settings(vllm_config, _text_config(vllm_config) if hf_config is None else hf_config)
    spec = vllm_config.speculative_config
    drafts = (spec.num_speculative_tokens or 0) if spec is not None else 0
    # vLLM widens DeepSeek-V4 decode window rows for a non-causal (DSpark) draft only
    # (_required_sm120_sparse_topk); a DSA plan's decode bound (engine_limits) carries the drafts.
    non_causal = bool(getattr(vllm_config.attention_config, "use_non_causal", False)) and spec is not None
    device, limits, reg = device_mod.from_capability(*capability), engine_limits(vllm_config), get_registry()
    key = (facts, settings, device, limits, drafts, non_causal, id(reg))
    if (*key, kv_cache_dtype) not in _plans:
        planned = plan(facts, settings, device, kv_cache_dtype, limits, speculative_tokens=drafts, dspark=non_causal,
                       registry=reg)
        # Another spelling of the cache every layer kind reads plans the same (vLLM's DeepSeek-V4 layer
        # rewrites fp8 to fp8_ds_mla after the first layer): the first plan serves both.
        _plans[(*key, kv_cache_dtype)] = _plans.setdefault((*key, "cache:" + planned.kv_cache), planned)
    return _plans[(*key, kv_cache_dtype)]


def reset_for_tests() -> None:
    """Forget this process's plans and the selector's capability (tests)."""
    _plans.clear()
    _selector.clear()
