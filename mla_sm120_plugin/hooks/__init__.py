"""The hook mechanism: the pluggy specs and the plugin manager (built-ins register through it like
third parties: :mod:`mla_sm120_plugin.profiles`, :mod:`mla_sm120_plugin.families` (the rules),
:mod:`mla_sm120_plugin.dispatch.catalog`)."""

from .specs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"]
