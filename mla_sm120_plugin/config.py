"""Plugin config: defaults, a TOML file, and vLLM's ``--additional-config``; per-model sections.

Schema (the same keys at top level and in every section)::

    prefill_kernel  = "auto" | <kernel name>
    decode_kernel   = "auto" | <kernel name>
    kv_scale_format = "auto" | "pow2" | "arbitrary"
    precision       = "fast" | "exact"   # exact: no kernel that rounds q or p to fp8

    [models."zai-org/GLM-5-FP8"]      # exact served model name (or path) ...
    decode_kernel = "triton_sparse_mla"
    [models."deepseek-ai/*"]          # ... or an fnmatch glob (first match in file order)
    kv_scale_format = "pow2"
    [architectures.GlmMoeDsaForCausalLM]   # ... or the HF architecture
    prefill_kernel = "flashinfer_sparse_mla"

The inline form (``--additional-config '{"mla_sm120": {...}}'``) takes the same keys plus
``config_file``. Strongest first: the inline dict, the file it names (else the one
``MLA_SM120_CONFIG`` names), then defaults. Within one source, a model section beats an
architecture section beats the top level. Everything is validated before anything is used:
a config either applies whole or raises :class:`~mla_sm120_plugin.errors.ConfigError`.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from . import envs, files
from .errors import ConfigError, format_error
from .kernels.dsa.layout import SCALE_FORMATS
from .types import AUTO, ENGINE_NATIVE_IMPLS, FAST, PRECISIONS

CONFIG_ENV = envs.CONFIG
ADDITIONAL_CONFIG_KEY = "mla_sm120"  # the key under vLLM's --additional-config

KERNEL_KEYS = ("prefill_kernel", "decode_kernel")
SETTING_KEYS = KERNEL_KEYS + ("kv_scale_format", "precision")
SECTION_KEYS = ("models", "architectures")
INLINE_ONLY_KEYS = ("config_file",)


@dataclass(frozen=True)
class Settings:
    """The resolved settings for one model, with where each value came from."""

    prefill_kernel: str = AUTO
    decode_kernel: str = AUTO
    kv_scale_format: str = AUTO
    precision: str = FAST
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)

    def origin(self, key: str) -> str:
        return self.origins.get(key, "default")

    def forced_by(self) -> str:
        """Where each forced kernel came from, for selection errors (``"config"`` if none is forced)."""
        return ", ".join(
            f"{k} from {self.origin(k)}" for k in KERNEL_KEYS if getattr(self, k) != AUTO
        ) or "config"


@dataclass(frozen=True)
class _Layer:
    """One source (file or inline dict), validated."""

    label: str
    top: Mapping[str, str]
    models: tuple[tuple[str, Mapping[str, str]], ...]
    architectures: Mapping[str, Mapping[str, str]]

    def matches(self, model_name: str | None, arch: str | None) -> list[tuple[str, Mapping[str, str]]]:
        """Matching sections, weakest first: top level, architecture, glob, exact name."""
        found: list[tuple[str, Mapping[str, str]]] = [(self.label, self.top)]
        if arch and arch in self.architectures:
            found.append((f"{self.label} [architectures.{arch}]", self.architectures[arch]))
        if model_name:
            exact = dict(self.models).get(model_name)
            glob = next(
                ((pat, sec) for pat, sec in self.models if _is_glob(pat) and fnmatch.fnmatchcase(model_name, pat)),
                None,
            )
            if glob is not None:
                found.append((f"{self.label} [models.{glob[0]!r}]", glob[1]))
            if exact is not None:
                found.append((f"{self.label} [models.{model_name!r}]", exact))
        return found


@dataclass(frozen=True)
class PluginConfig:
    """A validated plugin config: resolve it per model with :meth:`for_model`."""

    layers: tuple[_Layer, ...] = ()  # weakest first

    @property
    def sources(self) -> list[str]:
        return [layer.label for layer in self.layers]

    def for_model(self, model_name: str | None, arch: str | None) -> Settings:
        """Settings for one model: every layer's matching sections, strongest last."""
        values: dict[str, str] = {}
        origins: dict[str, str] = {}
        for layer in self.layers:
            for label, section in layer.matches(model_name, arch):
                for key, value in section.items():
                    values[key] = value
                    origins[key] = label
        return Settings(**values, origins=origins)


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _err(where: str, given: str, supported: str, fix: str) -> ConfigError:
    return ConfigError(format_error(f"{where}: {given}", supported, fix))


def _check_section(
    section: Any, where: str, kernel_names: Iterable[str], *, allow: tuple[str, ...]
) -> dict[str, str]:
    if not isinstance(section, Mapping):
        raise _err(where, f"{type(section).__name__} {section!r:.60}", "a table/dict of settings", "write it as a table")
    kernel_choices = sorted({AUTO, *kernel_names})
    out: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str) or key not in SETTING_KEYS + allow:
            raise _err(
                where, f"unknown key {key!r}", f"keys {list(SETTING_KEYS + allow)}", "remove or correct the key"
            )
        if key in allow:
            continue
        if not isinstance(value, str):
            raise _err(where, f"{key}={value!r} ({type(value).__name__})", "a string", f'quote it: {key} = "..."')
        if key in KERNEL_KEYS and value not in kernel_choices and value not in ENGINE_NATIVE_IMPLS:
            raise _err(where, f"{key}={value!r} is not a known kernel", f"one of {kernel_choices}", "correct the name")
        if key == "kv_scale_format" and value not in (AUTO, *SCALE_FORMATS):
            raise _err(where, f"{key}={value!r}", f"one of {[AUTO, *SCALE_FORMATS]}", "correct the value")
        if key == "precision" and value not in PRECISIONS:
            raise _err(where, f"{key}={value!r}", f"one of {list(PRECISIONS)}", "correct the value")
        out[key] = value
    return out


def _check_layer(data: Any, label: str, kernel_names: Iterable[str], *, inline: bool) -> _Layer:
    names = list(kernel_names)
    allow = SECTION_KEYS + (INLINE_ONLY_KEYS if inline else ())
    top = _check_section(data, label, names, allow=allow)
    models: list[tuple[str, Mapping[str, str]]] = []
    archs: dict[str, Mapping[str, str]] = {}
    for kind in SECTION_KEYS:
        table = data.get(kind, {})
        if not isinstance(table, Mapping):
            raise _err(label, f"{kind} = {table!r:.60}", f"a table of [{kind}.<name>] sections", f"write [{kind}.\"<name>\"]")
        for name, section in table.items():
            where = f"{label} [{kind}.{name!r}]"
            if not isinstance(name, str) or not name:
                raise _err(label, f"{kind} section name {name!r}", "a non-empty string", "name the section")
            checked = _check_section(section, where, names, allow=())
            if kind == "models":
                models.append((name, checked))
            else:
                archs[name] = checked
    if inline and "config_file" in data and not isinstance(data["config_file"], str):
        raise _err(label, f"config_file={data['config_file']!r}", "a path string", "give the TOML file's path")
    return _Layer(label, top, tuple(models), archs)


def _read_toml(path: str, named_by: str) -> Any:
    """The TOML file ``named_by`` names: a regular file, bounded in size and nesting (see :mod:`.files`)."""
    return files.read_toml(path, label=f"{named_by}={files.short_repr(path, limit=300)}")


def load_config(
    inline: Mapping[str, Any] | None = None,
    *,
    kernel_names: Iterable[str],
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
    inline_label: str = f"--additional-config {ADDITIONAL_CONFIG_KEY}",
) -> PluginConfig:
    """Read and validate every config source.

    :param inline: the ``mla_sm120`` dict of vLLM's ``additional_config`` (or the CLI's flags).
    :param kernel_names: registered kernel names (valid values of the kernel keys).
    :param env: environment to read ``MLA_SM120_CONFIG`` from; ``os.environ`` by default.
    :param config_file: a file named on the command line; beats the environment.
    :param inline_label: how messages name the inline source.
    :returns: the validated config.
    :raises ConfigError: any source is unreadable or malformed; nothing is applied then.
    """
    env = os.environ if env is None else env
    names = list(kernel_names)
    layers: list[_Layer] = []
    inline_layer = None
    if inline is not None:
        inline_layer = _check_layer(inline, inline_label, names, inline=True)
    path, named_by = None, None
    if inline is not None and inline.get("config_file"):
        path, named_by = inline["config_file"], f"{ADDITIONAL_CONFIG_KEY}.config_file"
    elif config_file:
        path, named_by = config_file, "--config"
    elif env.get(CONFIG_ENV):
        path, named_by = env[CONFIG_ENV], CONFIG_ENV
    if path is not None:
        layers.append(_check_layer(_read_toml(path, named_by), path, names, inline=False))
    if inline_layer is not None:
        layers.append(inline_layer)
    return PluginConfig(tuple(layers))
