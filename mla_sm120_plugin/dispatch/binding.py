"""Turning a kernel name into a callable: one path for `sparse_mla_forward` and the engines.

Names resolve through the plugin registry, so a third-party kernel binds exactly like a built-in.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import KernelUnavailable, format_error


@dataclass(frozen=True)
class BoundKernel:
    """A kernel entry, imported.

    :param name: the kernel's registered name.
    :param fn: the function (signature of ``sparse_mla_forward`` minus ``kernel`` and ``page_size``).
    :param takes_scale_format: ``fn`` accepts ``scale_format`` (kernels that read each tile's stored
        scale as a value do not need it).
    :param needs_scale_format: ``fn`` requires it (no default).
    :param graph_safe: from the spec: safe inside CUDA graph capture.
    :param engine_own: ``fn`` is the engine's own callable for the kernel (the engine calls it itself).
    """

    name: str
    fn: Callable[..., Any]
    takes_scale_format: bool
    needs_scale_format: bool
    graph_safe: bool
    engine_own: bool = False

    def call(self, q: Any, kv_cache: Any, indices: Any, *, scale_format: str | None = None, **kwargs: Any) -> Any:
        """Run the kernel; ``scale_format`` reaches it only when it takes one (kernels that read each
        tile's stored scale as a value do not) and one is given."""
        if self.takes_scale_format and scale_format is not None:
            kwargs["scale_format"] = scale_format
        return self.fn(q, kv_cache, indices, **kwargs)


@functools.cache
def _import_entry(entry: str) -> Callable[..., Any]:
    module, _, attr = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KernelUnavailable(
            format_error(f"kernel entry {entry!r}: {type(exc).__name__}: {exc}", "an importable 'module:function'",
                         "install the package that provides it (mla-sm120 doctor lists providers)")
        ) from exc


def bind(name: str) -> BoundKernel:
    """Import the registered kernel ``name``.

    :raises KernelUnavailable: ``name`` is not registered, or its entry does not import.
    """
    from ..hooks.manager import get_registry

    spec = get_registry().kernels.get(name)
    if spec is None:
        raise KernelUnavailable(
            format_error(f"kernel={name!r}", f"'auto' or one of {sorted(get_registry().kernels)}",
                         "pass a registered kernel name")
        )
    fn = _import_entry(spec.entry)
    param = inspect.signature(fn).parameters.get("scale_format")
    return BoundKernel(
        name=name,
        fn=fn,
        takes_scale_format=param is not None,
        needs_scale_format=param is not None and param.default is inspect.Parameter.empty,
        graph_safe=spec.graph_safe,
    )
