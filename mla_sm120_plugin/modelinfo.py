"""The facts about a model the selection needs, read from a HF config (dict or object).

One reader for every caller: the CLI (a ``config.json`` on disk or a built-in profile name)
and the vLLM backend (``ModelConfig.hf_config``), so both see the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import files
from .errors import ConfigError, UnsupportedConfiguration, format_error
from .hooks.manager import Registry
from .types import ModelProfile

# Bounds on what a config may claim; above them the value is a typo or a corrupted file, not a model.
# The largest MLA models have 128 heads (DeepSeek-V3/V3.2; GLM-5 has 64): 1024 leaves 8x headroom.
MAX_HEADS = 1024
# Known DSA models pick 2048 tokens per query, and a top-k above the context length selects nothing
# more: 1 << 20 (1M tokens) is above any context served today, yet small enough that sizes derived
# from it (top-k x 656 cache bytes per query) stay ordinary numbers.
MAX_INDEX_TOPK = 1 << 20


# Bounds on the MLA widths a config may claim (the DSA models have 512/64/128-192/128-256; GLM-5.3-Flash
# has rope 0). Outside them the value is a typo or a corrupted file. The kernels' own widths are the
# layout's; the policy refuses a model whose cache rows would not be those.
MAX_HEAD_WIDTH = 1 << 16

# Indexer keys pooled per pick: GLM-5.3-Flash pools 4; more than a page's 64 would be no index.
MAX_KPOOL = 64

# The geometry keys of an MLA config: the least value each may take (rope may be 0: NoPE models).
GEOMETRY_KEYS = {"kv_lora_rank": 1, "qk_rope_head_dim": 0, "qk_nope_head_dim": 0, "v_head_dim": 1}


@dataclass(frozen=True)
class ModelFacts:
    """:param arch: HF ``architectures[0]``. :param name: what the user called it.
    :param num_heads: attention heads before tensor parallelism; 0 when the config omits it and no
        profile serves ``arch`` (the selection then refuses the architecture).
    :param index_topk: indexer top-k; 0 in the same case.
    :param kv_lora_rank: latent width, the config's or the profile's (0 when neither says).
    :param qk_rope_head_dim: RoPE width, the same way.
    :param qk_nope_head_dim: the non-rope q/k width per head (enters only the engine's projections
        and softmax scale; read and type-checked, not served on).
    :param v_head_dim: the value width per head (likewise).
    :param index_kpool: indexer keys pooled per top-k pick (1: none)."""

    arch: str
    name: str
    num_heads: int
    index_topk: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    index_kpool: int = 1

    def heads_per_rank(self, tp: int) -> int:
        """Heads on one GPU at tensor-parallel size ``tp``.

        :raises ConfigError: ``tp`` is not an int >= 1.
        :raises UnsupportedConfiguration: ``tp`` does not divide the heads.
        """
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(
                format_error(f"tensor_parallel_size={files.short_repr(tp)} ({type(tp).__name__})",
                             "an int >= 1 that divides the head count", "pass the tensor-parallel size as a positive int")
            )
        if self.num_heads % tp:
            raise UnsupportedConfiguration(
                format_error(
                    f"tensor_parallel_size={tp} for {self.name} with {self.num_heads} heads",
                    f"a divisor of {self.num_heads}",
                    "pick a tensor-parallel size that divides the head count",
                )
            )
        return self.num_heads // tp


_ABSENT = object()


def _get(cfg: Any, key: str) -> Any:
    """``cfg[key]`` for a dict (a present null is a value, and wrong); ``cfg.key`` for a
    ``PretrainedConfig``-like object (None is how those say absent)."""
    if isinstance(cfg, dict):
        return cfg.get(key, _ABSENT)
    value = getattr(cfg, key, None)
    return _ABSENT if value is None else value


def _bad_value(where: str, key: str, value: Any, supported: str, fix: str) -> ConfigError:
    return ConfigError(format_error(f"{where}: {key}={files.short_repr(value)} ({type(value).__name__})", supported, fix))


def _architectures(cfg: Any, where: str) -> tuple[str, ...]:
    archs = _get(cfg, "architectures")
    if archs is _ABSENT:
        raise ConfigError(format_error(f"{where}: config has no 'architectures'", "a HF config.json",
                                       "point at the model's config"))
    if (
        not isinstance(archs, (list, tuple))
        or not archs
        or not all(isinstance(a, str) and a for a in archs)
    ):
        raise _bad_value(where, "architectures", archs, 'a non-empty list of non-empty strings, e.g. ["GlmMoeDsaForCausalLM"]',
                         "point at the model's own config.json, or correct 'architectures' in it")
    return tuple(archs)


def _count(cfg: Any, key: str, bound: int, where: str, profile: ModelProfile | None, attr: str,
           least: int = 1) -> int:
    """An int field in ``[least, bound]``; absent: the matched ``profile``'s ``attr``, else 0 (see
    :class:`ModelFacts`)."""
    fallback = getattr(profile, attr, None) if profile is not None else None
    value = _get(cfg, key)
    if value is _ABSENT:
        return fallback or 0
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= bound:
        profile_hint = f", or remove it to use the {profile.name} profile's {fallback}" if fallback is not None else ""
        raise _bad_value(where, key, value, f"an integer from {least} to {bound} (not a bool, float or string)",
                         f"set {key} to the model's value{profile_hint}")
    return value


def facts_from_hf_config(cfg: Any, *, name: str, registry: Registry, source: str | None = None) -> ModelFacts:
    """Read arch, heads, index top-k and the MLA widths from a HF config dict or ``PretrainedConfig``.

    A missing ``num_attention_heads``, ``index_topk`` or width (:data:`GEOMETRY_KEYS`) falls back
    to the matched profile's value (older exports omit ``index_topk``); a present one must be an
    int within its bounds. For an object, a None attribute counts as missing.

    :param source: how messages name the config (the file's path); ``name``'s HF config by default.
    :raises ConfigError: no or malformed ``architectures``; a present count of the wrong type or range.
    """
    where = source or f"HF config of {name}"
    arch = _architectures(cfg, where)[0]
    profile = registry.by_arch.get(arch)
    heads = _count(cfg, "num_attention_heads", MAX_HEADS, where, profile, "num_heads")
    topk = _count(cfg, "index_topk", MAX_INDEX_TOPK, where, profile, "index_topk")
    geometry = {key: _count(cfg, key, MAX_HEAD_WIDTH, where, profile, key, least) for key, least in GEOMETRY_KEYS.items()}
    # Absent with no profile: no pooling (1), the same as every DSA model before GLM-5.3-Flash.
    kpool = _count(cfg, "index_kpool", MAX_KPOOL, where, profile, "index_kpool") or 1
    return ModelFacts(arch=arch, name=name, num_heads=heads, index_topk=topk, index_kpool=kpool, **geometry)


def _facts_from_file(spec: str, path: str, registry: Registry) -> ModelFacts:
    label = f"--model {files.short_repr(spec, limit=300)}" + ("" if path == spec else f" ({path})")
    cfg = files.read_json(path, label=label)
    if not isinstance(cfg, dict):
        raise ConfigError(format_error(f"{label}: the top level is a JSON {type(cfg).__name__}", "a HF config.json: a JSON object",
                                       "point at the model's config.json"))
    return facts_from_hf_config(cfg, name=spec, registry=registry, source=path)


def resolve_model(spec: str, *, registry: Registry) -> ModelFacts:
    """A built-in/plugin profile name or alias, a model directory, or a ``config.json`` path.

    A path that exists wins over a profile of the same name, except a directory without a
    ``config.json``; a path that exists but is no readable regular file is refused, not guessed at.
    """
    files.check_path(spec, label=f"--model {files.short_repr(spec, limit=300)}", what=files.JSON_FILE)
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    profile = registry.profile_for(spec)
    if os.path.lexists(path) or (path != spec and profile is None):
        return _facts_from_file(spec, path, registry)
    if profile is None:
        names = sorted({p.name for p in registry.profiles.values()} | {a for p in registry.profiles.values() for a in p.aliases})
        raise ConfigError(
            format_error(
                f"--model {files.short_repr(spec, limit=300)} is neither a profile name nor a path to a config.json",
                f"a model directory, a config.json, or one of {names}",
                "pass a local model directory or a listed name",
            )
        )
    return ModelFacts(arch=profile.architectures[0], name=spec, num_heads=profile.num_heads, index_topk=profile.index_topk,
                      kv_lora_rank=profile.kv_lora_rank, qk_rope_head_dim=profile.qk_rope_head_dim,
                      index_kpool=profile.index_kpool)
