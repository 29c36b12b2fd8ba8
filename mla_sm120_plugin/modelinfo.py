"""The facts about a model the selection needs, read from a HF config (dict or object).

One reader for every caller: the CLI (a ``config.json`` on disk or a built-in profile name)
and the vLLM backend (``ModelConfig.hf_config``), so both see the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from . import files
from .errors import ConfigError, UnsupportedConfiguration, format_error
from .hooks.manager import Registry
from .families.dsv4 import NAME as DSV4_FAMILY
from .types import DEFAULT_FAMILY, LAYER_COUNTS_UNKNOWN, ModelProfile

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


# DeepSeek-V4 (docs/facts.md#deepseek-v4). Layer types of transformers' DeepseekV4Config and the legacy per-layer
# compress_ratios they map from; V4.1 keeps a flat per-layer compress_ratios of 0 / 1 / 2.
DSV4_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DSV4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DSV4_RATIOS = (0, 4, 128)
DSV41_RATIOS = (0, 1, 2)
DSV41_ARCHS = ("DeepseekV41ForCausalLM", "DSparkV41DraftModel")
DSV41_MODEL_TYPE = "deepseek_v41"
MAX_LAYERS = 1024
MAX_WINDOW = 1 << 16
# Every DeepSeek-V4 attention row: q = K = V = 512 values, 64 of them rope.
DSV4_HEAD_DIM = 512
DSV4_ROPE_DIM = 64


@dataclass(frozen=True)
class Dsv4Geometry:
    """What a DeepSeek-V4 model's attention calls depend on, read from its config.

    :param version: ``"v4"`` (V4-Flash, V4-Pro) or ``"v4.1"`` (V4.1-Flash).
    :param ratios: compress ratio of each attention layer, the draft (MTP) layers last: 0 window
        only; V4: 4 (C4A: the indexer's top-k of 4-token entries) or 128 (C128A: every 128-token
        entry); V4.1: 1 or 2.
    :param draft_layers: how many of ``ratios`` are draft (MTP) layers.
    :param sliding_window: tokens of a layer's window.
    :param o_groups: output-projection groups (each rank needs at least one).
    :param head_dim: q/K/V width (512).
    :param qk_rope_head_dim: the rope part of it (64).
    :param vision_tokens: how far the vision variant widens prefill window rows (0: none).
    :param max_model_len: the longest context (``max_position_embeddings``): bounds C128A's rows.
    :param layers_known: ``ratios`` are the model's layers (False: a built-in profile that lists
        each layer kind once, the model's own list being in its config.json only).
    """

    version: str
    ratios: tuple[int, ...]
    draft_layers: int
    sliding_window: int
    o_groups: int
    head_dim: int = DSV4_HEAD_DIM
    qk_rope_head_dim: int = DSV4_ROPE_DIM
    vision_tokens: int = 0
    max_model_len: int = 1 << 20
    layers_known: bool = True

    def layer_counts(self) -> dict[int, int]:
        """Compress ratio -> how many layers have it, in first-seen order."""
        counts: dict[int, int] = {}
        for ratio in self.ratios:
            counts[ratio] = counts.get(ratio, 0) + 1
        return counts


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
    :param dsv4: a DeepSeek-V4 model's layer geometry; None for a DSA model.
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
    dsv4: Dsv4Geometry | None = None
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


def _flag(cfg: Any, key: str, where: str, fallback: bool) -> bool:
    """A true/false field; absent: ``fallback`` (the matched profile's)."""
    value = _get(cfg, key)
    if value is _ABSENT:
        return fallback
    if not isinstance(value, bool):
        raise _bad_value(where, key, value, "true or false (a JSON boolean)", f"set {key} to the model's true or false")
    return value


def _list_of(cfg: Any, key: str, where: str, item_ok: Callable[[Any], bool], supported: str, fix: str, *,
             least: int = 0) -> list[Any] | None:
    """A list field of ``least`` to :data:`MAX_LAYERS` items, each ``item_ok``; None when absent.

    :raises ConfigError: another type, length or item (``supported`` says what is accepted).
    """
    value = _get(cfg, key)
    if value is _ABSENT:
        return None
    if not isinstance(value, (list, tuple)) or not least <= len(value) <= MAX_LAYERS or not all(map(item_ok, value)):
        raise _bad_value(where, key, value, supported, fix)
    return list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(cfg: Any, key: str, where: str, allowed: tuple[int, ...], fix: str) -> list[int] | None:
    return _list_of(cfg, key, where, lambda v: _is_int(v) and v in allowed,
                    f"a non-empty list (at most {MAX_LAYERS}) of ints from {list(allowed)}", fix, least=1)


def _dsv4_ratios(cfg: Any, where: str, version: str, layers: int, draft: int) -> list[int]:
    """Each attention layer's compress ratio (drafts last), the way the engines read them."""
    if version == "v4.1":
        # V4.1: one flat list over every layer, the draft's included (vLLM's DeepseekV41Config).
        ratios = _int_list(cfg, "compress_ratios", where, DSV41_RATIOS,
                           "set compress_ratios to the model's per-layer list (0 window, 1 or 2 compressed)")
        if ratios is None:
            raise ConfigError(format_error(f"{where}: a DeepSeek-V4.1 config without compress_ratios",
                                           "a per-layer compress_ratios list (0 / 1 / 2), the draft layers included",
                                           "point at the model's own config.json"))
        return ratios
    fix = "point at the model's own config.json, or correct layer_types / compress_rates in it"
    rates = _get(cfg, "compress_rates")
    if rates is _ABSENT:
        rates = dict(DSV4_DEFAULT_RATES)
    elif (not isinstance(rates, dict) or not set(rates) <= set(DSV4_DEFAULT_RATES)
          or not all(isinstance(v, int) and not isinstance(v, bool) and v in DSV4_RATIOS[1:] for v in rates.values())):
        raise _bad_value(where, "compress_rates", rates,
                         f"a mapping of {sorted(DSV4_DEFAULT_RATES)} to {list(DSV4_RATIOS[1:])}", fix)
    types = _get(cfg, "layer_types")
    if types is _ABSENT:
        legacy = _int_list(cfg, "compress_ratios", where, DSV4_RATIOS, fix)
        if legacy is not None:
            reverse = {ratio: name for name, ratio in DSV4_LAYER_TYPES.items()}
            types = [reverse[r] for r in legacy]
        else:  # transformers' default: two C128A layers, then C128A / C4A alternating
            types = (["heavily_compressed_attention"] * min(layers, 2)
                     + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(layers - 2, 0))])
    elif (not isinstance(types, (list, tuple)) or not 0 < len(types) <= MAX_LAYERS
          or not all(isinstance(t, str) and t in DSV4_LAYER_TYPES for t in types)):
        raise _bad_value(where, "layer_types", types, f"a list of {list(DSV4_LAYER_TYPES)}", fix)
    if len(types) < layers:
        raise ConfigError(format_error(f"{where}: {len(types)} layer types for num_hidden_layers={layers}",
                                       "one layer type (or compress ratio) per hidden layer", fix))
    ratios = [0 if t == "sliding_attention" else rates.get(t, DSV4_DEFAULT_RATES[t]) for t in types[:layers]]
    return ratios + [0] * draft  # draft (MTP) layers attend their window only


def dsv4_geometry(cfg: Any, *, where: str, version: str) -> Dsv4Geometry:
    """A DeepSeek-V4 config's layer geometry (:class:`Dsv4Geometry`), type- and range-checked.

    V4 reads ``layer_types`` + ``compress_rates`` (or the legacy per-layer ``compress_ratios``,
    or transformers' default pattern), V4.1 its flat ``compress_ratios``; both read
    ``sliding_window``, ``o_groups``, ``head_dim`` (must be 512), ``qk_rope_head_dim`` (64) and
    the vision variant's ``vision_max_n_token``.

    :raises ConfigError: a key of the wrong type or range, or a layer list shorter than the layers.
    """
    layers = _count(cfg, "num_hidden_layers", MAX_LAYERS, where, None, "")
    # Absent: transformers' default, one MTP layer.
    draft = 1 if _get(cfg, "num_nextn_predict_layers") is _ABSENT else _count(
        cfg, "num_nextn_predict_layers", MAX_LAYERS, where, None, "", least=0)
    if layers == 0:
        raise ConfigError(format_error(f"{where}: a DeepSeek-V4 config without num_hidden_layers",
                                       "num_hidden_layers: the model's layer count", "point at the model's own config.json"))
    ratios = _dsv4_ratios(cfg, where, version, layers, draft)
    if version == "v4.1":
        draft = max(len(ratios) - layers, 0)
    head_dim = _count(cfg, "head_dim", MAX_HEAD_WIDTH, where, None, "") or DSV4_HEAD_DIM
    rope = _get(cfg, "qk_rope_head_dim")
    rope = DSV4_ROPE_DIM if rope is _ABSENT else _count(cfg, "qk_rope_head_dim", MAX_HEAD_WIDTH, where, None, "", 0)
    vision = 0
    if version == "v4" and (_count(cfg, "vision_n_layers", MAX_LAYERS, where, None, "", 0) or 0) > 0:
        vision = _count(cfg, "vision_max_n_token", MAX_WINDOW, where, None, "", 0)
    return Dsv4Geometry(
        version=version, ratios=tuple(ratios), draft_layers=draft,
        sliding_window=_count(cfg, "sliding_window", MAX_WINDOW, where, None, "") or 128,
        o_groups=_count(cfg, "o_groups", MAX_HEADS, where, None, "") or 8,
        head_dim=head_dim, qk_rope_head_dim=rope, vision_tokens=vision,
        max_model_len=_count(cfg, "max_position_embeddings", MAX_INDEX_TOPK * 64, where, None, "") or (1 << 20),
        layers_known=_get(cfg, LAYER_COUNTS_UNKNOWN) is _ABSENT,
    )


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
    dsv4 = None
    if profile is not None and profile.family == DSV4_FAMILY:
        # SGLang renames V4.1's architecture to V4's and keeps model_type deepseek_v41.
        v41 = arch in DSV41_ARCHS or _get(cfg, "model_type") == DSV41_MODEL_TYPE
        dsv4 = dsv4_geometry(cfg, where=where, version="v4.1" if v41 else "v4")
    return ModelFacts(arch=arch, name=name, num_heads=heads, index_topk=topk, index_kpool=kpool, dsv4=dsv4, sinks=sinks,
                      dense_layers=dense, family=profile.family if profile is not None else DEFAULT_FAMILY,
                      **geometry)


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
