"""What a model family is to the shared rooms: :class:`Family`, and :class:`Shaped`, a model's calls as
its family shapes them.

The plan, the rules, the selection, the report and the self-check ask a context's or a plan's family
(:data:`mla_sm120_plugin.families.FAMILIES`) rather than testing fields: a third family is a module
that implements this protocol, a kernel folder and a self-check case. Pure Python; a family imports
nothing above the rules' floor (the plan hands it the context the shared builder made, and the plan
to render).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

from ..engines import Engine
from ..types import DcpService, Decision, DeviceInfo, ModelProfile, Refusal, SelectionContext

# ``ModelFacts`` (modelinfo), ``EngineLimits`` (context) and ``Plan`` (plan) sit on the floors above and
# reach a family as arguments, read by attribute: named in annotations only, never imported.


@dataclass(frozen=True)
class Shaped:
    """A model's calls as a family shapes them.

    :param contexts: layer kind -> the selection context of its call.
    :param kv_cache: the cache layout (or record) every layer kind reads.
    :param notes: what is worth a line beside the plan.
    """

    contexts: Mapping[str, SelectionContext]
    kv_cache: str
    notes: tuple[str, ...] = ()


class Family(Protocol):
    """A model family, as the shared rooms ask it.

    :param name: the key (``"dsa"``, ``"dsv4"``): what profiles (:attr:`ModelProfile.family`), model facts
        and contexts (:attr:`SelectionContext.family`) name.
    :param label: how messages name its models (``"DSA"``, ``"DeepSeek-V4"``).
    :param layouts: the cache layouts (or records) its kernels read: a kernel reading one of them serves
        this family's contexts and no other's.
    :param selfcheck_case: the module that builds, runs and measures its self-check case (dispatch's
        floor, imported only when a check runs; see :mod:`mla_sm120_plugin.dispatch.selfcheck`).
    :param device_words: its words in the device refusal: how its models' own path is called, what it
        serves, what the user switches off to get there.
    :param has_call: its contexts carry a call shape (:attr:`SelectionContext.call`, set by :meth:`shape`
        per layer kind); a family without one decides its models as a single context.
    :param dcp: whether (and why not) its calls are served under decode context parallelism
        (:class:`~mla_sm120_plugin.types.DcpService`); a family that declares nothing is refused there.
    """

    name: str
    label: str
    layouts: frozenset[str]
    selfcheck_case: str
    device_words: tuple[str, str, str]
    has_call: bool
    dcp: DcpService

    def own_path(self, engine: Engine, sm_family: int | None) -> str:
        """The engine's own attention for this family's models on ``sm_family`` (a device refusal's fix)."""

    def shape(self, base: SelectionContext, facts: ModelFacts, kv_cache_dtype: str | None, limits: EngineLimits, *,
              speculative_tokens: int, dspark: bool) -> Shaped:
        """One context per layer kind, from ``base`` (the shared builder's context for ``facts`` under the
        engine's settings).

        :raises UnsupportedConfiguration: what no layer kind can serve (device, TP size, KV dtype).
        """

    def config_geometry(self, cfg: Any, *, arch: str, where: str) -> Any:
        """What the family reads of its models' own config keys (a dict or a ``PretrainedConfig``-like
        object; :mod:`mla_sm120_plugin.hfconfig`'s readers), kept as :attr:`ModelFacts.geometry`; None: it
        reads none beyond the shared ones.

        :raises ConfigError: a key of the wrong type or range (the message names ``where``).
        """

    def kv_layout(self, engine: Engine, value: str | None, device: DeviceInfo, facts: ModelFacts) -> str:
        """The cache layout (or record) the engine's ``--kv-cache-dtype`` ``value`` (None: auto) gives this
        family's model on ``device``: the one place a context's layout is derived. A value the family has
        no layout for passes through, for its rules to refuse."""

    def check_kv_cache_dtype(self, engine: Engine) -> str | None:
        """What ``mla-sm120 check`` plans without ``--kv-cache-dtype`` (None: the engine's auto)."""

    def refusals(self, ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
        """The built-in rules for one of its contexts (device, KV layout, features, geometry)."""

    def call_from_json(self, fields: Mapping[str, Any] | None) -> Any:
        """A context's :attr:`~SelectionContext.call` from its JSON fields (None: no call)."""

    def token_bytes(self, layout: str) -> int | None:
        """Bytes a cache token costs in ``layout`` (None: not one of its layouts)."""

    def capacity(self, ctx: SelectionContext) -> dict[str, Any]:
        """One decision's cache capacity: ``{"scope", "layouts": {name: {"token_bytes", "tokens_per_gib"}},
        "ratio_vs": {name: x}}``, the context's layout beside the ones it is compared with."""

    def scales(self, ctx: SelectionContext, decision: Decision) -> str:
        """How the context's cache stores its scales, in words (the report's ``kv cache`` line)."""

    def plan_capacity(self, plan: Plan) -> dict[str, Any]:
        """The plan's cache capacity, in :meth:`capacity`'s shape (its scope says what is counted)."""

    def plan_rows(self, plan: Plan) -> list[str]:
        """The plan's own lines above its notes (a header and a row per layer kind and phase); empty where
        its one decision's table says it all."""

    def details(self, plan: Plan) -> dict[str, Any]:
        """The family's own facts for ``check --json``'s ``details`` (empty: none)."""

    def layers(self, ctx: SelectionContext) -> int | None:
        """How many of the model's layers make this context's call (None: the family does not count them)."""
