"""SGLang's resolved settings in the plan's terms, and the plan the launcher hands its schedulers.

:func:`plan_from_sglang` reads SGLang's resolved view (``ResolvedView`` / ``ResolvingConfig``) and
its model config into the plan's inputs (model facts, plugin settings, device, engine limits) and
plans through :func:`mla_sm120_plugin.plan.plan`, for every model family alike; the speculative
decode bound is SGLang's own speculative pass, run on a copy of the record. :func:`export` writes
the plan for the scheduler processes (``MLA_SM120_SGLANG_PLAN``: layer kind -> context JSON) and
:func:`imported` reads it back there, undecided: each binding decides it again with
:func:`mla_sm120_plugin.selection.select`. No servability rule lives here: the adapter
translates, the matrix decides.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ... import config as config_mod
from ...context import EngineLimits, context_from_json, context_to_json, plugin_config
from ...device import from_capability
from ...errors import ConfigError, UnsupportedConfiguration, format_error
from ...hooks.manager import get_registry
from ...modelinfo import ModelFacts, facts_from_hf_config
from ...engines import installed_release, lookup
from ...plan import Plan, plan
from ...types import DeviceInfo, SelectionContext
from .names import ENABLE_ENV, FLAG, INLINE_CONFIG_ENV, LOGGER, PLAN_ENV

logger = logging.getLogger(LOGGER)

# SGLang's environment variables (defined on sglang.srt.environ.envs) that switch skip-softmax on.
SKIP_SOFTMAX = ("sglang.srt.environ.envs.SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR",
                "sglang.srt.environ.envs.SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR")


def _engine_features(view: Any) -> frozenset[str]:
    """SGLang settings that change how the cache is written or top-k ids are read."""
    features = set()
    if getattr(view, "enable_hisparse", False):
        features.add("hisparse")
    # What SGLang refuses under --dcp-size > 1 only (_dsa_dcp_overrides): the plan refuses them there.
    if getattr(view, "enable_hierarchical_cache", False):
        features.add("hicache")
    if getattr(view, "disaggregation_mode", "null") not in (None, "null"):
        features.add("pd_disaggregation")
    if getattr(view, "speculative_eagle_topk", None) not in (None, 1):
        features.add("eagle_topk")
    if any(os.environ.get(name.rpartition(".")[2]) for name in SKIP_SOFTMAX):
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


def record_copy(record: Any) -> Any:
    """A copy of SGLang's record to run its own passes on, the user's left as it is: a shallow copy
    (``ServerArgs.__reduce__``: fields plus bookkeeping) sharing the memoized ModelConfig, with a
    declaration stash of its own (SGLang's handlers only append to it)."""
    clone = copy.copy(record)
    clone._resolved_overrides = [(source, dict(fields))
                                 for source, fields in getattr(record, "_resolved_overrides", None) or ()]
    return clone


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
        from sglang.srt.arg_groups.model_override_base import ResolvedView, ResolvingConfig, record_of, resolving_view
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        if not isinstance(view, (ResolvedView, ResolvingConfig)):
            return None
        record = record_of(view)
        overlay = dict(object.__getattribute__(view, "_overlay")) if isinstance(view, ResolvedView) else {}
        clone = record_copy(record)
        if overlay:
            clone._resolved_overrides.append(("mla_sm120_plugin.view", overlay))
        env = dict(os.environ)
        with _quiet(_RESOLUTION_LOGGERS):
            cfg = resolving_view(clone)
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
            # (the method named on its class, so that the internals catalogue sees it)
            SpeculativeAlgorithm.handle_server_args(SpeculativeAlgorithm.from_string(algorithm), clone)
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


def engine_limits(view: Any, hf_config: Any = None) -> EngineLimits:
    """SGLang's parallelism, batching and cache settings, as the selection needs them (SGLang's
    settings alone: ``hf_config`` is taken for the callers' symmetry and not read)."""
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
        decode_context_parallel_size=int(getattr(view, "dcp_size", 1) or 1),
        max_decode_tokens=max_decode,
        max_prefill_tokens=int(chunk) if chunk and chunk > 0 else None,
        cuda_graphs=not getattr(view, "disable_cuda_graph", False),
        features=_engine_features(view),
        engine="sglang",  # its kv dtype spellings and its cache writer's scale format
        release=installed_release("sglang"),  # the facts of the release that runs (lookup refuses another)
    )


@dataclass(frozen=True)
class Inputs:
    """What :func:`mla_sm120_plugin.plan.plan` takes, read from SGLang's settings."""

    facts: ModelFacts
    settings: config_mod.Settings
    device: DeviceInfo
    kv_cache_dtype: str | None
    limits: EngineLimits
    speculative_tokens: int = 0
    dspark: bool = False


def _user_record(view: Any) -> Any:
    """What the user passed: the record under SGLang's resolved view (its declarations left out: under
    ``--dcp-size`` > 1 SGLang declares ``trtllm`` for both DSA backends before the plugin's pass, a default of
    its own, not the user's choice of kernel), or ``view`` itself where it is not one of SGLang's views."""
    try:
        from sglang.srt.arg_groups.model_override_base import ResolvedView, ResolvingConfig, record_of
    except ImportError:
        return view
    return record_of(view) if isinstance(view, (ResolvedView, ResolvingConfig)) else view


def inputs_from_sglang(view: Any, hf_config: Any, capability: tuple[int, int]) -> Inputs:
    """The plan's inputs for SGLang's resolved arguments on a GPU of ``capability``.

    The model's name is ``--served-model-name`` when given, else ``--model-path`` (config sections
    match it). ``--mla-sm120-config`` is the inline source; for a DSA model ``--dsa-prefill-backend``
    / ``--dsa-decode-backend``, as the user passed them, are read as forced kernels within it (another
    engine impl, such as ``flashmla_kv``, gets the "cannot run here, these can" refusal).
    """
    reg = get_registry()
    facts = facts_from_hf_config(hf_config, name=str(getattr(view, "served_model_name", None) or view.model_path),
                                 registry=reg)
    # SGLang's flags that name a plugin kernel per phase, for the model's family (Engine.kernel_flags_by_family)
    flags, fields = lookup("sglang").kernel_flags_by_family.get(facts.family, ("", ()))
    inline: dict[str, Any] = json.loads(os.environ.get(INLINE_CONFIG_ENV) or "{}")
    user = _user_record(view)
    for key, field in fields:
        if getattr(user, field, None):
            inline[key] = getattr(user, field)
    label = f"{FLAG}-config / {flags}" if flags else f"{FLAG}-config"
    settings = plugin_config(inline or None, kernel_names=reg.kernels, inline_label=label).for_model(facts.name,
                                                                                                     facts.arch)
    algorithm = str(getattr(view, "speculative_algorithm", None) or "").upper()
    drafts = int(getattr(view, "speculative_num_draft_tokens", None) or 0) if algorithm else 0
    return Inputs(facts, settings, from_capability(*capability, source="sglang"), getattr(view, "kv_cache_dtype", None),
                  engine_limits(view, hf_config), speculative_tokens=drafts, dspark=algorithm == "DSPARK")


def plan_from_sglang(view: Any, hf_config: Any, capability: tuple[int, int]) -> Plan:
    """The plan (layer kind -> decision) for SGLang's resolved arguments on a GPU of ``capability``.

    :raises UnsupportedConfiguration: some (layer kind, phase) cannot be served, or the TP size, the
        KV dtype or the device cannot (given / supported / fix, as ``mla-sm120 check`` says it).
    """
    got = inputs_from_sglang(view, hf_config, capability)
    return plan(got.facts, got.settings, got.device, got.kv_cache_dtype, got.limits,
                speculative_tokens=got.speculative_tokens, dspark=got.dspark, registry=get_registry())


def gpu_capability() -> tuple[int, int]:
    """This GPU's compute capability, as SGLang reads it."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def resolved_view(server_args: Any) -> Any:
    """SGLang's resolved view of ``server_args``: its fields with the declarations made so far."""
    from sglang.srt.arg_groups.model_override_base import ResolvedView, _declaration_overlay

    return ResolvedView(server_args, overlay=_declaration_overlay(server_args))


def model_config(view: Any) -> Any:
    """SGLang's model config object for ``view`` (its memoized ``ModelConfig.hf_config``)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of

    return model_config_of(view).hf_config


def export(planned: Plan) -> None:
    """Hand ``planned`` to the scheduler processes (SGLang's children inherit the environment)."""
    os.environ[PLAN_ENV] = json.dumps({kind: context_to_json(d.context) for kind, d in planned.decisions.items()})


def exported() -> bool:
    """The launcher's plan is in this process's environment."""
    return bool(os.environ.get(PLAN_ENV))


def not_reached(what: str, where: str) -> UnsupportedConfiguration:
    """The refusal of a scheduler the launcher's ``what`` (made while SGLang was ``where``) did not reach."""
    return UnsupportedConfiguration(format_error(
        f"{ENABLE_ENV} is on in this process but the launcher's {what} ({PLAN_ENV}) did not reach it",
        f"SGLang's launcher {where} with the plugin enabled",
        f"start SGLang with {FLAG} (or {ENABLE_ENV}=1 set before the launcher starts)"))


def imported(what: str, where: str) -> dict[str, SelectionContext]:
    """The launcher's plan as this scheduler reads it: layer kind -> its context, undecided.

    :raises UnsupportedConfiguration: the plan did not reach this process (:func:`not_reached`).
    :raises ConfigError: the text is not a plan this plugin version wrote.
    """
    text = os.environ.get(PLAN_ENV)
    if not text:
        raise not_reached(what, where)
    try:
        kinds = json.loads(text)
        if not isinstance(kinds, dict):
            raise ValueError(f"a {type(kinds).__name__}, not an object")
    except ValueError as exc:
        raise ConfigError(format_error(f"{PLAN_ENV}: a plan that does not parse ({exc})",
                                       "what the launcher wrote: layer kind -> selection context",
                                       "restart the engine so its launcher decides again")) from None
    return {kind: context_from_json(ctx) for kind, ctx in kinds.items()}
