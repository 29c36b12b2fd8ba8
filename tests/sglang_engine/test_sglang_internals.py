"""Every SGLang internal the catalogue lists exists in the installed SGLang (an upgrade names what moved)."""

from __future__ import annotations

from support.internals_sites import unresolved

from mla_sm120_plugin.integration.sglang.internals import INTERNALS


def test_every_catalogued_internal_resolves_in_the_installed_sglang():
    assert unresolved(INTERNALS) == []
