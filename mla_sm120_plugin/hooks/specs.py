"""Hook specifications of the ``mla_sm120`` project.

A third-party package adds kernels, model profiles or rules by exposing a module (or object)
with ``@hookimpl``-decorated functions under the entry-point group ``mla_sm120_plugin``::

    # pyproject.toml of your package
    [project.entry-points.mla_sm120_plugin]
    my_kernels = "my_pkg.mla_hooks"

    # my_pkg/mla_hooks.py
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.types import KernelSpec

    @hookimpl
    def mla_sm120_kernels():
        yield KernelSpec(
            name="my_sparse_mla", phases={"decode"}, kv_cache_dtypes={"fp8_ds_mla"},
            vendors={"nvidia"}, sm_families={12}, priority=250,
            entry="my_pkg.kernel:forward",
            tolerance=2e-2,  # vs the torch reference; the self-check at engine init holds you to it
        )

The built-in kernels and profiles are registered through these same hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import pluggy

if TYPE_CHECKING:
    from ..types import KernelSpec, ModelProfile, Refusal, SelectionContext

PROJECT_NAME = "mla_sm120"
ENTRY_POINT_GROUP = "mla_sm120_plugin"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def mla_sm120_model_profiles() -> Iterable[ModelProfile]:
    """Yield the DSA model profiles this plugin serves.

    Profile names and architectures must be unique across all plugins; a clash is an error
    naming both providers.

    :returns: an iterable of :class:`~mla_sm120_plugin.types.ModelProfile`.
    """


@hookspec
def mla_sm120_kernels() -> Iterable[KernelSpec]:
    """Yield the sparse-MLA kernels this plugin provides.

    Kernel names must be unique across all plugins; a clash is an error naming both providers.
    A spec is cheap to build: heavy imports belong in its ``probe``, ``envelope`` or ``entry``.

    :returns: an iterable of :class:`~mla_sm120_plugin.types.KernelSpec`.
    """


@hookspec
def mla_sm120_validate(ctx: SelectionContext, profile: ModelProfile | None) -> Iterable[str | Refusal]:
    """Give reasons to refuse a context before any kernel is considered.

    Every implementation is called; all reasons are collected into one
    :class:`~mla_sm120_plugin.errors.UnsupportedConfiguration`. The built-in policy (SM family,
    KV layout, engine features, model geometry, as the context's family states them:
    :mod:`mla_sm120_plugin.families`, over :mod:`mla_sm120_plugin.rules`) is one. A context's
    ``family`` (``"dsa"`` or ``"dsv4"``) says which model family it is; a DeepSeek-V4 context carries
    its layer kind's ``call``.
    An implementation that raises, exits or returns another type is reported as a
    :class:`~mla_sm120_plugin.errors.PluginError` naming its distribution and this hook.

    :param ctx: the model/device/dtype combination being decided.
    :param profile: the model profile matched to ``ctx.model_arch`` (take it only if needed:
        pluggy passes only the arguments an implementation names).
    :returns: reasons to refuse (empty or None to accept): strings, or
        :class:`~mla_sm120_plugin.types.Refusal` with what is supported and the fix.
    """


@hookspec(firstresult=True)
def mla_sm120_select(ctx: SelectionContext, phase: str, candidates: Sequence[str]) -> str | None:
    """Override the priority order for one phase.

    Stops at the first non-None result (``firstresult``). Only called under ``auto`` (a kernel
    forced by the user's config is never overridden). The result must be one of ``candidates``;
    anything else, an exception or an exit is a :class:`~mla_sm120_plugin.errors.PluginError`
    naming the distribution and this hook.

    :param ctx: the combination being decided.
    :param phase: ``"prefill"`` or ``"decode"``.
    :param candidates: kernels that fit the envelope and passed their probe, best first.
    :returns: the kernel name to use, or None to keep the default (the first candidate).
    """
