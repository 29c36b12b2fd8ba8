"""The plugin's error types.

Every message has the same three parts, one per line, so a user can act on it without reading
code::

    given: ...
    supported: ...
    fix: ...

:func:`format_error` builds that shape.
"""

from __future__ import annotations


class MlaSm120Error(Exception):
    """Base class of every error this plugin raises on purpose."""


class UnsupportedConfiguration(MlaSm120Error, ValueError):
    """The model / device / KV dtype / kernel combination cannot be served."""


class ConfigError(MlaSm120Error, ValueError):
    """The plugin config (inline dict, TOML file or environment) is malformed."""


class PluginError(MlaSm120Error):
    """A hook implementation (built-in or third party) is broken."""


class KernelInputError(MlaSm120Error, ValueError):
    """A tensor handed to a kernel entry has the wrong shape, dtype or device."""


class KernelUnavailable(MlaSm120Error, RuntimeError):
    """A kernel was asked for that cannot run here (package missing, no GPU, ...)."""


def format_error(given: str, supported: str, fix: str) -> str:
    """Render the three-part message every plugin error uses, one part per line."""
    return f"given: {given}\nsupported: {supported}\nfix: {fix}"
