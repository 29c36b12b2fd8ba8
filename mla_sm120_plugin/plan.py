"""One plan shape for every model: layer kind -> the decision for its call.

:func:`plan` asks the model's family (:mod:`mla_sm120_plugin.families`) for one selection context
per layer kind, shaped as the engine will make the call (a one-call family: one kind; a family with
several call shapes: one a kind its model has), and decides every context with the same constraint matrix
(:func:`mla_sm120_plugin.selection.select`): kernels, envelopes, probes, the plugin config's forced
kernels and precision. ``mla-sm120 check`` and both engine adapters call it; :mod:`.report` renders
what it returns. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from . import config as config_mod
from . import families
from .context import EngineLimits, build_context
from .errors import UnsupportedConfiguration, format_error
from .engines import Engine, lookup
from .hooks.manager import Registry, get_registry
from .modelinfo import ModelFacts
from .rules import dcp_notes
from .selection import select
from .types import PHASES, Decision, DeviceInfo


@dataclass(frozen=True)
class Plan:
    """A deployment decided per layer kind.

    :param facts: the model.
    :param engine: the engine key.
    :param device: the device planned for.
    :param tensor_parallel_size: ranks the heads are split over.
    :param family: the model family (a key of :data:`mla_sm120_plugin.families.FAMILIES`).
    :param decisions: layer kind -> the :class:`~mla_sm120_plugin.types.Decision` for its call (a DSA
        model: one kind, ``"dsa"``; a family with several call shapes: one a layer kind).
    :param kv_cache: the cache layout (or record) every layer kind reads.
    :param notes: what is worth a line beside the table (the decisions' own notes, then the family's).
    :param release: the engine release planned for.
    :param decode_context_parallel_size: ranks the cache is sharded over by token (1: each GPU keeps it whole).
    """

    facts: ModelFacts
    engine: str
    device: DeviceInfo
    tensor_parallel_size: int
    family: str
    decisions: Mapping[str, Decision]
    kv_cache: str
    notes: tuple[str, ...] = field(default=())
    release: str = ""
    decode_context_parallel_size: int = 1

    @property
    def versioned(self) -> str:
        """The engine and release planned for, as messages name them (``vLLM 0.34.0``)."""
        return lookup(self.engine, self.release or None).versioned

    @property
    def decision(self) -> Decision:
        """The one decision of a one-kind plan (a DSA model).

        :raises ValueError: the plan has several kinds.
        """
        if len(self.decisions) != 1:
            raise ValueError(f"a plan of {len(self.decisions)} layer kinds ({sorted(self.decisions)}) has no one decision")
        return next(iter(self.decisions.values()))

    def kernels(self) -> dict[tuple[str, str], str]:
        """(layer kind, phase) -> the kernel that serves it."""
        return {(kind, phase): d.kernels[phase] for kind, d in self.decisions.items() for phase in PHASES}


def check_kv_cache_dtype(facts: ModelFacts, engine: Engine, given: str | None) -> str | None:
    """The ``--kv-cache-dtype`` ``mla-sm120 check`` plans: ``given``, else the fp8 cache a deployment on
    SM12x uses for this model's family (:meth:`Family.check_kv_cache_dtype`: a DSA model's is the engine's
    fp8 DSA layout), or for a model with learned sinks the one layout the engine accepts for it, where it
    has one.

    :param engine: the engine's facts at the planned release.
    """
    if given:
        return given
    sink_layout = engine.sink_layout if facts.sinks else None
    if sink_layout is not None:
        return engine.spelling(sink_layout)
    return families.of(facts).check_kv_cache_dtype(engine)


def plan(
    facts: ModelFacts,
    settings: config_mod.Settings,
    device: DeviceInfo,
    kv_cache_dtype: str | None,
    limits: EngineLimits,
    *,
    speculative_tokens: int = 0,
    dspark: bool = False,
    registry: Registry | None = None,
) -> Plan:
    """Decide every (layer kind, phase) of a deployment.

    :param facts: the model (:func:`mla_sm120_plugin.modelinfo.resolve_model` or the engine's config).
    :param settings: the plugin settings for this model (forced kernels, precision).
    :param device: the device planned for.
    :param kv_cache_dtype: the engine's ``--kv-cache-dtype`` as the user wrote it (None: auto).
    :param limits: the engine's TP size, call-size bounds and CUDA-graph setting.
    :param speculative_tokens: draft tokens a step (a family may shape its calls by them: vLLM's DSpark
        widens a window's decode rows).
    :param dspark: the draft is DSpark (non-causal window rows).
    :param registry: the plugin registry; the process-wide one by default.
    :returns: the plan, one decision per layer kind.
    :raises UnsupportedConfiguration: the engine's release does not build the model; what no kind can
        serve (device, TP size, KV dtype), or some (layer kind, phase) has no kernel: every such kind
        in one message, a refusal the kinds share said once.
    """
    reg = registry if registry is not None else get_registry()
    engine = limits.facts
    if facts.arch in engine.missing_architectures:
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch} ({facts.name}) under {engine.versioned}",
            f"the architectures {engine.versioned} builds", engine.missing_architectures[facts.arch]))
    if facts.dense_layers and engine.opt_in_every_layer:
        # The plugin's backend is sparse MLA only: the engine's selector refuses it for a dense MLA
        # layer while it builds the model.
        raise UnsupportedConfiguration(format_error(
            f"{facts.name} ({facts.arch}) has {facts.dense_layers} dense MLA layer(s) (MLA layers outside "
            f"dsa_config.dsa_layers) under {engine.enable_flag}",
            "a model whose MLA layers are all sparse: the flag gives every attention layer the plugin's backend, "
            f"which serves sparse MLA only ({engine.label} refuses it for a dense layer when it builds the model)",
            f"serve this model without {engine.enable_flag} ({engine.label}'s own backends serve both kinds)"))
    family = families.of(facts)
    base = build_context(facts, settings, device, kv_cache_dtype, limits)
    shaped = family.shape(base, facts, kv_cache_dtype, limits, speculative_tokens=speculative_tokens, dspark=dspark)
    decisions: dict[str, Decision] = {}
    problems: dict[str, list[str]] = {}
    for kind, ctx in shaped.contexts.items():
        try:
            decisions[kind] = select(ctx, registry=reg)
        except UnsupportedConfiguration as error:
            if len(shaped.contexts) == 1:
                raise  # one call shape: its refusal as the matrix wrote it
            text = str(error).replace(f", layer kind {kind}", "", 1)
            layers = family.layers(ctx)
            counted = "" if layers is None else f" ({layers} layer{'s' if layers != 1 else ''})"
            problems.setdefault(text, []).append(f"{kind}{counted}")
    if problems:
        raise UnsupportedConfiguration("\n".join(f"layer kinds {', '.join(kinds)}:\n{text}"
                                                 for text, kinds in problems.items()))
    notes = [note for d in decisions.values() for note in d.notes] + list(shaped.notes) + list(dcp_notes(base))
    return Plan(facts=facts, engine=limits.engine, device=device, tensor_parallel_size=limits.tensor_parallel_size,
                family=family.name, decisions=decisions, kv_cache=shaped.kv_cache, notes=tuple(dict.fromkeys(notes)),
                release=engine.release, decode_context_parallel_size=limits.decode_context_parallel_size)
