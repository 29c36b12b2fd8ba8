"""Model families, each a row in the shared rooms: its part of the plan is how its layers' attention
calls are shaped into selection contexts.

- :mod:`.dsa`: DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2, GLM-5.3-Flash): one latent cache,
  one call shape, so a plan of one layer kind (:data:`.dsa.KIND`).
- :mod:`.dsv4`: DeepSeek-V4 (V4-Flash, V4-Pro, V4.1 and their drafts): a window cache and a
  compressed cache a layer, one call shape per layer kind, the record the engine's spelling names.

Each module has ``shape(facts, settings, device, kv_cache_dtype, limits, *, speculative_tokens,
dspark) -> Shaped`` (:class:`Shaped`) and ``check_kv_cache_dtype(engine)`` (what ``mla-sm120 check``
assumes without ``--kv-cache-dtype``). :func:`mla_sm120_plugin.plan.plan` picks the part for a model
and decides every context it shapes with the one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..types import SelectionContext


@dataclass(frozen=True)
class Shaped:
    """A model's calls as a family shapes them.

    :param contexts: layer kind -> the selection context of its call.
    :param record: the cache record every layer reads (a DeepSeek-V4 record name), or None (the
        contexts' own layouts).
    :param notes: what is worth a line beside the plan.
    """

    contexts: Mapping[str, SelectionContext]
    record: str | None = None
    notes: tuple[str, ...] = ()

