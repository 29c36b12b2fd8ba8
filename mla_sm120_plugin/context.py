"""One way from an engine's settings to a :class:`~mla_sm120_plugin.types.SelectionContext`.

``mla-sm120 check``, the vLLM adapter and any later engine adapter translate their own settings
into the same four inputs — model facts, plugin settings, device, engine limits — and call
:func:`build_context`, so the same deployment is decided from the same context everywhere.
Pure Python: nothing heavy is imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from . import config as config_mod
from . import engines as engines_mod
from . import families
from .errors import ConfigError, MlaSm120Error, format_error
from .kernels.dsa.layout import ROPE_DIM
from .modelinfo import ModelFacts
from .types import AUTO, DeviceInfo, SelectionContext


def kv_layout(engine_kv_cache_dtype: str | None, engine: str = "vllm", sm_family: int | None = None,
              rope: int = ROPE_DIM, sinks: bool = False, release: str | None = None) -> str:
    """The cache layout an engine's ``--kv-cache-dtype`` value gives a DSA model with a ``rope``-wide
    rope part under the engine's ``release`` (None: its oldest supported; None or ``auto`` as the
    value: the engine's default on a GPU of ``sm_family``, for a model with learned sinks where they
    differ)."""
    return engines_mod.lookup(engine, release).kv_layout(engine_kv_cache_dtype, sm_family, rope, sinks)


@dataclass(frozen=True)
class EngineLimits:
    """What the engine's scheduling and parallelism settings mean for the attention calls.

    :param tensor_parallel_size: ranks the heads are split over.
    :param max_decode_tokens: most query tokens one decode call sees (batch x (1 + speculative
        tokens)); None when unbounded or unknown.
    :param max_prefill_tokens: most query tokens one prefill call sees; None when unbounded.
    :param cuda_graphs: decode is captured in CUDA graphs.
    :param features: engine features switched on that change the cache or top-k path
        (``"hisparse"``, ``"pcp"``); see :data:`mla_sm120_plugin.rules.FEATURE_REASONS`.
    :param engine: whose spellings and flags apply (a key of :data:`mla_sm120_plugin.engines.ENGINES`).
    :param scale_format: how the engine's cache writer stores fp8 scales when that is the engine's
        fact rather than the model's; None: the engine's own (:attr:`Engine.scale_format`; None
        there too: the model's). An explicit ``kv_scale_format`` in the plugin config wins.
    :param release: the engine's release (a key of :data:`mla_sm120_plugin.engines.RELEASES`); None:
        its oldest supported one.
    :param decode_context_parallel_size: ranks of the TP group the cache is sharded over by token
        (vLLM's ``--decode-context-parallel-size``, SGLang's ``--dcp-size``); it divides the TP size.
    :param cp_kv_cache_interleave_size: consecutive tokens one DCP rank owns before the next's (vLLM's
        ``--cp-kv-cache-interleave-size``).
    :raises UnsupportedConfiguration: a release the plugin does not support.
    :raises ConfigError: a size that is not a positive integer.
    """

    tensor_parallel_size: int = 1
    max_decode_tokens: int | None = None
    max_prefill_tokens: int | None = None
    cuda_graphs: bool = True
    features: frozenset[str] = field(default_factory=frozenset)
    engine: str = "vllm"
    scale_format: str | None = None
    release: str | None = None
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        sizes = ("tensor_parallel_size", "decode_context_parallel_size", "cp_kv_cache_interleave_size")
        for name in (*sizes, "max_decode_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is None and name not in sizes:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(format_error(f"{name}={value!r}", "a positive integer",
                                               f"set {name.replace('_', '-')} to 1 or more"))
        object.__setattr__(self, "features", frozenset(self.features))
        if self.engine not in engines_mod.ENGINES:
            raise ConfigError(format_error(f"engine={self.engine!r}", f"one of {list(engines_mod.ENGINES)}",
                                           "pass the engine the context is built for"))
        object.__setattr__(self, "release", engines_mod.lookup(self.engine, self.release).release)
        if self.scale_format is None:
            object.__setattr__(self, "scale_format", self.facts.scale_format)

    @property
    def facts(self) -> engines_mod.Engine:
        """The engine's facts at this release."""
        return engines_mod.lookup(self.engine, self.release)


def build_context(
    facts: ModelFacts,
    settings: config_mod.Settings,
    device: DeviceInfo,
    kv_cache_dtype: str | None,
    limits: EngineLimits,
) -> SelectionContext:
    """The selection context for one model on one device under one engine's settings.

    :param facts: the model's architecture, name, heads and index top-k (:mod:`.modelinfo`).
    :param settings: the plugin settings resolved for this model (:meth:`PluginConfig.for_model`).
    :param device: the device decided for.
    :param kv_cache_dtype: the engine's KV-cache dtype spelling (see :func:`kv_layout`).
    :param limits: the engine's parallelism and call-size limits.
    :returns: the context :func:`mla_sm120_plugin.selection.select` decides on (a DCP size that does not
        divide the TP size is the policy's refusal: :func:`mla_sm120_plugin.rules.dcp_refusals`).
    :raises UnsupportedConfiguration: the TP size does not divide the model's heads.
    """
    tp, dcp = limits.tensor_parallel_size, limits.decode_context_parallel_size
    return SelectionContext(
        model_arch=facts.arch,
        model_name=facts.name,
        kv_cache_dtype=families.of(facts).kv_layout(limits.facts, kv_cache_dtype, device, facts),
        kv_cache_dtype_given=None if kv_cache_dtype is None else str(kv_cache_dtype),
        engine=limits.engine,
        kv_lora_rank=facts.kv_lora_rank,
        qk_rope_head_dim=facts.qk_rope_head_dim,
        precision=settings.precision,
        # What one call sees: under DCP the engine gathers the heads of the DCP group.
        num_heads=facts.heads_per_rank(tp) * dcp,
        index_topk=limits.facts.index_width(facts.index_topk, facts.index_kpool),
        device=device,
        prefill_kernel=settings.prefill_kernel,
        decode_kernel=settings.decode_kernel,
        kv_scale_format=(settings.kv_scale_format if settings.kv_scale_format != AUTO or limits.scale_format is None
                         else limits.scale_format),
        max_decode_tokens=limits.max_decode_tokens,
        max_prefill_tokens=limits.max_prefill_tokens,
        cuda_graphs=limits.cuda_graphs,
        forced_by=settings.forced_by(),
        tensor_parallel_size=limits.tensor_parallel_size,
        features=limits.features,
        sinks=facts.sinks,
        family=facts.family,
        release=limits.release,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=limits.cp_kv_cache_interleave_size,
        index_kpool=facts.index_kpool,
        index_picks=facts.index_topk // max(facts.index_kpool, 1),
    )


# Plugin configs read in this process, by their sources: an engine asks once per layer and per
# worker start-up, the file is read and validated once.
_configs: dict[tuple[str, str | None, str | None], config_mod.PluginConfig] = {}


def plugin_config(
    inline: Mapping[str, Any] | None,
    *,
    kernel_names: Iterable[str],
    config_file: str | None = None,
    inline_label: str = f"--additional-config {config_mod.ADDITIONAL_CONFIG_KEY}",
) -> config_mod.PluginConfig:
    """:func:`mla_sm120_plugin.config.load_config`, read once per process for the same sources.

    :raises ConfigError: a source is unreadable or malformed (not cached: the next call retries).
    """
    names = tuple(kernel_names)
    inline_key = json.dumps(inline, sort_keys=True, default=repr) if inline is not None else None
    key = (f"{inline_key}|{inline_label}|{','.join(names)}", config_file, os.environ.get(config_mod.CONFIG_ENV))
    if key not in _configs:
        _configs[key] = config_mod.load_config(inline, kernel_names=names, config_file=config_file,
                                               inline_label=inline_label)
    return _configs[key]


def clear_config_cache() -> None:
    """Forget configs read so far (tests, or after editing the file in a long-lived process)."""
    _configs.clear()


def context_to_json(ctx: SelectionContext) -> str:
    """``ctx`` as JSON text, for an engine that decides in one process and runs in others
    (SGLang's launcher decides; its schedulers bind through the environment)."""
    fields = dataclasses.asdict(ctx)
    fields["features"] = sorted(ctx.features)
    return json.dumps(fields, sort_keys=True)


def context_from_json(text: str) -> SelectionContext:
    """The context :func:`context_to_json` wrote.

    :raises ConfigError: the text is not such a context (hand-edited or from another version).
    """
    try:
        fields = json.loads(text)
        fields["device"] = DeviceInfo(**fields["device"])
        fields["features"] = frozenset(fields["features"])
        fields["call"] = families.get(fields["family"]).call_from_json(fields.get("call"))
        return SelectionContext(**fields)
    except (ValueError, TypeError, KeyError, MlaSm120Error) as exc:
        raise ConfigError(format_error(f"a serialized selection context that does not parse ({type(exc).__name__}: "
                                       f"{exc})", "what context_to_json wrote, from this plugin version",
                                       "restart the engine so its launcher decides again")) from None
