"""Every vLLM internal the catalogue lists for the installed release exists in it (an upgrade names
what moved), and the resolver itself names a missing one."""

from __future__ import annotations

import dataclasses

from support.internals_sites import unresolved

from mla_sm120_plugin.engines import installed_release
from mla_sm120_plugin.integration.vllm.internals import INTERNALS


def _installed() -> list:
    release = installed_release("vllm")
    return [item for item in INTERNALS if item.exists_in(release)]


def test_every_catalogued_internal_resolves_in_the_installed_vllm():
    assert unresolved(_installed()) == []


def test_a_catalogued_internal_the_installed_vllm_lacks_is_named():
    """The same check fails on what a release does not have: each name, site and spelled attribute."""
    item = _installed()[-1]
    moved = [dataclasses.replace(item, name=item.name + "_moved"),
             dataclasses.replace(item, sites=("vllm.config.no_such_name", "dsv4: .no_such_attribute_anywhere"))]
    problems = unresolved(moved)
    assert any(p.startswith(item.name + "_moved") for p in problems), problems
    assert any("vllm.config.no_such_name" in p for p in problems), problems
    assert any("no_such_attribute_anywhere is not spelled" in p for p in problems), problems

