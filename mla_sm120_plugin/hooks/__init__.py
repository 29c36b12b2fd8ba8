"""Pluggy hooks: specs, the plugin manager and the built-in profiles."""

from .specs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"]
