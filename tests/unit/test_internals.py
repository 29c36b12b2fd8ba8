"""Each engine's internals catalogue lists exactly what its adapter's code touches (read from the code).

The sites are read from the adapter's source by ``tests/support/internals_sites.py`` (no engine imported);
the engine suites resolve every catalogued name in the installed engine.
"""

from __future__ import annotations

import importlib

import pytest
from support.internals_sites import PACKAGE, sites

from mla_sm120_plugin.integration.catalogue import Internal

ENGINES = ("vllm", "sglang")


def _catalogue(engine: str) -> tuple[Internal, ...]:
    return importlib.import_module(f"mla_sm120_plugin.integration.{engine}.internals").INTERNALS


@pytest.mark.parametrize("engine", ENGINES)
def test_every_internal_the_code_touches_is_catalogued(engine):
    listed = {spelling for item in _catalogue(engine) for spelling in item.spellings()}
    missing = sites(PACKAGE / "integration" / engine, engine) - listed
    assert not missing, f"integration/{engine}/internals.py does not list {sorted(missing)}"


@pytest.mark.parametrize("engine", ENGINES)
def test_every_catalogued_internal_is_still_touched(engine):
    touched = sites(PACKAGE / "integration" / engine, engine)
    stale = [item.name for item in _catalogue(engine) if not touched & set(item.spellings())]
    assert not stale, f"integration/{engine}/internals.py lists what the code no longer touches: {stale}"


@pytest.mark.parametrize("engine", ENGINES)
def test_each_entry_is_listed_once_and_says_its_release(engine):
    from mla_sm120_plugin.integration import sglang, vllm  # noqa: F401 - the faces stay importable

    items = _catalogue(engine)
    spellings = [s for item in items for s in item.spellings()]
    assert len(spellings) == len(set(spellings)), "a spelling under two entries"
    from mla_sm120_plugin.engines import RELEASES

    releases = list(RELEASES[engine])
    for item in items:
        assert item.read_from in releases, (item.name, item.read_from)
        exists = [r for r in releases if item.exists_in(r)]
        # Read from each supported release it exists in: first, then again (what changed there, or "").
        assert [item.read_from, *item.changed] == exists, (item.name, item.read_from, dict(item.changed), exists)


def test_the_site_reader_sees_each_kind_of_site(tmp_path):
    """The reader itself: each rule finds its site in a module written for it (and ignores the plugin's own)."""
    room = tmp_path / "room"
    room.mkdir()
    (room / "mod.py").write_text(
        "from vllm.x import Y\n"
        "import dataclasses\n"
        "SEL = '_pick'\n"
        "T = 'vllm.a.b'\n"
        "E = 'VLLM_SOME_VAR'\n"
        "L = 'vllm.mla_sm120_child'\n"
        "def f(m, spec, obj):\n"
        "    Y.attr\n"
        "    getattr(m, 'public_global')\n"
        "    vars(m)['recipe']\n"
        "    dataclasses.replace(spec, zq_field=1)\n"
        "    obj.zq_written = 1\n"
        "    obj._private\n"
        "    obj._mla_sm120_mark = 1\n"
        "class Mix:\n"
        "    def _hook(self):\n"
        "        return super()._base()\n"
        "def make(base):\n"
        "    return type('X', (Mix, base), {})\n")
    assert sites(room, "vllm") == {
        "vllm.x.Y", "vllm.x.Y.attr", "vllm.a.b", "mod: $VLLM_SOME_VAR", "mod: child of vllm", "mod: _pick", "mod: .public_global",
        "mod: .recipe", "mod: .zq_field", "mod: .zq_written", "mod: ._private", "mod: ._hook", "mod: super()._base"}


def test_an_entry_says_all_five_or_refuses():
    with pytest.raises(ValueError, match="fill in why"):
        Internal("vllm.x.y", "what", " ", "let go", "0.33.0")
    with pytest.raises(ValueError, match="not a dotted engine name"):
        Internal("name", "what", "why", "let go", "0.33.0")
