"""The facts about a model the selection needs, read from a HF config (dict or object).

One reader for every caller: the CLI (a ``config.json`` on disk or a built-in profile name)
and the vLLM backend (``ModelConfig.hf_config``), so both see the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import families, files
from .errors import ConfigError, UnsupportedConfiguration, format_error
from .hfconfig import (ABSENT as _ABSENT, MAX_HEAD_WIDTH, MAX_HEADS, MAX_INDEX_TOPK, MAX_LAYERS, bad_value as _bad_value,
                       count as _count, flag as _flag, get as _get, is_int as _is_int, list_of as _list_of)
from .hooks.manager import Registry
from .types import DEFAULT_FAMILY, ModelProfile

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
    :param index_kpool: indexer keys pooled per top-k pick (1: none).
    :param geometry: what the model's family reads of its own config keys (a family with several call
        shapes: its layers' geometry, :meth:`~mla_sm120_plugin.families.base.Family.config_geometry`);
        None where the family reads none.
    :param sinks: the attention carries a learned sink logit per head (the config's
        ``learnable_sink``; absent: the profile's).
    :param dense_layers: MLA layers the model builds dense, without an indexer (Kimi K3.1's MLA
        layers outside ``dsa_config.dsa_layers``); 0 when none, or when the config does not list them.
    :param family: the model family (the matched profile's; :data:`~mla_sm120_plugin.types.DEFAULT_FAMILY`
        without one), a key of :data:`mla_sm120_plugin.families.FAMILIES`."""

    arch: str
    name: str
    num_heads: int
    index_topk: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    index_kpool: int = 1
    geometry: Any = None
    sinks: bool = False
    dense_layers: int = 0
    family: str = DEFAULT_FAMILY

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


def _dsa_config(cfg: Any, where: str) -> Any:
    """Kimi K3.1's nested ``dsa_config`` (a dict in config.json, an object in vLLM's config), or None."""
    value = _get(cfg, "dsa_config")
    if value is _ABSENT:
        return None
    if isinstance(value, (str, int, float, bool, list, tuple)):
        raise _bad_value(where, "dsa_config", value, "an object of indexer settings (dsa_layers, index_topk, ...)",
                         "set dsa_config to the model's own object, or remove it")
    return value


def _layer_ids(cfg: Any, key: str, where: str, layers: int) -> set[int] | None:
    """A list of 1-based layer numbers (Kimi's ``dsa_layers``, ``kda_layers``), or None when absent."""
    ids = _list_of(cfg, key, where, lambda v: _is_int(v) and 1 <= v <= layers,
                   f"a list of layer numbers from 1 to {layers} (num_hidden_layers)", f"set {key} to the model's own list")
    return None if ids is None else set(ids)


def _dense_mla_layers(cfg: Any, dsa_config: Any, where: str) -> int:
    """Kimi K3.1's MLA layers outside ``dsa_config.dsa_layers`` (vLLM builds them dense): the layers
    that are neither linear (``linear_attn_config.kda_layers``) nor DSA; 0 when the config does not
    say (no layer count or no ``dsa_layers``)."""
    layers = _count(cfg, "num_hidden_layers", MAX_LAYERS, where, None, "", 0)
    sparse = _layer_ids(dsa_config, "dsa_layers", f"{where}: dsa_config", layers) if layers else None
    if sparse is None:
        return 0
    linear_config = _get(cfg, "linear_attn_config")
    linear = (_layer_ids(linear_config, "kda_layers", f"{where}: linear_attn_config", layers)
              if isinstance(linear_config, dict) else None) or set()
    return sum(1 for layer in range(1, layers + 1) if layer not in linear and layer not in sparse)


def _per_layer_lists(cfg: Any, where: str) -> None:
    """Mistral Large 4's per-layer lists, checked for their types: ``nope_layer_flags`` (true: a NoPE
    layer) and ``index_sharing`` (``"full"``: the layer runs its own indexer; another value: it
    reuses an earlier indexer's top-k)."""
    _list_of(cfg, "nope_layer_flags", where, lambda v: isinstance(v, bool),
             f"a list (at most {MAX_LAYERS}) of true/false, one a layer",
             "set nope_layer_flags to the model's per-layer list, or remove it")
    _list_of(cfg, "index_sharing", where, lambda v: isinstance(v, str) and bool(v),
             f'a list (at most {MAX_LAYERS}) of strings, one a layer ("full": the layer runs its own indexer)',
             "set index_sharing to the model's per-layer list, or remove it")


def _flat_text_config(cfg: Any) -> Any:
    """A multimodal config (V4.1, Kimi K3.1, GLM-5.3-Flash) nests the text model under ``text_config``;
    the engines read it flattened (a top-level key wins)."""
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        return {**cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"}}
    return cfg


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
    cfg = _flat_text_config(cfg)
    heads = _count(cfg, "num_attention_heads", MAX_HEADS, where, profile, "num_heads")
    topk = _count(cfg, "index_topk", MAX_INDEX_TOPK, where, profile, "index_topk")
    dsa_config = _dsa_config(cfg, where)
    dense = 0
    if dsa_config is not None:
        if _get(cfg, "index_topk") is _ABSENT:
            # Kimi K3.1 keeps its indexer's settings in dsa_config (vLLM copies index_topk up).
            topk = _count(dsa_config, "index_topk", MAX_INDEX_TOPK, f"{where}: dsa_config", profile, "index_topk")
        dense = _dense_mla_layers(cfg, dsa_config, where)
    _flag(cfg, "mla_use_nope", where, False)
    _per_layer_lists(cfg, where)
    geometry = {key: _count(cfg, key, MAX_HEAD_WIDTH, where, profile, key, least) for key, least in GEOMETRY_KEYS.items()}
    # Absent with no profile: no pooling (1), the same as every DSA model before GLM-5.3-Flash.
    kpool = _count(cfg, "index_kpool", MAX_KPOOL, where, profile, "index_kpool") or 1
    sinks = _flag(cfg, "learnable_sink", where, profile is not None and profile.sinks)
    # Read for their types only: the output gate is the model's, outside the attention call, and a
    # draft layer is planned as the model's own layers.
    _flag(cfg, "gated_mla", where, False)
    _count(cfg, "num_nextn_predict_layers", MAX_LAYERS, where, None, "", 0)
    family = profile.family if profile is not None else DEFAULT_FAMILY
    own = families.get(family).config_geometry(cfg, arch=arch, where=where)  # the family's own keys
    return ModelFacts(arch=arch, name=name, num_heads=heads, index_topk=topk, index_kpool=kpool, geometry=own,
                      sinks=sinks, dense_layers=dense, family=family, **geometry)


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
        names = sorted({p.name for p in registry.profiles.values()} | {a for p in registry.profiles.values() for a in p.aliases}
                       | {n for p in registry.profiles.values() for n in p.model_configs if "/" not in n})
        raise ConfigError(
            format_error(
                f"--model {files.short_repr(spec, limit=300)} is neither a profile name nor a path to a config.json",
                f"a model directory, a config.json, or one of {names}",
                "pass a local model directory or a listed name",
            )
        )
    if profile.model_configs:
        cfg = profile.model_configs.get(spec.lower()) or next(iter(profile.model_configs.values()))
        return facts_from_hf_config(dict(cfg), name=spec, registry=registry, source=f"the built-in config of {spec}")
    return ModelFacts(arch=profile.architectures[0], name=spec, num_heads=profile.num_heads, index_topk=profile.index_topk,
                      kv_lora_rank=profile.kv_lora_rank, qk_rope_head_dim=profile.qk_rope_head_dim,
                      index_kpool=profile.index_kpool, sinks=profile.sinks, family=profile.family)
