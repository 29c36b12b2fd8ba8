"""What an entry of an engine's internals catalogue says: :class:`Internal` (pure Python).

Each adapter lists every engine internal it touches in its own ``internals.py`` (vllm-ascend's patch
catalogue is the model): what is used, why, what upstream change would let it go, and the engine
release it was read from. A test reads the adapter's code for the places it touches the engine
and fails on any the catalogue does not list (or lists but the code no longer touches); another,
in the engine's environment, resolves every catalogued name in the installed engine, so an
upgrade names what moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Internal:
    """One engine internal an adapter touches.

    :param name: its dotted name in the engine (``module.attribute[.attribute]``), resolvable with
        :func:`pkgutil.resolve_name` in the release it was read from.
    :param what: what the adapter does with it (reads, calls, wraps, overrides, writes).
    :param why: why the adapter needs it.
    :param let_go: the upstream change that would let the adapter stop touching it.
    :param read_from: the engine release it was first read from (``"0.33.0"``).
    :param changed: each later release it was read from again -> what changed there for the adapter
        (``""``: nothing).
    :param releases: the releases it exists in, where not every release the adapter supports (an
        internal a later release added, or one it removed).
    :param sites: how the adapter's code spells it, where not as ``name`` itself (the other dotted
        names it reaches through it, and ``"<module>: super().<method>"``, ``"<module>: .<attribute>"``,
        ``"<module>: <private global>"``, ``"<module>: $ENV_VAR"``, ``"<module>: child of <name>"`` for what it
        reaches by attribute, by name or under an engine's name).
    """

    name: str
    what: str
    why: str
    let_go: str
    read_from: str
    sites: tuple[str, ...] = field(default=())
    changed: Mapping[str, str] = field(default_factory=dict)
    releases: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for key in ("name", "what", "why", "let_go", "read_from"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise ValueError(f"Internal.{key}: {getattr(self, key)!r}; every entry says all five "
                                 f"(name, what, why, let_go, read_from); fill in {key}")
        if "." not in self.name:
            raise ValueError(f"Internal.name: {self.name!r} is not a dotted engine name; write the module path "
                             "and the attribute, e.g. 'vllm.config.get_current_vllm_config_or_none'")

    def exists_in(self, release: str) -> bool:
        """Whether the adapter touches this internal under ``release`` (it exists there)."""
        return not self.releases or release in self.releases

    def spellings(self) -> tuple[str, ...]:
        """Every way the adapter's code may spell this internal: its name and its other sites (the
        code spells at least one of them)."""
        return (self.name, *self.sites)
