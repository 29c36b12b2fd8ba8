"""What ``mla-sm120`` writes, whatever the bytes it is given and wherever its output goes.

Paths and environment values that are not valid UTF-8 (Python keeps them as lone surrogates) are
printed escaped, in text and in JSON, under a UTF-8 locale; a reader that closes the pipe early
(``| head -1``) ends the output quietly, without a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.cli import clean_env

GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "num_attention_heads": 64, "index_topk": 2048}
UTF8 = {"LANG": "en_US.UTF-8", "LC_ALL": "en_US.UTF-8"}


def _cli(*args, stdout=subprocess.PIPE, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_sm120_plugin.cli", *args], stdout=stdout,
                          stderr=subprocess.PIPE, env=clean_env(**UTF8, **env), timeout=120)


@pytest.fixture
def undecodable_model(tmp_path) -> str:
    name = os.fsdecode(b"model-\xff\xfe")  # what Python makes of these bytes in argv and paths
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GLM5))
    return str(d)


@pytest.mark.parametrize("as_json", [False, True])
def test_an_undecodable_model_path_is_printed_escaped(undecodable_model, as_json):
    res = _cli("check", f"--model={undecodable_model}", "--sm", "12.0", *(["--json"] if as_json else []))
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    out = res.stdout.decode("utf-8")  # valid UTF-8: it decodes strictly
    assert b"Traceback" not in res.stderr
    if as_json:
        assert json.loads(out)["model_name"].endswith("model-\\xff\\xfe")
    else:
        assert "model-\\xff\\xfe" in out


def test_an_undecodable_path_in_an_error_is_escaped(tmp_path):
    missing = os.path.join(str(tmp_path), os.fsdecode(b"gone-\xff"))
    res = _cli("check", "--model", missing, "--sm", "12.0", "--json")
    assert res.returncode == 2 and b"Traceback" not in res.stderr
    assert "gone-\\xff" in json.loads(res.stdout.decode("utf-8"))["message"]
    assert "gone-\\xff" in res.stderr.decode("utf-8")


@pytest.mark.parametrize("as_json", [False, True])
def test_doctor_prints_an_undecodable_environment_value(as_json):
    blocked = os.fsdecode(b"plugin-\xff")
    res = _cli("doctor", *(["--json"] if as_json else []), MLA_SM120_DISABLE_PLUGINS=blocked)
    assert b"Traceback" not in res.stderr, res.stderr.decode(errors="replace")
    assert res.returncode in (0, 2)
    out = res.stdout.decode("utf-8")
    if as_json:
        json.loads(out)
    assert "mla_sm120.policy" in out or "builtin" in out  # the report was written whole


@pytest.mark.parametrize("args", [
    ("check", "--model", "glm-5", "--sm", "12.0"),
    ("check", "--model", "glm-5", "--sm", "12.0", "--json"),
    ("check", "--model", "glm-5", "--sm", "9.0", "--json"),
    ("doctor",),
    ("--help",),
])
def test_a_closed_pipe_ends_output_quietly(args):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write fails
    try:
        res = _cli(*args, stdout=write_end)
    finally:
        os.close(write_end)
    assert res.stderr.count(b"Traceback") == 0 and b"BrokenPipeError" not in res.stderr, res.stderr
    assert res.returncode == (2 if "9.0" in args else 0)
