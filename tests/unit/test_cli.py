"""``mla-sm120 check``'s flags as documented: ``--config`` against ``MLA_SM120_CONFIG``, and
``--prefill-kernel`` / ``--decode-kernel`` against every file.

Every test names the promise it pins (README "Plugin config" and "The main job", the docstrings of
``mla_sm120_plugin/config.py`` and ``cli.py``). A precedence test sets BOTH sources to different
values, so a swapped order fails.
"""

from __future__ import annotations

import json

import pytest

from mla_sm120_plugin import cli
from mla_sm120_plugin.config import CONFIG_ENV
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON

from support.cli import decision_of


def _toml(tmp_path, text: str, name: str = "mla.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- mla-sm120 check: --config, MLA_SM120_CONFIG and the kernel flags ------------------------------


def _check_kernels(capsys, *argv: str) -> dict[str, str]:
    """The kernel per phase ``mla-sm120 check --model glm-5 --sm 12.0`` decides (planned device)."""
    rc = cli.main(["check", "--model", "glm-5", "--sm", "12.0", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_OK, err
    return decision_of(json.loads(out))["kernels"]


def test_check_without_any_source_decides_by_priority(capsys):
    """README "The main job": without settings, the best kernel per phase (FlashInfer on SM12x fp8,
    64 heads, top-k 2048). The baseline the precedence tests below move away from."""
    assert _check_kernels(capsys) == {"prefill": FLASHINFER, "decode": FLASHINFER}


def test_check_config_flag_beats_the_environment_file(tmp_path, capsys, monkeypatch):
    """config.load_config: ``config_file``, "a file named on the command line; beats the environment"."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, f'prefill_kernel = "{TORCH}"\n', "env.toml"))
    flag = _toml(tmp_path, f'prefill_kernel = "{TRITON}"\n', "flag.toml")
    assert _check_kernels(capsys)["prefill"] == TORCH  # the environment's file alone applies
    assert _check_kernels(capsys, "--config", flag)["prefill"] == TRITON


def test_check_config_flag_replaces_the_environment_file(tmp_path, capsys, monkeypatch):
    """config.py docstring: the file read is the one named explicitly, "else the one MLA_SM120_CONFIG
    names": one file, never both merged (a key only the environment's file sets is not applied)."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, f'prefill_kernel = "{TORCH}"\n', "env.toml"))
    flag = _toml(tmp_path, f'decode_kernel = "{TRITON}"\n', "flag.toml")
    assert _check_kernels(capsys, "--config", flag) == {"prefill": FLASHINFER, "decode": TRITON}


@pytest.mark.parametrize("file_source", ["--config", CONFIG_ENV])
def test_check_kernel_flags_beat_every_file(tmp_path, capsys, monkeypatch, file_source):
    """config.py: the inline source (check's --prefill-kernel/--decode-kernel) is the strongest;
    it beats the file's top level and even the file's exact model section (the source decides
    first, the section only within one source)."""
    path = _toml(tmp_path, f'prefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\n'
                           f'[models."glm-5"]\nprefill_kernel = "{TORCH}"\n')
    argv = ["--config", path] if file_source == "--config" else []
    if file_source == CONFIG_ENV:
        monkeypatch.setenv(CONFIG_ENV, path)
    assert _check_kernels(capsys, "--enforce-eager", *argv) == {"prefill": TORCH, "decode": TORCH}
    assert _check_kernels(capsys, "--enforce-eager", *argv, "--prefill-kernel", TRITON,
                          "--decode-kernel", TRITON) == {"prefill": TRITON, "decode": TRITON}


def test_check_refusal_names_the_source_of_a_forced_kernel(tmp_path, capsys, monkeypatch):
    """README: errors say what was given; the forced kernel's source is named (flags vs file)."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, 'decode_kernel = "flashmla_kv"\n'))
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0"]) == cli.EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert "decode_kernel from " + str(tmp_path / "mla.toml") in err
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0", "--decode-kernel", "flashmla_kv"]) == 2
    assert "decode_kernel from command-line flags" in capsys.readouterr().err
