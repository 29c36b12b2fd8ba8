from __future__ import annotations

import shutil
import subprocess

import pytest

from mla_sm120_plugin.device import _detect_hardware, detect, parse_device
from mla_sm120_plugin.errors import ConfigError


@pytest.mark.parametrize(
    "text, sm, family",
    [("sm_121", "12.1", 12), ("sm121", "12.1", 12), ("12.1", "12.1", 12), ("sm_120a", "12.0", 12),
     ("12", "12.0", 12), ("9.0", "9.0", 9), ("sm_90", "9.0", 9), ("SM_100", "10.0", 10)],
)
def test_spellings(text, sm, family):
    dev = parse_device(text, source="--sm")
    assert (dev.sm, dev.sm_family, dev.is_planned) == (sm, family, True)


def test_cpu_and_rocm():
    assert parse_device("cpu", source="x").sm_family is None
    assert parse_device("rocm", source="x").vendor == "amd"


@pytest.mark.parametrize("text", ["", "twelve", "sm_", "12.x", "999"])
def test_bad_spellings_list_accepted(text):
    with pytest.raises(ConfigError, match="sm_121"):
        parse_device(text, source="--sm")


def test_override_beats_env(monkeypatch):
    monkeypatch.setenv("MLA_SM120_DEVICE", "9.0")
    assert detect().sm == "9.0"
    assert detect(override="12.1").sm == "12.1"


def test_detection_agrees_with_nvidia_smi(monkeypatch):
    monkeypatch.delenv("MLA_SM120_DEVICE", raising=False)
    _detect_hardware.cache_clear()
    dev = detect()
    exe = shutil.which("nvidia-smi")
    if exe is None:
        expected = "amd" if shutil.which("rocm-smi") else "cpu"
        assert (dev.vendor, dev.is_planned, dev.source) == (expected, False, "detected")
        return
    answer = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                            text=True, timeout=30)
    caps = answer.stdout.split() if answer.returncode == 0 else []
    if not caps:  # an nvidia-smi that fails or sees no GPU (a driver-less container, a stub): no GPU
        assert (dev.vendor, dev.is_planned) in (("cpu", False), ("amd", False))
        return
    assert (dev.vendor, dev.sm, dev.is_planned) == ("nvidia", caps[0], False)


@pytest.mark.parametrize(
    "output, expected",
    [
        ("NVIDIA GeForce RTX 5090, 12.0, 575.57.08\n", ("nvidia", "12.0", "NVIDIA GeForce RTX 5090")),
        ("NVIDIA GB10, 12.1, 580.1\nNVIDIA GB10, 12.1, 580.1\n", ("nvidia", "12.1", "NVIDIA GB10")),
        ("", ("cpu", "cpu", "no GPU found")),
        ("garbage without commas\n", ("cpu", "cpu", "no GPU found")),
    ],
)
def test_nvidia_smi_output_is_parsed(tmp_path, monkeypatch, output, expected):
    # A stand-in nvidia-smi executable on PATH: the real parsing and subprocess code runs.
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("MLA_SM120_DEVICE", raising=False)
    _detect_hardware.cache_clear()
    try:
        dev = detect()
    finally:
        _detect_hardware.cache_clear()
    assert (dev.vendor, dev.sm, dev.name) == expected
