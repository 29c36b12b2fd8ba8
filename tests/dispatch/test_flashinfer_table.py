"""The packaged FlashInfer envelope table and how the selection uses it; flashinfer not needed.

That the packaged table equals what the installed flashinfer reports is
tests/dispatch/test_flashinfer_contract.py (skipped without flashinfer).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import clean_env

from mla_sm120_plugin.dispatch import catalog, flashinfer_table
from mla_sm120_plugin.dispatch import flashinfer as fi_binding
from mla_sm120_plugin.kernels.dsa.layout import FP8_DS_MLA, SCALE_ARBITRARY
from mla_sm120_plugin.types import PREFILL, DeviceInfo, SelectionContext

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "flashinfer", "triton")
PACKAGED_VERSION = "0.7.2.post1"


@pytest.fixture(autouse=True)
def _fresh_caches():
    fi_binding.clear_caches()
    yield
    fi_binding.clear_caches()


def _as_installed(monkeypatch, version):
    """Pretend ``version`` of flashinfer-python is installed (None: not installed)."""
    monkeypatch.setattr(flashinfer_table, "installed_version", lambda: version)


# ------------------------------------------------------------------ the data


def test_data_file_is_package_data():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]["mla_sm120_plugin.dispatch"]
    assert flashinfer_table.DATA_FILE.name in package_data
    assert flashinfer_table.DATA_FILE.parent == ROOT / "mla_sm120_plugin" / "dispatch"


def test_packaged_table_holds_what_the_envelope_reads():
    assert PACKAGED_VERSION in flashinfer_table.packaged_versions()
    table = flashinfer_table.EnvelopeTable.from_entry(
        PACKAGED_VERSION, flashinfer_table.packaged_entries()[PACKAGED_VERSION]
    )
    for fmt in fi_binding.NATIVE_FORMATS.values():
        config = table.decode[fmt.family]
        assert (config.d_qk, config.bytes_per_token, config.max_num_tokens) == (576, 656, 64)
        assert config.supported_num_heads() == tuple(range(1, 129))
        assert config.topk_is_runtime and config.min_topk == 1
    assert table.prefill_heads == {8, 16, 32, 64, 128}
    assert table.prefill_topk_tile == 64


def test_loaded_once(monkeypatch):
    flashinfer_table.table()
    monkeypatch.setattr(flashinfer_table, "DATA_FILE", Path("/nonexistent.json"))
    assert flashinfer_table.table().flashinfer_version  # cached: the file is not read again


def _write_data(tmp_path, monkeypatch, versions):
    entry = flashinfer_table.packaged_entries()[PACKAGED_VERSION]
    path = tmp_path / "envelope.json"
    for version in versions:
        flashinfer_table.write_entry(version, entry, path)
    monkeypatch.setattr(flashinfer_table, "DATA_FILE", path)
    flashinfer_table.clear_caches()
    return path


def test_write_entry_keeps_other_versions_sorted(tmp_path, monkeypatch):
    path = _write_data(tmp_path, monkeypatch, ["0.8.0", "0.7.2.post1", "0.8.0rc1"])
    data = json.loads(path.read_text())
    assert list(data["versions"]) == ["0.7.2.post1", "0.8.0rc1", "0.8.0"]
    assert data["generated_by"] == flashinfer_table.REGENERATE
    assert flashinfer_table.packaged_versions() == ("0.7.2.post1", "0.8.0rc1", "0.8.0")


# --------------------------------------------------------- which table, the note


@pytest.mark.parametrize(
    ("installed", "used", "note"),
    [
        ("0.7.2.post1", "0.7.2.post1", None),
        ("0.8.0rc1", "0.8.0rc1", None),
        (None, "0.8.0", "(flashinfer not installed here)"),
        ("0.9.1", "0.8.0", "(flashinfer-python 0.9.1 is installed here and has no packaged table; "),
        ("0.7.1", "0.8.0", "(flashinfer-python 0.7.1 is installed here"),
    ],
)
def test_installed_version_else_newest(tmp_path, monkeypatch, installed, used, note):
    _write_data(tmp_path, monkeypatch, ["0.7.2.post1", "0.8.0rc1", "0.8.0"])
    _as_installed(monkeypatch, installed)
    assert flashinfer_table.table().flashinfer_version == used
    line = flashinfer_table.table_note()
    if note is None:
        assert line is None
    else:
        assert line.startswith(f"FlashInfer envelope from the packaged table of flashinfer-python {used} ")
        assert note in line and "\n" not in line


def test_note_without_flashinfer_names_the_packaged_version(monkeypatch):
    _as_installed(monkeypatch, None)
    assert flashinfer_table.table_note() == (
        f"FlashInfer envelope from the packaged table of flashinfer-python "
        f"{flashinfer_table.packaged_versions()[-1]} (flashinfer not installed here)"
    )


def test_installed_version_reads_metadata_only():
    code = (
        "import sys; from mla_sm120_plugin.dispatch import flashinfer_table as t; "
        "t.installed_version(); t.table(); t.table_note(); "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, env=clean_env())
    assert out.stdout.strip() == "[]"


def test_version_key_orders_pep440():
    ordered = ["0.7.1", "0.7.2.dev1", "0.7.2a1", "0.7.2rc1", "0.7.2", "0.7.2.post1", "0.7.10", "0.8.1", "1.0.0"]
    assert sorted(reversed(ordered), key=flashinfer_table.version_key) == ordered
    assert flashinfer_table.version_key("0.8") == flashinfer_table.version_key("0.8.0")
    assert flashinfer_table.version_key("0.8.0+cu128") == flashinfer_table.version_key("0.8.0")


# -------------------------------------------------------- the selection's envelope


def _ctx(source, *, heads=4):
    device = DeviceInfo("nvidia", 12, 1, name="planned" if source == "--sm" else "", source=source)
    return SelectionContext(
        "GlmMoeDsaForCausalLM", FP8_DS_MLA, heads, 2048, device, kv_scale_format=SCALE_ARBITRARY
    )


def test_planned_device_reads_only_the_packaged_table(monkeypatch):
    def no_live():
        raise AssertionError("a planned device must not read flashinfer's live table")

    monkeypatch.setattr(fi_binding, "_live_table", no_live)
    reasons = catalog._flashinfer_envelope(_ctx("--sm"), PREFILL, None)
    assert len(reasons) == 1 and "num_heads=4" in reasons[0] and "[8, 16, 32, 64, 128]" in reasons[0]
    assert catalog._flashinfer_envelope(_ctx("--sm", heads=8), PREFILL, None) == ()


def test_present_device_unites_packaged_and_live_tables(monkeypatch):
    """Where the device is this machine's and flashinfer is installed, its own table counts too."""
    packaged = flashinfer_table.table()
    narrowed = dict(packaged.decode)
    narrowed["glm_nsa"] = dataclasses.replace(narrowed["glm_nsa"], min_topk=4096)
    live = dataclasses.replace(packaged, flashinfer_version="live", decode=narrowed)
    monkeypatch.setattr(fi_binding, "_live_table", lambda: live)
    real_find_spec = catalog.importlib.util.find_spec
    monkeypatch.setattr(
        catalog.importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a)
    )
    reasons = catalog._flashinfer_envelope(_ctx("detected"), PREFILL, None)
    assert len(reasons) == 2
    assert "[8, 16, 32, 64, 128]" in reasons[0]  # from both tables, once
    assert reasons[1] == "topk=2048: flashinfer glm_nsa needs topk >= 4096"  # live only
    assert catalog._flashinfer_envelope(_ctx("--sm"), PREFILL, None) == (reasons[0],)


def test_present_device_without_flashinfer_uses_the_packaged_table(monkeypatch):
    monkeypatch.setattr(fi_binding, "_live_table", lambda: pytest.fail("flashinfer is not installed"))
    real_find_spec = catalog.importlib.util.find_spec
    monkeypatch.setattr(
        catalog.importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a)
    )
    reasons = catalog._flashinfer_envelope(_ctx("detected"), PREFILL, None)
    assert len(reasons) == 1 and "num_heads=4" in reasons[0]


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="source='nope'"):
        fi_binding.envelope_reasons(
            phase="decode", num_heads=8, topk=2048, max_tokens=1, kv_layout=FP8_DS_MLA, scale_format="pow2", source="nope"
        )


# ------------------------------------------------------------------ the NVFP4 DeepSeek-V4 family


def test_the_nvfp4_dsv4_envelope_is_the_packaged_tables():
    """The 384-byte record's kernels are planned from the table (``decode_nvfp4``), not from constants:
    every packaged version has the family, and a shape the table widens or a table without it changes
    the reasons."""
    from mla_sm120_plugin.dispatch.flashinfer_dsv4 import nvfp4_reasons

    for version in flashinfer_table.packaged_versions():
        table = flashinfer_table.EnvelopeTable.from_entry(version, flashinfer_table.packaged_entries()[version])
        config = table.decode_nvfp4["dsv4"]
        assert (config.kv_cache_format, config.bytes_per_token, config.page_block_size) == ("nvfp4", 384, 64)
        assert nvfp4_reasons(16, 128, 64, 512, 64, table) == []
        wider = dataclasses.replace(config, topks=frozenset({128, 512, 1024}))
        assert nvfp4_reasons(16, 128, 64, 1024, 64, dataclasses.replace(table, decode_nvfp4={"dsv4": wider})) == []
        assert nvfp4_reasons(16, 128, 64, 1024, 64, table) == [
            "compressed rows of 1024 slots: its NVFP4 kernels are built for [128, 512]"]
        assert nvfp4_reasons(16, 128, 64, 0, 0, dataclasses.replace(table, decode_nvfp4={})) == [
            f"FlashInfer {version}'s table has no NVFP4 dsv4 family"]


def test_a_family_the_reader_does_not_know_is_read_and_left_alone():
    """A newer FlashInfer's table may list families no planner asks for (0.7.4's dsv4_1_inline)."""
    entry = json.loads(json.dumps(flashinfer_table.packaged_entries()[PACKAGED_VERSION]))
    entry["decode"]["dsv4_1_inline"] = {**entry["decode"]["dsv4"], "kv_cache_format": "fp8_dsv41_inline",
                                        "a_field_of_a_later_release": 1}
    table = flashinfer_table.EnvelopeTable.from_entry("9.9", entry)
    assert table.decode["dsv4_1_inline"].kv_cache_format == "fp8_dsv41_inline"
    assert table.decode["dsv4"] == flashinfer_table.table().decode["dsv4"]
