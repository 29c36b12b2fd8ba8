"""The plugin manager: built-ins and entry-point plugins, loaded and checked alike.

:func:`get_registry` returns the flattened, validated view the selection uses; it is built
once per process (the first call loads entry points) and reused, so a selection costs
microseconds afterwards.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pluggy

from .. import envs
from ..errors import PluginError, format_error
from ..families import FAMILIES
from ..types import KernelSpec, ModelProfile, Refusal, SelectionContext
from . import specs
from .specs import ENTRY_POINT_GROUP, PROJECT_NAME

DISABLE_ENV = envs.DISABLE_PLUGINS

# Built-in hook modules, registered under these names exactly as an entry point would be.
BUILTIN_PLUGINS: Mapping[str, str] = {
    "mla_sm120.models": "mla_sm120_plugin.profiles",
    "mla_sm120.kernels": "mla_sm120_plugin.dispatch.catalog",
    "mla_sm120.policy": "mla_sm120_plugin.families",
}


@dataclass(frozen=True)
class Registry:
    """What all plugins registered, flattened, with who provided each item.

    :param kernels: kernel name -> spec, in registration order.
    :param profiles: profile name -> profile.
    :param by_arch: HF architecture -> profile.
    :param providers: ``("kernel"|"profile", name)`` -> provider label.
    :param plugins: plugin name -> provider label (``"builtin"`` or ``"dist 1.2 (entry point x)"``).
    :param blocked: plugin names blocked through ``MLA_SM120_DISABLE_PLUGINS``.
    :param load_seconds: entry-point plugin name -> seconds its import took (``doctor`` shows it).
    """

    pm: pluggy.PluginManager = field(repr=False)
    kernels: Mapping[str, KernelSpec]
    profiles: Mapping[str, ModelProfile]
    by_arch: Mapping[str, ModelProfile]
    providers: Mapping[tuple[str, str], str]
    plugins: Mapping[str, str]
    blocked: tuple[str, ...]
    load_seconds: Mapping[str, float] = field(default_factory=dict)

    def label(self, plugin_name: str) -> str:
        """Who provided a plugin: ``"builtin (module)"`` or ``"dist 1.2 (entry point ...)"``."""
        return self.plugins.get(plugin_name, plugin_name)

    def _call(self, impl: Any, hook_name: str, kwargs: Mapping[str, Any], expected: str) -> Any:
        """Call one implementation; any failure (``SystemExit`` too) becomes a PluginError naming it."""
        try:
            result = impl.function(**{name: kwargs[name] for name in impl.argnames})
            # Generators fail while they are consumed: consume them here, inside the blame.
            if result is not None and not isinstance(result, (str, bytes)) and hasattr(result, "__next__"):
                result = list(result)
            return result
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a plugin must not end the engine (SystemExit) or reach it raw
            raise _hook_error(self.label(impl.plugin_name), impl.plugin_name, hook_name,
                              f"raised {type(exc).__name__}: {exc}", expected) from exc

    def _impls(self, hook_name: str) -> list[Any]:
        # pluggy calls implementations in reverse registration order (tryfirst/trylast included).
        return [impl for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls())
                if not (impl.hookwrapper or impl.wrapper)]

    def validate(self, ctx: SelectionContext, profile: ModelProfile | None) -> list[tuple[str, Refusal]]:
        """Every ``mla_sm120_validate`` refusal of ``ctx``, with the label of the plugin behind it.

        :raises PluginError: an implementation raised, exited, or returned something other than
            an iterable of ``str`` / :class:`~mla_sm120_plugin.types.Refusal`; the message names it.
        """
        expected = "an iterable of reasons (str or mla_sm120_plugin.types.Refusal), or None"
        out: list[tuple[str, Refusal]] = []
        for impl in self._impls("mla_sm120_validate"):
            result = self._call(impl, "mla_sm120_validate", {"ctx": ctx, "profile": profile}, expected)
            if result is None:
                continue
            label = self.label(impl.plugin_name)
            if isinstance(result, (str, bytes)) or not hasattr(result, "__iter__"):
                raise _hook_error(label, impl.plugin_name, "mla_sm120_validate",
                                  f"returned {type(result).__name__} {result!r:.80}", expected)
            for item in result:
                if isinstance(item, str):
                    item = Refusal(item)
                if not isinstance(item, Refusal):
                    raise _hook_error(label, impl.plugin_name, "mla_sm120_validate",
                                      f"yielded {type(item).__name__} {item!r:.80}", expected)
                out.append((label, item))
        return out

    def select_override(self, ctx: SelectionContext, phase: str, candidates: Sequence[str]) -> str | None:
        """The first non-None ``mla_sm120_select`` answer for ``phase`` (pluggy's firstresult order).

        :raises PluginError: an implementation raised, exited, or answered with something other
            than None or one of ``candidates``; the message names it.
        """
        expected = f"None or one of the candidates {list(candidates)}"
        kwargs = {"ctx": ctx, "phase": phase, "candidates": tuple(candidates)}
        for impl in self._impls("mla_sm120_select"):
            result = self._call(impl, "mla_sm120_select", kwargs, expected)
            if result is None:
                continue
            if not isinstance(result, str) or result not in candidates:
                raise _hook_error(self.label(impl.plugin_name), impl.plugin_name, "mla_sm120_select",
                                  f"returned {result!r:.80} for {phase}", expected)
            return result
        return None

    def profile_for(self, name_or_arch: str) -> ModelProfile | None:
        """A profile by CLI name, alias or HF architecture (case-insensitive names)."""
        if name_or_arch in self.by_arch:
            return self.by_arch[name_or_arch]
        key = name_or_arch.lower()
        for profile in self.profiles.values():
            if key == profile.name or key in (a.lower() for a in profile.aliases) or key in profile.model_configs:
                return profile
        return None


def _hook_error(label: str, plugin_name: str, hook_name: str, what: str, expected: str) -> PluginError:
    return PluginError(
        format_error(
            f"plugin {label}, hook {hook_name} {what}",
            expected,
            f"fix or uninstall that plugin, or set {DISABLE_ENV}={plugin_name}",
        )
    )


def _blocked_names() -> tuple[str, ...]:
    raw = os.environ.get(DISABLE_ENV, "")
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def _provider_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    dist_name = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "unknown distribution"
    return f"{dist_name} (entry point {ep.name!r} = {ep.value!r})"


def _load_entry_points(pm: pluggy.PluginManager, labels: dict[str, str], seconds: dict[str, float]) -> None:
    # Entry points are loaded one by one, not with pm.load_setuptools_entrypoints, so that an
    # import failure can be pinned on the distribution that shipped it.
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.is_blocked(ep.name) or pm.has_plugin(ep.name):
            continue
        label = _provider_label(ep)
        start = time.perf_counter()
        try:
            plugin = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # any failure in third-party import code is the plugin's, exit too
            raise PluginError(
                format_error(
                    f"plugin {label} failed to import: {type(exc).__name__}: {exc}",
                    f"entry points in group {ENTRY_POINT_GROUP!r} that import cleanly",
                    f"fix or uninstall that distribution, or set {DISABLE_ENV}={ep.name}",
                )
            ) from exc
        finally:
            seconds[ep.name] = time.perf_counter() - start
        try:
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # pluggy rejects malformed hookimpls here
            raise PluginError(
                format_error(
                    f"plugin {label} could not be registered: {exc}",
                    f"hook implementations matching {specs.__name__}",
                    f"fix its hook signatures, or set {DISABLE_ENV}={ep.name}",
                )
            ) from exc
        labels[ep.name] = label


def _collect(
    pm: pluggy.PluginManager,
    hook_name: str,
    item_type: type,
    labels: Mapping[str, str],
) -> list[tuple[Any, str]]:
    """Call every implementation of a list-returning hook, tagging items with their provider."""
    out: list[tuple[Any, str]] = []
    # pluggy's call order: last registered first (ties in priority keep this order).
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        label = labels.get(impl.plugin_name, impl.plugin_name)
        try:
            result = impl.function()
            items = list(result) if result is not None else []
        except PluginError as exc:
            raise PluginError(f"plugin {label}, hook {hook_name}:\n{exc}") from exc
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a plugin must not end the caller
            raise _hook_error(label, impl.plugin_name, hook_name, f"raised {type(exc).__name__}: {exc}",
                              f"a hook that returns an iterable of {item_type.__name__}") from exc
        for item in items:
            if not isinstance(item, item_type):
                raise _hook_error(label, impl.plugin_name, hook_name,
                                  f"returned {type(item).__name__} {item!r:.80}",
                                  f"{item_type.__module__}.{item_type.__name__} instances")
            out.append((item, label))
    return out


def _duplicate(kind: str, name: str, first: str, second: str) -> PluginError:
    return PluginError(
        format_error(
            f"{kind} {name!r} registered twice: by {first} and by {second}",
            f"unique {kind} names across plugins",
            f"uninstall one of them, or block one with {DISABLE_ENV}",
        )
    )


def build_registry(
    *,
    extra_plugins: Mapping[str, object] | None = None,
    load_entry_points: bool = True,
) -> Registry:
    """Create a plugin manager, register built-ins and plugins, and flatten what they yield.

    :param extra_plugins: name -> plugin object, registered after the entry points (tests and
        embedders use this exactly like an installed plugin).
    :param load_entry_points: load the ``mla_sm120_plugin`` entry-point group.
    :returns: the validated :class:`Registry`.
    :raises PluginError: a plugin failed to import, returned the wrong type, or clashed.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(specs)
    blocked = _blocked_names()
    for name in blocked:
        pm.set_blocked(name)
    labels: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, module in BUILTIN_PLUGINS.items():
        if pm.is_blocked(name):
            continue
        pm.register(importlib.import_module(module), name=name)
        labels[name] = f"builtin ({module})"
    if load_entry_points:
        _load_entry_points(pm, labels, seconds)
    for name, plugin in (extra_plugins or {}).items():
        if pm.is_blocked(name):
            continue
        pm.register(plugin, name=name)
        labels[name] = name

    kernels: dict[str, KernelSpec] = {}
    providers: dict[tuple[str, str], str] = {}
    for spec, label in _collect(pm, "mla_sm120_kernels", KernelSpec, labels):
        if spec.name in kernels:
            raise _duplicate("kernel", spec.name, providers[("kernel", spec.name)], label)
        kernels[spec.name] = spec
        providers[("kernel", spec.name)] = label

    profiles: dict[str, ModelProfile] = {}
    by_arch: dict[str, ModelProfile] = {}
    for profile, label in _collect(pm, "mla_sm120_model_profiles", ModelProfile, labels):
        if profile.name in profiles:
            raise _duplicate("model profile", profile.name, providers[("profile", profile.name)], label)
        if profile.family not in FAMILIES:
            raise PluginError(format_error(
                f"plugin {label}, hook mla_sm120_model_profiles: ModelProfile({profile.name!r}).family="
                f"{profile.family!r}", f"one of {list(FAMILIES)}",
                "say 'dsa' for a one-cache sparse-MLA model, 'dsv4' for DeepSeek-V4"))
        for arch in profile.architectures:
            if arch in by_arch:
                other = by_arch[arch]
                raise _duplicate(
                    "architecture", arch, f"{providers[('profile', other.name)]} (profile {other.name!r})",
                    f"{label} (profile {profile.name!r})",
                )
            by_arch[arch] = profile
        profiles[profile.name] = profile
        providers[("profile", profile.name)] = label

    return Registry(
        pm=pm,
        kernels=kernels,
        profiles=profiles,
        by_arch=by_arch,
        providers=providers,
        plugins=dict(labels),
        blocked=blocked,
        load_seconds=seconds,
    )


@functools.cache
def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    return build_registry()


def reset_registry() -> None:
    """Forget the process-wide registry (tests, or after installing a plugin at run time)."""
    get_registry.cache_clear()

