"""Model families, each an object the shared rooms ask (:class:`.base.Family`), and the one table of them.

- :mod:`.base`: the protocol, and :class:`.base.Shaped` (a model's calls as its family shapes them).
- :mod:`.dsa`: DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2, GLM-5.3-Flash, HY V4, Kimi K3.1,
  Mistral Large 4): one latent cache, one call shape, so a plan of one layer kind.
- :mod:`.dsv4`: DeepSeek-V4 (V4-Flash, V4-Pro, V4.1 and their drafts): a window cache and a
  compressed cache a layer, one call shape per layer kind, the record the engine's spelling names.

The plan, the rules, the selection, the report and the self-check runner name no family: they read
:data:`FAMILIES` through :func:`get`, :func:`of` (a model's) and :func:`of_kernel` (a kernel's). This
module is also the built-in ``mla_sm120_validate`` implementation (registered by the plugin manager as
``mla_sm120.policy``, exactly like a third party's): a context's family says its rules. A new family is
a module here beside a kernel folder and a self-check case, and a line in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ..errors import PluginError, format_error
from ..hooks.specs import hookimpl
from ..rules import dcp_refusals
from ..types import KernelSpec, ModelProfile, Refusal, SelectionContext
from . import dsa, dsv4
from .base import Family, Shaped

FAMILIES: Mapping[str, Family] = {family.name: family for family in (dsa.FAMILY, dsv4.FAMILY)}

__all__ = ["FAMILIES", "Family", "Shaped", "get", "of", "of_kernel", "mla_sm120_validate"]


def get(name: str) -> Family:
    """The family called ``name``.

    :raises PluginError: no family has that name (a profile or a third party's context naming one).
    """
    family = FAMILIES.get(name)
    if family is None:
        raise PluginError(format_error(f"model family {name!r}", f"one of {list(FAMILIES)}",
                                       "say 'dsa' for a one-cache sparse-MLA model, 'dsv4' for DeepSeek-V4"))
    return family


def of(facts: Any) -> Family:
    """The family of a model (:attr:`~mla_sm120_plugin.modelinfo.ModelFacts.family`, which the reader took
    from the model's profile)."""
    return get(facts.family)


def of_kernel(spec: KernelSpec) -> Family | None:
    """The family whose cache layouts ``spec`` reads (None: none of the families')."""
    return next((family for family in FAMILIES.values() if spec.kv_cache_dtypes & family.layouts), None)


@hookimpl
def mla_sm120_validate(ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
    """The rules every engine shares, as the context's family states them (SM family, KV layout, engine
    features, model geometry), then decode context parallelism's, one set for every family (what the
    family declares about it: :func:`~mla_sm120_plugin.rules.dcp_refusals`)."""
    family = get(ctx.family)
    yield from family.refusals(ctx, profile)
    yield from dcp_refusals(ctx, family)
