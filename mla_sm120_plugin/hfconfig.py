"""Reading a HF config's keys: present or absent, type- and range-checked, one message shape.

The model reader (:mod:`mla_sm120_plugin.modelinfo`: the keys every family shares) and each model family
(:mod:`mla_sm120_plugin.families`: the keys only its models have, e.g. a two-cache family's per-layer
lists) read a ``config.json`` dict or a ``PretrainedConfig``-like object through these, with the bounds
below. Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable

from . import files
from .errors import ConfigError, format_error

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
MAX_LAYERS = 1024
MAX_WINDOW = 1 << 16

ABSENT = object()


def get(cfg: Any, key: str) -> Any:
    """``cfg[key]`` for a dict (a present null is a value, and wrong); ``cfg.key`` for a
    ``PretrainedConfig``-like object (None is how those say absent); :data:`ABSENT` when absent."""
    if isinstance(cfg, dict):
        return cfg.get(key, ABSENT)
    value = getattr(cfg, key, None)
    return ABSENT if value is None else value


def bad_value(where: str, key: str, value: Any, supported: str, fix: str) -> ConfigError:
    """The error for a present ``key`` whose ``value`` is not what ``supported`` says."""
    return ConfigError(format_error(f"{where}: {key}={files.short_repr(value)} ({type(value).__name__})", supported, fix))


def count(cfg: Any, key: str, bound: int, where: str, profile: Any = None, attr: str = "", least: int = 1) -> int:
    """An int field in ``[least, bound]``; absent: the matched ``profile``'s ``attr``, else 0.

    :raises ConfigError: a present value of another type or outside the range.
    """
    fallback = getattr(profile, attr, None) if profile is not None else None
    value = get(cfg, key)
    if value is ABSENT:
        return fallback or 0
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= bound:
        profile_hint = f", or remove it to use the {profile.name} profile's {fallback}" if fallback is not None else ""
        raise bad_value(where, key, value, f"an integer from {least} to {bound} (not a bool, float or string)",
                        f"set {key} to the model's value{profile_hint}")
    return value


def flag(cfg: Any, key: str, where: str, fallback: bool) -> bool:
    """A true/false field; absent: ``fallback``."""
    value = get(cfg, key)
    if value is ABSENT:
        return fallback
    if not isinstance(value, bool):
        raise bad_value(where, key, value, "true or false (a JSON boolean)", f"set {key} to the model's true or false")
    return value


def list_of(cfg: Any, key: str, where: str, item_ok: Callable[[Any], bool], supported: str, fix: str, *,
            least: int = 0) -> list[Any] | None:
    """A list field of ``least`` to :data:`MAX_LAYERS` items, each ``item_ok``; None when absent.

    :raises ConfigError: another type, length or item (``supported`` says what is accepted).
    """
    value = get(cfg, key)
    if value is ABSENT:
        return None
    if not isinstance(value, (list, tuple)) or not least <= len(value) <= MAX_LAYERS or not all(map(item_ok, value)):
        raise bad_value(where, key, value, supported, fix)
    return list(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_list(cfg: Any, key: str, where: str, allowed: tuple[int, ...], fix: str) -> list[int] | None:
    """A non-empty list of ints from ``allowed``; None when absent."""
    return list_of(cfg, key, where, lambda v: is_int(v) and v in allowed,
                   f"a non-empty list (at most {MAX_LAYERS}) of ints from {list(allowed)}", fix, least=1)
