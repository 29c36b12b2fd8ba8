"""The facts about a model the selection needs, read from a HF config (dict or object).

One reader for every caller: the CLI (a ``config.json`` on disk or a built-in profile name)
and the vLLM backend (``ModelConfig.hf_config``), so both see the same numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, UnsupportedConfiguration, format_error
from .hooks.manager import Registry


@dataclass(frozen=True)
class ModelFacts:
    """:param arch: HF ``architectures[0]``. :param name: what the user called it.
    :param num_heads: attention heads before tensor parallelism. :param index_topk: indexer top-k."""

    arch: str
    name: str
    num_heads: int
    index_topk: int

    def heads_per_rank(self, tp: int) -> int:
        """Heads on one GPU at tensor-parallel size ``tp``."""
        if tp < 1 or self.num_heads % tp:
            raise UnsupportedConfiguration(
                format_error(
                    f"tensor_parallel_size={tp} for {self.name} with {self.num_heads} heads",
                    f"a divisor of {self.num_heads}",
                    "pick a tensor-parallel size that divides the head count",
                )
            )
        return self.num_heads // tp


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def facts_from_hf_config(cfg: Any, *, name: str, registry: Registry) -> ModelFacts:
    """Read arch, heads and index top-k from a HF config dict or ``PretrainedConfig``.

    Missing ``index_topk`` falls back to the matched profile's value (older exports omit it).
    """
    archs = _get(cfg, "architectures") or []
    if not archs:
        raise ConfigError(format_error(f"{name}: config has no 'architectures'", "a HF config.json", "point at the model's config"))
    arch = archs[0]
    profile = registry.by_arch.get(arch)
    heads = _get(cfg, "num_attention_heads") or (profile.num_heads if profile else None)
    topk = _get(cfg, "index_topk") or (profile.index_topk if profile else None)
    return ModelFacts(arch=arch, name=name, num_heads=int(heads or 0), index_topk=int(topk or 0))


def resolve_model(spec: str, *, registry: Registry) -> ModelFacts:
    """A built-in/plugin profile name or alias, a model directory, or a ``config.json`` path."""
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(format_error(f"--model {spec}: {exc}", "a readable HF config.json", "fix the path")) from None
        return facts_from_hf_config(cfg, name=spec, registry=registry)
    profile = registry.profile_for(spec)
    if profile is None:
        names = sorted({p.name for p in registry.profiles.values()} | {a for p in registry.profiles.values() for a in p.aliases})
        raise ConfigError(
            format_error(
                f"--model {spec!r} is neither a profile name nor a path to a config.json",
                f"a model directory, a config.json, or one of {names}",
                "pass a local model directory or a listed name",
            )
        )
    return ModelFacts(arch=profile.architectures[0], name=spec, num_heads=profile.num_heads, index_topk=profile.index_topk)
