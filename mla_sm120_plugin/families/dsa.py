"""DeepSeek Sparse Attention's part of the plan: one latent cache, one call shape, one layer kind.

Every DSA layer (GLM-5, DeepSeek-V3.2, the rope-less GLM-5.3-Flash) makes the same call, so the
plan holds one context (:data:`KIND`), built by the shared context builder from the engine's
settings. Pure Python.
"""

from __future__ import annotations

from .. import config as config_mod
from ..context import EngineLimits, build_context
from ..engines import ENGINES
from ..kernels.dsa.layout import FP8_DS_MLA
from ..modelinfo import ModelFacts
from ..types import DeviceInfo
from . import Shaped

KIND = "dsa"  # the one layer kind of a DSA model's plan


def shape(facts: ModelFacts, settings: config_mod.Settings, device: DeviceInfo, kv_cache_dtype: str | None,
          limits: EngineLimits, *, speculative_tokens: int = 0, dspark: bool = False) -> Shaped:
    """The one context of a DSA model (``speculative_tokens`` and ``dspark`` shape nothing here: the
    engine's decode bound in ``limits`` carries the draft tokens)."""
    return Shaped(contexts={KIND: build_context(facts, settings, device, kv_cache_dtype, limits)})


def check_kv_cache_dtype(engine: str) -> str:
    """What ``mla-sm120 check`` plans without ``--kv-cache-dtype``: the engine's fp8 DSA cache."""
    return ENGINES[engine].spelling(FP8_DS_MLA)
