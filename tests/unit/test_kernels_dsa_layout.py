"""The DSA cache layouts as data (``kernels/dsa/layout.py``): each layout checks its own bytes when
built, and an unknown name lists the known ones.

Sizes are written here as numbers, never recomputed with the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest

from mla_sm120_plugin.kernels.dsa import layout


def test_a_layout_checks_its_own_bytes_when_built():
    dsa = layout.LAYOUTS[layout.FP8_DS_MLA]
    assert dsa.row == dsa.used == 656  # a row may be exactly its used bytes
    assert dataclasses.replace(dsa, name="nope-copy", rope=0).rope == 0  # rope 0 is a layout
    nvfp4 = layout.LAYOUTS[layout.NVFP4_DS_MLA]
    assert dataclasses.replace(nvfp4, name="nvfp4-copy").used == 352
    for bad, words in [(dict(latent=500), "latent 500"), (dict(rope=-1), "rope -1"), (dict(row=655), "row 655")]:
        with pytest.raises(ValueError, match=f"CacheLayout 'bad': .*{words}.*656 elements used|"
                                             f"CacheLayout 'bad': .*{words}"):
            dataclasses.replace(dsa, name="bad", **bad)
    with pytest.raises(ValueError, match="latent 520"):  # a multiple of nvfp4's 16-value block, not of 128
        dataclasses.replace(nvfp4, name="bad", latent=520)


def test_an_unknown_layout_name_lists_the_known_ones():
    with pytest.raises(KeyError) as err:
        layout.get("fp8_e5m2")
    assert "kv_layout 'fp8_e5m2': known layouts are ['fp8_ds_mla'" in str(err.value)


def test_a_bf16_or_nvfp4_layout_is_checked_by_its_own_block():
    bf16 = layout.LAYOUTS[layout.BF16]
    assert dataclasses.replace(bf16, name="bf16-copy").used == 576  # no scales: no block to divide by
    with pytest.raises(ValueError, match="latent 144"):  # a whole number of 16-value blocks, not of 128 tiles
        dataclasses.replace(layout.LAYOUTS[layout.NVFP4_DS_MLA], name="bad", latent=144)
