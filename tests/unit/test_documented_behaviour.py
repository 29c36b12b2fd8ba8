"""Documented behaviour pinned from both sides: config precedence, the file reader's exact limits,
and the kernels' ``topk_length`` contract.

Every test names the promise it pins (README "Plugin config", the docstrings of
``mla_sm120_plugin/config.py``, ``files.py`` and ``kernels/__init__.py``). A precedence test sets
BOTH sources to different values, so a swapped order fails; a limit test sits on both sides of the
boundary, so an off-by-one fails.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys

import pytest
import torch
from helpers import assert_three_parts
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_sm120_plugin import cli, files
from mla_sm120_plugin.config import CONFIG_ENV, load_config
from mla_sm120_plugin.context import clear_config_cache
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS, FLASHINFER, TORCH, TRITON
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla
from mla_sm120_plugin.modelinfo import resolve_model

GLM_NAME, GLM_ARCH = "zai-org/GLM-5-FP8", "GlmMoeDsaForCausalLM"

# The bounds as the documentation states them (files.py's module docstring and comments; the brief
# of issue 18): written out here, not imported, so a change to the implementation's constants fails.
TOML_CAP = 1 << 20  # "1 MiB"
JSON_CAP = 16 << 20  # "16 MiB"
NESTING = 64  # "nested more than 64 levels"
INT_DIGITS = 100  # "integers of at most 100 digits"


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("MLA_SM120_DEVICE", raising=False)
    clear_config_cache()
    yield
    clear_config_cache()


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
    return json.loads(out)["kernels"]


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


# --- within one source: exact name > glob > architecture > top level -------------------------------

# Where a section sits, as TOML text and as the inline dict's shape.
SECTIONS = {
    "top": (None, None),
    "arch": ("architectures", GLM_ARCH),
    "glob": ("models", "zai-org/*"),
    "exact": ("models", GLM_NAME),
}
STRENGTH = ["top", "arch", "glob", "exact"]  # README "Plugin config": exact name, then glob, then architecture
PAIRS = [(weak, strong) for i, weak in enumerate(STRENGTH) for strong in STRENGTH[i + 1:]]


def _source(kinds_values: list[tuple[str, str]], form: str, tmp_path):
    """A config with ``decode_kernel`` set in each (section kind, value), in that order, as a TOML
    file (returned as env) or an inline dict."""
    data: dict = {}
    for kind, value in kinds_values:
        table, name = SECTIONS[kind]
        if table is None:
            data["decode_kernel"] = value
        else:
            data.setdefault(table, {})[name] = {"decode_kernel": value}
    if form == "inline":
        return data, {}
    lines = [f'decode_kernel = "{data["decode_kernel"]}"'] if "decode_kernel" in data else []
    for table in ("models", "architectures"):
        for name, section in data.get(table, {}).items():
            lines += [f'[{table}."{name}"]', f'decode_kernel = "{section["decode_kernel"]}"']
    return None, {CONFIG_ENV: _toml(tmp_path, "\n".join(lines) + "\n")}


@pytest.mark.parametrize("form", ["file", "inline"])
@pytest.mark.parametrize("weak, strong", PAIRS)
@pytest.mark.parametrize("strong_first", [False, True], ids=["weak-written-first", "strong-written-first"])
def test_within_one_source_the_more_specific_section_wins(tmp_path, form, weak, strong, strong_first):
    """README "Plugin config": "Per-model sections are matched by exact model name, then glob, then
    architecture" (config.py: "a model section beats an architecture section beats the top level"),
    in a TOML file and in the inline dict alike, whatever order they are written in."""
    order = [(strong, TRITON), (weak, TORCH)] if strong_first else [(weak, TORCH), (strong, TRITON)]
    inline, env = _source(order, form, tmp_path)
    settings = load_config(inline, kernel_names=BUILTIN_KERNELS, env=env).for_model(GLM_NAME, GLM_ARCH)
    assert settings.decode_kernel == TRITON
    table, name = SECTIONS[strong]
    label = env[CONFIG_ENV] if env else "--additional-config mla_sm120"
    section = "" if table is None else f" [{table}.{name if table == 'architectures' else repr(name)}]"
    assert settings.origin("decode_kernel") == label + section


@pytest.mark.parametrize("form", ["file", "inline"])
def test_sections_for_another_model_or_architecture_do_not_apply(tmp_path, form):
    """config.py: sections match the served model name (exact or fnmatch glob, case-sensitive) or the
    HF architecture; a near miss falls through to the top level."""
    data = {"decode_kernel": TORCH,
            "models": {"zai-org/GLM-5": {"decode_kernel": TRITON}, "zai-org/glm-*": {"decode_kernel": TRITON}},
            "architectures": {"DeepseekV32ForCausalLM": {"decode_kernel": TRITON}}}
    if form == "inline":
        inline, env = data, {}
    else:
        inline, env = None, {CONFIG_ENV: _toml(tmp_path, f'decode_kernel = "{TORCH}"\n'
                                                         f'[models."zai-org/GLM-5"]\ndecode_kernel = "{TRITON}"\n'
                                                         f'[models."zai-org/glm-*"]\ndecode_kernel = "{TRITON}"\n'
                                                         f'[architectures.DeepseekV32ForCausalLM]\n'
                                                         f'decode_kernel = "{TRITON}"\n')}
    settings = load_config(inline, kernel_names=BUILTIN_KERNELS, env=env).for_model(GLM_NAME, GLM_ARCH)
    assert settings.decode_kernel == TORCH
    # And with no model name or architecture known, only the top level applies.
    assert load_config(inline, kernel_names=BUILTIN_KERNELS, env=env).for_model(None, None).decode_kernel == TORCH


@pytest.mark.parametrize("first, second", [("zai-org/*", "*GLM-5*"), ("*GLM-5*", "zai-org/*")])
def test_of_two_matching_globs_the_first_in_file_order_wins(tmp_path, first, second):
    """config.py docstring: ``[models."deepseek-ai/*"]`` is "an fnmatch glob (first match in file order)"."""
    path = _toml(tmp_path, f'[models."{first}"]\ndecode_kernel = "{TRITON}"\n'
                           f'[models."{second}"]\ndecode_kernel = "{TORCH}"\n')
    settings = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert settings.decode_kernel == TRITON and repr(first) in settings.origin("decode_kernel")


def test_sections_merge_key_by_key(tmp_path):
    """config.py: each key comes from the strongest section that sets it; a stronger section that
    does not set a key leaves the weaker section's value in place."""
    path = _toml(tmp_path, f'kv_scale_format = "pow2"\n[architectures.{GLM_ARCH}]\nprefill_kernel = "{TORCH}"\n'
                           f'[models."{GLM_NAME}"]\ndecode_kernel = "{TRITON}"\n')
    s = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert (s.prefill_kernel, s.decode_kernel, s.kv_scale_format) == (TORCH, TRITON, "pow2")
    assert s.origin("kv_scale_format") == path


# --- between sources: inline > its config_file > MLA_SM120_CONFIG > defaults ------------------------


def test_inline_beats_its_config_file_which_replaces_the_environment_file(tmp_path):
    """config.py: "Strongest first: the inline dict, the file it names (else the one MLA_SM120_CONFIG
    names), then defaults"; each pair with both sides set."""
    env_file = _toml(tmp_path, f'prefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\nkv_scale_format = "pow2"\n',
                     "env.toml")
    named = _toml(tmp_path, f'prefill_kernel = "{TRITON}"\ndecode_kernel = "{TRITON}"\n', "named.toml")
    env = {CONFIG_ENV: env_file}
    # MLA_SM120_CONFIG alone applies ...
    assert load_config(None, kernel_names=BUILTIN_KERNELS, env=env).for_model(GLM_NAME, GLM_ARCH).prefill_kernel == TORCH
    # ... the inline dict beats it ...
    s = load_config({"prefill_kernel": FLASHINFER}, kernel_names=BUILTIN_KERNELS, env=env).for_model(GLM_NAME, GLM_ARCH)
    assert (s.prefill_kernel, s.decode_kernel) == (FLASHINFER, TORCH)
    # ... the file named inline replaces it (its kv_scale_format is not read at all) ...
    s = load_config({"config_file": named}, kernel_names=BUILTIN_KERNELS, env=env).for_model(GLM_NAME, GLM_ARCH)
    assert (s.prefill_kernel, s.decode_kernel, s.kv_scale_format) == (TRITON, TRITON, "auto")
    assert s.origin("decode_kernel") == named
    # ... and the inline keys beat the file they name.
    s = load_config({"config_file": named, "decode_kernel": FLASHINFER}, kernel_names=BUILTIN_KERNELS,
                    env=env).for_model(GLM_NAME, GLM_ARCH)
    assert (s.prefill_kernel, s.decode_kernel) == (TRITON, FLASHINFER)
    assert "mla_sm120" in s.origin("decode_kernel") and s.origin("prefill_kernel") == named


def test_inline_top_level_beats_a_files_exact_model_section(tmp_path):
    """config.py: sources are ordered first, sections within a source: the inline top level beats
    the file's ``[models."<exact name>"]``."""
    path = _toml(tmp_path, f'[models."{GLM_NAME}"]\ndecode_kernel = "{TORCH}"\n')
    s = load_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS,
                    env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert s.decode_kernel == TRITON


def test_a_bad_value_in_the_weaker_source_still_fails_the_whole_config(tmp_path):
    """README: "nothing applies partially": a valid inline dict does not hide a broken file."""
    path = _toml(tmp_path, 'decode_kernel = "not_a_kernel"\n')
    with pytest.raises(ConfigError) as err:
        load_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path})
    assert_three_parts(str(err.value), path)
    assert "not_a_kernel" in str(err.value) and TRITON in str(err.value)


# --- the file reader: it re-checks the file after opening -----------------------------------------


def _as_regular(monkeypatch, size: int = 10) -> None:
    """``os.stat`` (before open) reports a small regular file whatever the path is: the path was
    swapped after the check, as files.py's docstring describes."""
    real = os.stat

    def fake(path, *args, **kwargs):
        fields = list(real(path, *args, **kwargs))
        fields[stat.ST_MODE] = stat.S_IFREG | 0o644
        fields[stat.ST_SIZE] = size
        return os.stat_result(fields)

    monkeypatch.setattr(files.os, "stat", fake)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_swapped_in_after_the_stat_is_refused_after_opening(tmp_path, monkeypatch):
    """files.py: "the file is opened non-blocking and checked again (fstat) in case it was swapped
    meanwhile". Without the re-check, the empty FIFO would read as an empty, valid TOML file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _as_regular(monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: str(fifo)})
    assert_three_parts(str(err.value), CONFIG_ENV)
    assert "a FIFO (named pipe)" in str(err.value) and "supported: a regular file" in str(err.value)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_swapped_in_after_the_stat_is_refused_as_a_device(monkeypatch):
    """files.py: "/dev/zero is a device" and is refused as one, even when the first stat was fooled."""
    _as_regular(monkeypatch)
    with pytest.raises(ConfigError, match="a character device"):
        files.read_toml("/dev/zero", label="--config '/dev/zero'")


def test_a_file_that_grew_between_the_stat_and_the_open_is_refused_from_fstat(tmp_path, monkeypatch):
    """files.py: the size is checked again on the opened file: the message gives the real size."""
    path = tmp_path / "big.toml"
    with open(path, "wb") as fh:
        fh.truncate(TOML_CAP + 5)
    _as_regular(monkeypatch, size=10)
    with pytest.raises(ConfigError) as err:
        files.read_toml(str(path), label="cfg")
    assert f"given: cfg: {TOML_CAP + 5} bytes" in str(err.value) and "at most 1 MiB" in str(err.value)


# --- the file reader: size caps, exactly --------------------------------------------------------


def _sized(path, size: int, body: bytes, pad: bytes) -> str:
    """``body`` padded with ``pad`` bytes to exactly ``size`` bytes."""
    assert len(body) <= size
    path.write_bytes(body + pad * (size - len(body)))
    assert path.stat().st_size == size
    return str(path)


def test_toml_of_exactly_1_mib_is_read_and_one_byte_more_is_refused(tmp_path):
    """files.py: the plugin TOML is bounded at 1 MiB (MAX_TOML_BYTES): at the cap it is read."""
    body = f'decode_kernel = "{TRITON}"\n#'.encode()
    path = _sized(tmp_path / "at.toml", TOML_CAP, body, b"#")
    assert load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(None, None) \
        .decode_kernel == TRITON
    over = _sized(tmp_path / "over.toml", TOML_CAP + 1, body, b"#")
    with pytest.raises(ConfigError) as err:
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: over})
    assert_three_parts(str(err.value), f"{CONFIG_ENV}=")
    assert f"{TOML_CAP + 1} bytes" in str(err.value) and "a plugin config TOML file of at most 1 MiB" in str(err.value)


def test_config_json_of_exactly_16_mib_is_read_and_one_byte_more_is_refused(tmp_path):
    """files.py: a HF config.json is bounded at 16 MiB (MAX_JSON_BYTES): at the cap it is read."""
    body = json.dumps({"architectures": [GLM_ARCH], "num_attention_heads": 64, "index_topk": 2048}).encode()
    at = tmp_path / "at"
    at.mkdir()
    _sized(at / "config.json", JSON_CAP, body, b" ")
    assert resolve_model(str(at), registry=get_registry()).num_heads == 64
    over = tmp_path / "over"
    over.mkdir()
    _sized(over / "config.json", JSON_CAP + 1, body, b" ")
    with pytest.raises(ConfigError) as err:
        resolve_model(str(over), registry=get_registry())
    assert_three_parts(str(err.value), f"--model {str(over)!r}")
    assert f"{JSON_CAP + 1} bytes" in str(err.value) and "a HF config.json of at most 16 MiB" in str(err.value)


@pytest.mark.parametrize("extra, refused", [(0, False), (1, True)], ids=["grown-to-the-cap", "grown-past-it"])
def test_a_file_that_grows_while_read_is_capped_exactly(tmp_path, monkeypatch, extra, refused):
    """files.py: "a regular file is read with a cap even after the stat said it was small (it may grow
    while we read)": both stats say 0 bytes; the file holds the cap (read whole) or one byte more."""
    path = tmp_path / "grown.toml"
    path.write_bytes(b"#" * (TOML_CAP + extra))
    real_stat, real_fstat = os.stat, os.fstat

    def small(result):
        fields = list(result)
        fields[stat.ST_SIZE] = 0
        return os.stat_result(fields)

    monkeypatch.setattr(files.os, "stat", lambda p, *a, **k: small(real_stat(p, *a, **k)))
    monkeypatch.setattr(files.os, "fstat", lambda fd: small(real_fstat(fd)))
    if refused:
        with pytest.raises(ConfigError) as err:
            files.read_toml(str(path), label="cfg")
        assert "given: cfg: more bytes than that" in str(err.value) and "at most 1 MiB" in str(err.value)
    else:
        assert files.read_toml(str(path), label="cfg") == {}


# --- the file reader: nesting, exactly ------------------------------------------------------------


def _json_nested(levels: int) -> bytes:
    """A config.json object whose deepest value sits ``levels`` levels deep (the object is level 1)."""
    inner = "[" * (levels - 1) + "]" * (levels - 1)
    return ('{"architectures": ["%s"], "num_attention_heads": 64, "x": %s}' % (GLM_ARCH, inner)).encode()


def test_json_nested_64_levels_is_read_and_65_is_refused(tmp_path):
    """files.py: values "nested deeper than MAX_NESTING" (64) are refused; 64 itself is read."""
    assert files.parse_json(_json_nested(NESTING), label="m")["num_attention_heads"] == 64
    with pytest.raises(ConfigError) as err:
        files.parse_json(_json_nested(NESTING + 1), label="m")
    assert_three_parts(str(err.value), "m: ")
    assert f"nested more than {NESTING} levels deep" in str(err.value)
    # A top-level list counts as the first level too.
    assert files.parse_json(b"[" * NESTING + b"]" * NESTING, label="m") is not None
    with pytest.raises(ConfigError, match=f"more than {NESTING} levels"):
        files.parse_json(b"[" * (NESTING + 1) + b"]" * (NESTING + 1), label="m")


@pytest.mark.parametrize("shape", ["arrays", "tables"])
def test_toml_nested_64_levels_is_read_and_65_is_refused(shape):
    """files.py: the TOML config is held to the same 64 levels (the document is level 1), for arrays
    and for tables (dotted keys nest without brackets)."""
    def text(levels: int) -> bytes:
        if shape == "arrays":
            return ("a = " + "[" * (levels - 1) + "]" * (levels - 1)).encode()
        return ("[" + ".".join(["m"] * (levels - 1)) + "]\n").encode()

    assert isinstance(files.parse_toml(text(NESTING), label="c"), dict)
    with pytest.raises(ConfigError) as err:
        files.parse_toml(text(NESTING + 1), label="c")
    assert_three_parts(str(err.value), "c: ")
    assert f"a plugin config TOML file nested at most {NESTING} levels" in str(err.value)


def test_a_scalar_document_nests_nothing():
    """files.check_nesting: "a scalar top level nests nothing"."""
    assert files.parse_json(b"7", label="m") == 7
    assert files.check_nesting("x", label="m", what=files.JSON_FILE) == "x"


# --- the file reader: numbers, exactly -------------------------------------------------------------


@pytest.mark.parametrize("sign", ["", "-"])
def test_json_integers_of_100_digits_are_read_and_101_refused(sign):
    """files.py: "integers longer than MAX_INT_DIGITS (100) are refused while parsing"; the sign is
    not a digit."""
    at = sign + "9" * INT_DIGITS
    assert files.parse_json(f'{{"n": {at}}}'.encode(), label="m")["n"] == int(at)
    with pytest.raises(ConfigError) as err:
        files.parse_json(f'{{"n": {sign}{"9" * (INT_DIGITS + 1)}}}'.encode(), label="m")
    assert_three_parts(str(err.value), "m: ")
    assert f"an integer with {INT_DIGITS + 1} digits" in str(err.value)
    assert f"integers of at most {INT_DIGITS} digits" in str(err.value)


def test_a_100_digit_head_count_is_a_range_error_not_a_parse_error(tmp_path):
    """Through ``--model``: a 100-digit count parses and is then refused by its range (the message
    gives the range); a 101-digit one is refused by the parser (the message counts the digits)."""
    for digits, needle in ((INT_DIGITS, "an integer from 1 to"), (INT_DIGITS + 1, f"{INT_DIGITS + 1} digits")):
        d = tmp_path / str(digits)
        d.mkdir()
        (d / "config.json").write_text('{"architectures": ["%s"], "num_attention_heads": %s}' % (GLM_ARCH, "9" * digits))
        with pytest.raises(ConfigError, match=needle):
            resolve_model(str(d), registry=get_registry())


def test_json_floats_up_to_the_float_range_are_read_and_beyond_refused():
    """files.py: "floats that overflow to inf" and NaN/Infinity are refused while parsing."""
    assert files.parse_json(b'{"x": 1e308}', label="m")["x"] == 1e308
    for text, needle in ((b'{"x": 1e309}', "outside the float range"), (b'{"x": NaN}', "the non-JSON constant NaN"),
                         (b'{"x": -Infinity}', "the non-JSON constant -Infinity")):
        with pytest.raises(ConfigError, match=needle):
            files.parse_json(text, label="m")


def test_toml_integers_up_to_pythons_limit_parse_and_beyond_are_a_config_error():
    """files.parse_toml: "an integer too long to convert" (over Python's int-str limit) is a
    ConfigError naming TOML's 64-bit integers, not a ValueError about sys.set_int_max_str_digits."""
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("this interpreter has no int-str limit")
    assert files.parse_toml(("a = " + "9" * limit).encode(), label="c")["a"] == int("9" * limit)
    with pytest.raises(ConfigError) as err:
        files.parse_toml(("a = " + "9" * (limit + 1)).encode(), label="c")
    assert_three_parts(str(err.value), "c: a value too large to read")
    assert "whose integers fit in 64 bits" in str(err.value)


# --- the file reader: what transformers reads, checked on the text (files.parse_json) ----------------


def test_a_config_json_with_a_byte_order_mark_is_refused_as_transformers_refuses_it(tmp_path, capsys):
    """files.parse_json: "UTF-8 without a byte-order mark, as transformers reads it": transformers'
    reader (open(..., encoding="utf-8") then json.loads) raises on the mark, so vLLM would too."""
    body = '{"architectures": ["%s"]}' % GLM_ARCH
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + body.encode())
    with pytest.raises(ValueError, match="BOM"):  # the engines' own reader, on the same file
        transformers.PretrainedConfig._dict_from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError) as err:
        files.parse_json(b"\xef\xbb\xbf" + body.encode(), label="m")
    assert str(err.value).splitlines() == [
        "given: m: starts with a UTF-8 byte-order mark (bytes EF BB BF)",
        "supported: a HF config.json in UTF-8 without a byte-order mark (transformers' reader, hence vLLM's, "
        "refuses the mark)",
        r"fix: re-save the file as UTF-8 without the mark (e.g. sed -i '1s/^\xEF\xBB\xBF//' config.json)"]
    assert cli.main(["check", "--model", str(tmp_path), "--sm", "12.0"]) == 2
    assert "byte-order mark" in capsys.readouterr().err
    assert files.parse_json(body.encode(), label="m") == {"architectures": [GLM_ARCH]}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "latin-1"])
def test_a_config_json_not_in_utf8_is_refused(encoding):
    """files.parse_json: UTF-8 only (json.loads on bytes would take UTF-16/32; transformers does not)."""
    with pytest.raises(ConfigError) as err:
        files.parse_json('{"architectures": ["Gl\u00e9"]}'.encode(encoding), label="m")
    assert str(err.value).splitlines()[1:] == ["supported: a HF config.json in UTF-8 (as transformers reads it)",
                                               "fix: re-save the file as UTF-8"]
    assert str(err.value).startswith("given: m: not UTF-8: ")


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_TRICKY_TEXT = st.text(alphabet='[]{}"\\\u00e9\n0e9-', max_size=6)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON_VALUES, wrap=st.integers(0, 70))
def test_the_text_level_checks_agree_with_the_parsed_value(value, wrap):
    """files.parse_json checks nesting and numbers on the text outside strings (brackets, quotes and
    backslashes inside strings must not count): a document is read back equal, and refused as too
    deep exactly when its parsed value nests deeper than 64."""
    for _ in range(wrap):
        value = [value] if wrap % 2 else {"k": value}
    text = json.dumps(value, ensure_ascii=bool(wrap % 3))
    skeleton = files._outside_strings(text)
    assert files._nesting(skeleton) == _depth(value)
    if _depth(value) > NESTING:
        with pytest.raises(ConfigError, match=f"nested more than {NESTING} levels deep"):
            files.parse_json(text.encode(), label="m")
    else:
        assert files.parse_json(text.encode(), label="m") == value


@pytest.mark.parametrize("text, needle", [
    ('{"a": [1, 2e308, 3]}', "the number '2e308', outside the float range"),
    ('{"a": "1e999 is a string", "b": 1E+0309}', "the number '1E+0309', outside the float range"),
    ('{"a": [1e-400, -%s]}' % ("9" * 101), "an integer with 101 digits"),
    ('{"a": %s.5}' % ("1" * 400), "the number '%s..., outside the float range" % ("1" * 56)),
    ('{"a": [1e-999, 0.%s]}' % ("1" * 300), None),
    ('{"a": "%s"}' % ("9" * 500), None),
])
def test_a_refused_number_is_named_however_the_text_hides_it(text, needle):
    """files.parse_json names the first refused number in document order; numbers only a string
    holds, a tiny exponent and a long fraction are read."""
    if needle is None:
        assert files.parse_json(text.encode(), label="m") == json.loads(text)
        return
    with pytest.raises(ConfigError) as err:
        files.parse_json(text.encode(), label="m")
    assert str(err.value).startswith(f"given: m: {needle}"), str(err.value)


def test_a_json_document_nested_65_deep_is_refused_word_for_word():
    """files.parse_json: depth 65 parses (below the parser's own recursion limit) and is refused by
    the text-level check, in the same three parts as a parser that recursed out of its stack."""
    lines = ["given: m: nested more than 64 levels deep", "supported: a HF config.json nested at most 64 levels",
             "fix: point at the right file"]
    for text in (b"[" * 65 + b"]" * 65, b'{"a": ' + b"[" * 64 + b"1" + b"]" * 64 + b"}"):
        with pytest.raises(ConfigError) as err:
            files.parse_json(text, label="m")
        assert str(err.value).splitlines() == lines
    # The per-number parse (run when a number may be refused) says the same when it recurses too deep.
    with pytest.raises(ConfigError) as err:
        files._parse_json_with_hooks("[" * 5000 + "1e999" + "]" * 5000, label="m")
    assert str(err.value).splitlines() == lines


@pytest.mark.parametrize("was_enabled", [True, False])
def test_the_garbage_collector_is_left_as_it_was(was_enabled):
    """files.parse_json pauses the cyclic collector while it parses, and leaves it as it found it,
    after a read and after a refusal."""
    import gc

    (gc.enable if was_enabled else gc.disable)()
    try:
        files.parse_json(b'{"a": [1, 2]}', label="m")
        assert gc.isenabled() is was_enabled
        with pytest.raises(ConfigError):
            files.parse_json(b'{"a": 1e999}', label="m")
        assert gc.isenabled() is was_enabled
    finally:
        gc.enable()


@pytest.mark.parametrize("scalar", [7, None, 1.5, True, "x"])
def test_a_scalar_checked_for_nesting_is_returned_as_it_is(scalar):
    """files.check_nesting (the TOML reader's walk): a scalar top level nests nothing."""
    assert files.check_nesting(scalar, label="c", what=files.TOML_FILE) is scalar


def test_the_config_read_benchmark_reports_every_shape(capsys):
    """benchmarks/bench_config_read.py at a small size: every shape is read, the refused one names
    its number, and check exits as parse_json decides (0 read, 2 refused)."""
    import bench_config_read

    assert bench_config_read.main(["--mib", "0.02", "--repeat", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["shape"] for r in rows] == list(bench_config_read.SHAPES)
    for r in rows:
        refused = r["shape"].endswith("101-digit int")
        assert r["verdict"] == ("given: config.json: an integer with 101 digits" if refused else "ok"), r
        assert r["check"] == ("exit 2" if refused else "exit 0"), r
        assert 0 < r["bytes"] <= 0.02 * (1 << 20) and r["parse_seconds"] >= 0 and r["check_seconds"] > 0


# --- the kernels' topk_length contract --------------------------------------------------------------


def _attention_float64(q, keys, indices, sm_scale, lengths):
    """Sparse attention written from the contract in kernels/__init__.py, in float64, one row at a
    time: the first min(topk_length[t], topk) candidates, minus -1 and out-of-range slots."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, 512, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        used = [int(s) for s in indices[t, : max(0, min(int(lengths[t]), indices.shape[1]))]]
        used = [s for s in used if 0 <= s < keys.shape[0]]
        if not used:
            continue
        k = keys[used]  # [n, 576]
        scores = (q[t].double() @ k.T) * sm_scale  # [H, n]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ k[:, :512]
    return out, lse


def test_topk_length_above_topk_is_clamped_to_topk():
    """kernels/__init__.py: "only the first topk_length[t] candidates are used"; a length above top-k
    uses the whole row (clamped), never reads past it; 0 gives out = 0 and lse = -inf."""
    gen = torch.Generator().manual_seed(18)
    slots, topk, heads = 128, 12, 3
    keys = torch.randn(slots, 576, generator=gen).to(torch.bfloat16)  # the bf16 layout: exact values
    cache = keys.view(2, 64, 576)
    q = torch.randn(6, heads, 576, generator=gen)
    indices = torch.randint(0, slots, (6, topk), generator=gen, dtype=torch.int32)
    indices[1, 3] = -1
    indices[2, 0] = slots + 7  # out of range: masked
    lengths = torch.tensor([topk + 1, topk + 50, 2**31 - 1, topk, 5, 0], dtype=torch.int32)
    out, lse = torch_sparse_mla(q, cache, indices, sm_scale=0.05, kv_layout="bf16", topk_length=lengths,
                                return_lse=True)
    ref_out, ref_lse = _attention_float64(q, keys.double(), indices, 0.05, lengths)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5 * ref_out.abs().max().item(), rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not finite[5].any()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
    assert torch.equal(out[5], torch.zeros_like(out[5]))


# --- where a forced kernel came from, as refusals name it ------------------------------------------


def test_a_refusal_names_the_source_of_each_forced_kernel_in_phase_order(capsys):
    """config.Settings.forced_by: every forced kernel "from" its source, prefill then decode."""
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0", "--prefill-kernel", "flashmla_kv",
                     "--decode-kernel", "trtllm"]) == cli.EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert "(prefill_kernel from command-line flags, decode_kernel from command-line flags)" in err
    assert "fix: remove the kernel override (prefill_kernel from command-line flags, decode_kernel from " \
           "command-line flags) or set it to one listed as able to run" in err


def test_an_exact_section_written_before_a_glob_still_leaves_the_globs_other_keys(tmp_path):
    """config.py: an exact section and a glob both match; the exact one wins the keys it sets, the
    glob still supplies the rest (file order decides only between globs). A name with no glob
    character is never taken for a glob."""
    name = "acme/MODEL-X"
    path = _toml(tmp_path, f'[models."{name}"]\ndecode_kernel = "{TRITON}"\n'
                           f'[models."acme/*"]\ndecode_kernel = "{TORCH}"\nkv_scale_format = "pow2"\n')
    s = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(name, GLM_ARCH)
    assert (s.decode_kernel, s.kv_scale_format) == (TRITON, "pow2")
    assert s.origin("kv_scale_format") == f"{path} [models.'acme/*']"


# --- how each engine's --kv-cache-dtype reads (engines.py, README) --------------------------------------


@pytest.mark.parametrize("engine, given, sm_family, layout", [
    ("vllm", None, 12, "bf16"), ("vllm", "auto", 12, "bf16"),  # README: auto/bfloat16 is a bf16 cache on vLLM
    ("vllm", "bfloat16", 12, "bf16"), ("vllm", "bf16", 12, "bf16"), ("vllm", "fp8_ds_mla", 12, "fp8_ds_mla"),
    ("vllm", "fp8", 12, "fp8"), ("vllm", "fp8_e4m3", 12, "fp8_e4m3"),  # not rewritten for CUSTOM: refused later
    ("sglang", "auto", 12, "fp8_ds_mla"), ("sglang", "auto", 10, "fp8_ds_mla"),  # SGLang: auto is fp8 on SM >= 10
    ("sglang", "auto", 9, "bf16"), ("sglang", None, None, "bf16"), ("sglang", "fp8_e4m3", 12, "fp8_ds_mla"),
    ("sglang", "bfloat16", 12, "bf16"), ("sglang", "bf16", 9, "bf16"), ("sglang", "fp8_e5m2", 12, "fp8_e5m2"),
])
def test_each_engines_kv_cache_dtype_spelling_means_one_layout(engine, given, sm_family, layout):
    """README "Use with vLLM" / "Use with SGLang": what each engine's --kv-cache-dtype means for a DSA
    model (fp8_e4m3 is SGLang's name for the 656-byte layout; SGLang turns auto into it on SM >= 10)."""
    from mla_sm120_plugin.context import kv_layout

    assert kv_layout(given, engine, sm_family) == layout


def test_kv_layout_reads_vllms_spelling_by_default_and_engines_name_their_layouts():
    """context.kv_layout: the engine is vLLM unless named; Engine.spelling: each engine's own word."""
    from mla_sm120_plugin.context import kv_layout
    from mla_sm120_plugin.engines import SGLANG, VLLM

    assert kv_layout("auto", sm_family=12) == "bf16" and kv_layout("fp8_e4m3") == "fp8_e4m3"
    assert (VLLM.spelling("fp8_ds_mla"), SGLANG.spelling("fp8_ds_mla"), SGLANG.spelling("bf16")) == \
        ("fp8_ds_mla", "fp8_e4m3", "bf16")
    assert SGLANG.spelling("a-layout-it-has-no-word-for") == "a-layout-it-has-no-word-for"


# --- the context builder and the engine limits (context.py) ---------------------------------------------


def test_build_context_carries_every_input_through():
    """context.build_context: the model facts, the settings, the device, the KV spelling and the
    engine limits each land in their field of the context."""
    from mla_sm120_plugin.config import Settings
    from mla_sm120_plugin.context import EngineLimits, build_context
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.modelinfo import ModelFacts

    facts = ModelFacts(arch=GLM_ARCH, name="my/model", num_heads=64, index_topk=1024, kv_lora_rank=512,
                       qk_rope_head_dim=64)
    settings = Settings(prefill_kernel=TORCH, decode_kernel="auto", kv_scale_format="pow2",
                        origins={"prefill_kernel": "here"})
    limits = EngineLimits(tensor_parallel_size=8, max_decode_tokens=48, max_prefill_tokens=4096, cuda_graphs=False,
                          features={"dcp"}, engine="sglang")
    ctx = build_context(facts, settings, parse_device("12.1", source="--sm"), "fp8_e4m3", limits)
    assert (ctx.model_arch, ctx.model_name, ctx.num_heads, ctx.index_topk) == (GLM_ARCH, "my/model", 8, 1024)
    assert (ctx.kv_cache_dtype, ctx.kv_cache_dtype_given, ctx.engine) == ("fp8_ds_mla", "fp8_e4m3", "sglang")
    assert (ctx.prefill_kernel, ctx.decode_kernel, ctx.kv_scale_format) == (TORCH, "auto", "pow2")
    assert (ctx.max_decode_tokens, ctx.max_prefill_tokens, ctx.cuda_graphs) == (48, 4096, False)
    assert (ctx.tensor_parallel_size, ctx.features, ctx.forced_by) == (8, frozenset({"dcp"}), "prefill_kernel from here")
    assert (ctx.device.sm, ctx.kv_lora_rank, ctx.qk_rope_head_dim) == ("12.1", 512, 64)
    # kv_scale_format auto: the engine's own writer decides (SGLang: arbitrary); vLLM leaves it to the model.
    auto = Settings()
    sglang_auto = build_context(facts, auto, parse_device("12.1", source="--sm"), None, limits)
    assert (sglang_auto.kv_scale_format, sglang_auto.kv_cache_dtype) == ("arbitrary", "fp8_ds_mla")
    vllm = EngineLimits(tensor_parallel_size=8)
    plain = build_context(facts, auto, parse_device("12.1", source="--sm"), None, vllm)
    assert (plain.kv_scale_format, plain.kv_cache_dtype, plain.kv_cache_dtype_given) == ("auto", "bf16", None)
    assert (plain.max_decode_tokens, plain.max_prefill_tokens, plain.cuda_graphs) == (None, None, True)


@pytest.mark.parametrize("field, value", [
    ("tensor_parallel_size", 0), ("tensor_parallel_size", None), ("tensor_parallel_size", True),
    ("max_decode_tokens", 0), ("max_decode_tokens", "3"), ("max_decode_tokens", True),
    ("max_prefill_tokens", -1), ("max_prefill_tokens", 2.0),
])
def test_engine_limits_refuse_what_is_not_a_positive_int(field, value):
    """context.EngineLimits: sizes are positive ints (bool is not one); the token bounds may be None."""
    from mla_sm120_plugin.context import EngineLimits

    kwargs = {field: value}
    if field == "max_prefill_tokens":
        kwargs["max_decode_tokens"] = None  # a None before it does not end the checks
    with pytest.raises(ConfigError) as err:
        EngineLimits(**kwargs)
    msg = str(err.value)
    assert msg == (f"given: {field}={value!r}\nsupported: a positive integer\n"
                   f"fix: set {field.replace('_', '-')} to 1 or more")


def test_engine_limits_name_the_engines_and_take_the_engines_scale_format():
    """context.EngineLimits: an unknown engine is refused naming the known ones; scale_format None
    means the engine's own (SGLang: arbitrary, vLLM: the model's); features become a frozenset."""
    from mla_sm120_plugin.context import EngineLimits

    with pytest.raises(ConfigError) as err:
        EngineLimits(engine="trt")
    assert str(err.value) == ("given: engine='trt'\nsupported: one of ['vllm', 'sglang']\n"
                              "fix: pass the engine the context is built for")
    assert EngineLimits(engine="sglang").scale_format == "arbitrary"
    assert EngineLimits(engine="sglang", scale_format="pow2").scale_format == "pow2"
    assert EngineLimits().scale_format is None
    limits = EngineLimits(features=["dcp", "dcp"])
    assert limits.features == frozenset({"dcp"}) and isinstance(limits.features, frozenset)
    assert EngineLimits(max_decode_tokens=None, max_prefill_tokens=None).max_prefill_tokens is None


# --- refusals in the documented words (README, rules.py) -----------------------------------------


def _refusal(capsys, *argv: str) -> list[str]:
    assert cli.main(["check", *argv]) == cli.EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert_three_parts(err.split("UnsupportedConfiguration: ", 1)[1])
    return err.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n").splitlines()


def test_sm90_refusal_is_the_one_the_readme_prints(capsys):
    """README "The main job": the SM90 refusal, line for line (given, the reason, supported, fix)."""
    lines = _refusal(capsys, "--model", "glm-5", "--sm", "9.0")
    assert lines[0].startswith("given: model_arch=GlmMoeDsaForCausalLM, sm=9.0, kv_cache_dtype=fp8_ds_mla, "
                               "heads_per_rank=64 (tp=1), ")
    assert lines[1:] == [
        "  - device sm_90: this plugin serves SM12x only",
        "supported: an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)",
        "fix: on sm_90 serve without this plugin: drop --attention-backend CUSTOM; vLLM's own sparse-MLA backends "
        "serve DSA models there (FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90)",
    ]


@pytest.mark.parametrize("sm, where", [("cpu", "no GPU (CPU)"), ("rocm", "a ROCm GPU")])
def test_a_device_that_is_not_nvidia_is_refused_with_how_to_plan(capsys, sm, where):
    """rules.py: off NVIDIA the refusal says what the device is and how to plan for an SM12x GPU."""
    lines = _refusal(capsys, "--model", "glm-5", "--sm", sm)
    assert f"  - device {where}: this plugin serves NVIDIA SM12x GPUs only" in lines
    assert "supported: an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)" in lines
    assert lines[-1] == ("fix: run on an SM12x GPU, or plan for one with --sm 12.0 (RTX 50xx / RTX PRO 6000) or "
                         "--sm 12.1 (DGX Spark)")


@pytest.mark.parametrize("engine, kv, fix", [
    ("vllm", "fp8", "fix: pass --kv-cache-dtype fp8_ds_mla (the 656-byte DSA layout); plain fp8 is not rewritten for "
                    "a plugin backend (SGLang's fp8_e4m3 is that layout: plan for SGLang with mla-sm120 check "
                    "--engine sglang)"),
    ("vllm", "int8", "fix: pass --kv-cache-dtype fp8_ds_mla (the 656-byte DSA layout), or --kv-cache-dtype auto "
                     "(or bfloat16) for a bf16 cache"),
    ("sglang", "fp8_e5m2", "fix: pass --kv-cache-dtype fp8_e4m3 (the 656-byte DSA layout), or --kv-cache-dtype "
                           "bfloat16 for a bf16 cache"),
])
def test_an_unreadable_kv_cache_dtype_names_the_flag_to_pass(capsys, engine, kv, fix):
    """README: plain fp8 on vLLM "would be the wrong layout: the plugin refuses it and names the flag
    to pass"; every engine's refusal is in its own spellings."""
    lines = _refusal(capsys, "--engine", engine, "--model", "glm-5", "--sm", "12.0", "--kv-cache-dtype", kv)
    assert f"  - kv_cache_dtype {kv}: no kernel reads that layout" in lines
    spelled = "fp8_ds_mla" if engine == "vllm" else "fp8_e4m3"
    assert (f"supported: {spelled} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or bf16") in lines
    assert lines[-1] == fix


def test_kv_dtype_fix_speaks_vllm_unless_told_otherwise():
    """rules.kv_dtype_fix: the engine defaults to vLLM."""
    from mla_sm120_plugin.rules import kv_dtype_fix

    assert "plain fp8 is not rewritten" in kv_dtype_fix("fp8")
    assert kv_dtype_fix("fp8", "sglang").startswith("pass --kv-cache-dtype fp8_e4m3")


def test_a_tensor_parallel_size_that_is_not_an_int_is_refused_in_three_parts():
    """modelinfo.ModelFacts.heads_per_rank: given / supported / fix."""
    from mla_sm120_plugin.modelinfo import ModelFacts

    with pytest.raises(ConfigError) as err:
        ModelFacts(arch=GLM_ARCH, name="m", num_heads=64, index_topk=2048).heads_per_rank(0)
    assert str(err.value) == ("given: tensor_parallel_size=0 (int)\nsupported: an int >= 1 that divides the head "
                              "count\nfix: pass the tensor-parallel size as a positive int")
    from mla_sm120_plugin.errors import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration) as err:
        ModelFacts(arch=GLM_ARCH, name="m", num_heads=64, index_topk=2048).heads_per_rank(3)
    assert str(err.value) == ("given: tensor_parallel_size=3 for m with 64 heads\nsupported: a divisor of 64\n"
                              "fix: pick a tensor-parallel size that divides the head count")


def test_size_limits_are_written_in_mib_only_when_whole(tmp_path):
    """files.py: a bound is "N MiB" when it is a whole number of MiB, else "N bytes"."""
    path = tmp_path / "f"
    path.write_bytes(b"#" * ((1 << 20) + 2))
    for cap, words in ((10, "at most 10 bytes"), ((1 << 20) + 1, "at most 1048577 bytes"), (0, "at most 0 bytes")):
        with pytest.raises(ConfigError) as err:
            files.read_bytes(str(path), label="f", what=files.TOML_FILE, max_bytes=cap)
        assert f"supported: {files.TOML_FILE} of {words}\n" in str(err.value)
        assert str(err.value).endswith("fix: point at the right file; this one is far larger than any config")


# --- a kernel's envelope, at its edges (types.KernelSpec, selection.envelope_reasons) ----------------


def _edge_registry(**spec_fields):
    """The built-ins plus one third-party kernel, ``edge``, of the highest priority, with the given
    envelope (types.KernelSpec: heads inclusive, topk_min, topk_multiple, max_tokens)."""
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.types import KernelSpec

    fields = dict(name="edge", phases=frozenset({"prefill", "decode"}), kv_cache_dtypes=frozenset({"fp8_ds_mla", "bf16"}),
                  vendors=frozenset({"nvidia", "cpu"}), sm_families=frozenset({12}), entry="edge.kernel:run",
                  priority=10_000)
    fields.update(spec_fields)

    class Edge:
        @hookimpl
        def mla_sm120_kernels(self):
            yield KernelSpec(**fields)

    return build_registry(load_entry_points=False, extra_plugins={"edge": Edge()})


def _edge_ctx(*, heads=16, topk=2048, device=None, **kw):
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    return SelectionContext(GLM_ARCH, "fp8_ds_mla", heads, topk, device or parse_device("12.0", source="--sm"), **kw)


def _edge_reasons(decision, phase="decode") -> tuple[str, ...]:
    return next((r.reasons for r in decision.rejections if r.kernel == "edge" and r.phase == phase), ())


def test_a_kernels_head_range_is_inclusive_at_both_ends():
    """types.KernelSpec: ``heads`` is the "inclusive (min, max) heads per rank"."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(heads=(8, 32))
    for heads in (8, 32):
        assert select(_edge_ctx(heads=heads), registry=reg).decode == "edge"
    for heads in (4, 64):
        d = select(_edge_ctx(heads=heads), registry=reg)
        assert d.decode != "edge" and _edge_reasons(d) == (f"heads per rank {heads} outside [8, 32]",)


def test_a_kernels_top_k_bounds_are_exact():
    """types.KernelSpec: "topk_min: smallest index top-k"; "top-k must be a multiple of" topk_multiple."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(topk_min=512, topk_multiple=256)
    for topk in (512, 768, 2048):
        assert select(_edge_ctx(topk=topk), registry=reg).decode == "edge"
    assert _edge_reasons(select(_edge_ctx(topk=256), registry=reg)) == ("index_topk 256 < 512",)
    assert _edge_reasons(select(_edge_ctx(topk=640), registry=reg)) == ("index_topk 640 not a multiple of 256",)
    assert _edge_reasons(select(_edge_ctx(topk=300), registry=reg)) == \
        ("index_topk 300 < 512", "index_topk 300 not a multiple of 256")


def test_a_kernels_token_limit_takes_calls_up_to_it_and_never_unbounded_ones():
    """types.KernelSpec: "max_tokens: most query tokens one call takes"; context.EngineLimits: a
    bound of None means "unbounded or unknown", which such a kernel cannot take (as FlashInfer's own
    envelope reads it)."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(max_tokens=64)
    d = select(_edge_ctx(max_decode_tokens=64, max_prefill_tokens=65), registry=reg)
    assert d.decode == "edge" and d.prefill != "edge"
    assert _edge_reasons(d, "prefill") == ("prefill may see 65 tokens a call, kernel takes <= 64",)
    d = select(_edge_ctx(max_decode_tokens=None, max_prefill_tokens=64), registry=reg)
    assert d.prefill == "edge" and d.decode != "edge"
    assert _edge_reasons(d) == ("decode may see calls of any length (no bound given), kernel takes <= 64",)


def test_a_kernels_own_envelope_check_sees_the_phase_and_profile_and_only_runs_within_the_static_one():
    """types.KernelSpec: ``envelope`` adds per-phase checks to the static envelope; selection: a
    check that raises is a reason, never a crash."""
    from mla_sm120_plugin.selection import select

    calls = []

    def envelope(ctx, phase, profile):
        calls.append((phase, ctx.num_heads))
        return [f"{phase} refused for {profile.name}"] if phase == "decode" else []

    reg = _edge_registry(heads=(8, 32), envelope=envelope)
    d = select(_edge_ctx(), registry=reg)
    assert d.prefill == "edge" and d.decode != "edge"
    assert _edge_reasons(d) == ("decode refused for glm-5",)
    calls.clear()
    select(_edge_ctx(heads=64), registry=reg)  # outside the static envelope: not asked
    assert calls == []

    def broken(ctx, phase, profile):
        raise ValueError("table missing")

    d = select(_edge_ctx(), registry=_edge_registry(envelope=broken))
    assert _edge_reasons(d) == ("envelope check failed: ValueError: table missing",)


def test_a_probe_decides_on_a_present_device_and_a_crashing_probe_is_a_reason():
    """selection.probe_reasons: a kernel's probe runs for the device this machine has (not for a
    planned one), its reasons reject the kernel, and a probe that raises is a reason too."""
    from mla_sm120_plugin.selection import clear_probe_cache, select
    from mla_sm120_plugin.types import DeviceInfo

    seen = []

    def probe(device):
        seen.append(device.sm)
        return ["needs the edge toolkit"]

    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(probe=probe))
    assert d.decode != "edge" and _edge_reasons(d) == ("needs the edge toolkit",) and seen == ["12.0"]
    seen.clear()
    assert select(_edge_ctx(), registry=_edge_registry(probe=probe)).decode == "edge"  # planned: not probed
    assert seen == []

    def crash(device):
        raise RuntimeError("driver gone")

    clear_probe_cache()  # probe results are cached per kernel and device
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(probe=crash))
    assert _edge_reasons(d) == ("probe failed: RuntimeError: driver gone",)


def test_the_sm_family_envelope_applies_to_nvidia_only(monkeypatch):
    """selection.envelope_reasons: ``sm_families`` restricts NVIDIA devices; tensors on the CPU
    (``sparse_mla_forward(kernel="auto")``) are not held to it."""
    from mla_sm120_plugin.selection import choose_kernel_for_shape

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's probe: the interpreter runs it on the CPU
    assert choose_kernel_for_shape(kv_layout="bf16", num_heads=8, topk=64, num_tokens=4, device_type="cpu") == TRITON


# --- the decision as check prints it (report.explain, decision_to_dict, the refusal's parts) ---------


def test_check_prints_the_model_the_bounds_and_each_rejection(capsys):
    """README "The main job": check prints "a table of kernels": the model as the user named it (and
    its profile), the call bounds, CUDA graphs, then each phase's kernel and every rejection."""
    assert cli.main(["check", "--model", "zai-org/GLM-5-FP8", "--sm", "12.1", "--tp", "16",
                     "--max-decode-tokens", "64", "--max-prefill-tokens", "4096", "--enforce-eager"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model      zai-org/GLM-5-FP8 (GlmMoeDsaForCausalLM, profile glm-5)"
    assert "shape      4 heads per rank (tensor parallel 16), index_topk 2048" in lines
    assert "calls      decode <= 64 tokens, prefill <= 4096 tokens; CUDA graphs off" in lines
    header = lines.index("phase    kernel                   status")
    assert lines[header - 1] == ""
    assert lines[header + 1].startswith("prefill  ") and " SELECTED (exact class: cos_diff <= 5e-06, " in lines[header + 1]
    assert any(line.startswith(" " * 9 + "flashinfer_sparse_mla    rejected: ") for line in lines[header:])
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0"]) == 0
    assert "calls      decode of any length, prefill of any length; CUDA graphs on" in capsys.readouterr().out


def test_a_rejection_with_several_reasons_lists_them_on_one_line():
    """selection.explain: "each rejection" on its own line, its reasons joined by "; "."""
    from mla_sm120_plugin.report import explain
    from mla_sm120_plugin.selection import select

    d = select(_edge_ctx(heads=4, topk=2048), registry=_edge_registry(heads=(8, 32), topk_min=4096))
    lines = explain(d).splitlines()
    assert " " * 9 + f"{'edge':<24} rejected: heads per rank 4 outside [8, 32]; index_topk 2048 < 4096" in lines
    assert "\n".join(lines) == explain(d) and not any("XX" in line for line in lines)


def test_check_json_reports_the_decision(capsys):
    """README: ``check --json``: machine-readable: the model, device, cache, shape and each kernel."""
    assert cli.main(["check", "--model", "zai-org/GLM-5-FP8", "--sm", "12.1", "--tp", "8", "--json",
                     "--kv-cache-dtype", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["servable"] is True
    assert (report["model_arch"], report["model_name"], report["profile"]) == (GLM_ARCH, "zai-org/GLM-5-FP8", "glm-5")
    assert report["device"] == {"sm": "12.1", "vendor": "nvidia", "name": report["device"]["name"], "source": "--sm"}
    assert (report["kv_cache_dtype"], report["scale_format"]) == ("bf16", "arbitrary")
    assert (report["tensor_parallel_size"], report["heads_per_rank"], report["index_topk"]) == (8, 8, 2048)
    assert set(report["kernels"]) == {"prefill", "decode"} and FLASHINFER not in report["kernels"].values()
    fi = [r for r in report["rejected"] if r["kernel"] == FLASHINFER]
    assert {r["phase"] for r in fi} == {"prefill", "decode"}
    assert all(r["reasons"][0].startswith("reads kv_cache_dtype ['fp8_ds_mla'") and r["reasons"][0].endswith("], not bf16")
               for r in fi)
    assert isinstance(report["notes"], list)


def test_the_supported_line_lists_every_kernel_best_first():
    """selection: a refusal's "supported" part lists each kernel, highest priority first, with its
    devices, cache layouts and head range."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(decode_kernel="trtllm"), registry=_edge_registry(heads=(8, 32)))
    supported = next(line for line in str(err.value).splitlines() if line.startswith("supported: "))
    assert supported.startswith("supported: for glm-5: edge (cpu/nvidia SM12x, kv bf16/fp8_ds_mla, heads 8-32), ")
    fi, torch_ref = "flashinfer_sparse_mla (nvidia SM12x, kv ", "torch_sparse_mla (amd/cpu/nvidia, kv "
    assert fi in supported and torch_ref in supported and supported.index(fi) < supported.index(torch_ref)
    assert supported.endswith(", heads 1-128)")


def _fix_line(err) -> str:
    return next(line for line in str(err.value).splitlines() if line.startswith("fix: "))


def test_the_fix_names_only_the_fixes_that_apply(monkeypatch):
    """selection: "the fixes that apply to this refusal only": the override fix only when a kernel is
    forced, the fp8 flag only for a cache the rejected kernels cannot read, installing only for a
    probe that says pip install; else the generic advice."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo

    monkeypatch.setenv("MLA_SM120_DISABLE_PLUGINS", "mla_sm120.kernels")  # only the edge kernel
    reg = _edge_registry(heads=(8, 32))
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4), registry=reg)
    assert _fix_line(err) == ("fix: change the combination to one a kernel above supports (each rejection says what "
                              "it needs)")
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4, prefill_kernel="edge"), registry=reg)
    assert _fix_line(err).startswith("fix: remove the kernel override (") and "change the combination" not in str(err.value)
    fp8_only = _edge_registry(kv_cache_dtypes=frozenset({"fp8_ds_mla"}))
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4).__class__(GLM_ARCH, "bf16", 16, 2048, _edge_ctx().device, decode_kernel="edge"),
               registry=fp8_only)
    assert _fix_line(err) == ("fix: remove the kernel override (config) or set it to one listed as able to run; "
                              "use --kv-cache-dtype fp8_ds_mla for the kernels that read only the fp8 cache")
    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    missing = _edge_registry(probe=lambda device: ["pip install edge-kernels"])
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(device=present, cuda_graphs=False), registry=missing)
    assert _fix_line(err) == "fix: install what a probe above reports missing"


# --- bare tensors and the launcher's exported context -----------------------------------------------------


@pytest.mark.parametrize("tokens, phase", [(64, "decode"), (65, "prefill")])
def test_bare_tensors_up_to_64_rows_are_decoded_and_refused_with_the_reasons(monkeypatch, tokens, phase):
    """kernels/__init__.py: ``kernel="auto"`` asks ``choose_kernel_for_shape``, which treats up to 64
    query rows as a decode call (selection.DECODE_TOKENS_MAX) and refuses a shape no kernel takes."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import choose_kernel_for_shape

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton cannot run here without its interpreter
    assert choose_kernel_for_shape(kv_layout="bf16", num_heads=8, topk=64, num_tokens=tokens,
                                   device_type="cpu") == TORCH
    with pytest.raises(UnsupportedConfiguration) as err:
        choose_kernel_for_shape(kv_layout="bf16", num_heads=200, topk=64, num_tokens=tokens, device_type="cpu")
    msg = str(err.value)
    assert_three_parts(msg, "model_arch=<tensors>, sm=cpu, kv_cache_dtype=bf16, heads_per_rank=200")
    assert f": no kernel can run {phase} (" in msg and "; torch_sparse_mla: heads per rank 200 outside [1, 128]" in msg
    assert "flashinfer_sparse_mla: runs on ['nvidia'], not cpu, reads kv_cache_dtype [" in msg
    assert msg.endswith("\nsupported: see each kernel's reasons\n"
                        "fix: pass kernel= explicitly, or install what a probe reports missing")


def test_the_launchers_context_reaches_the_schedulers_whole():
    """context.context_to_json / context_from_json: what SGLang's launcher decided is what each
    scheduler decides again (every field, the device and the features); other text is refused."""
    from mla_sm120_plugin.context import context_from_json, context_to_json
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    ctx = SelectionContext(GLM_ARCH, "fp8_ds_mla", 8, 1024, parse_device("12.1", source="sglang"), model_name="m",
                           features=frozenset({"dcp", "hisparse"}), max_decode_tokens=48, decode_kernel=TRITON)
    text = context_to_json(ctx)
    fields = json.loads(text)
    assert fields["features"] == ["dcp", "hisparse"] and fields["device"]["sm_major"] == 12
    assert list(fields) == sorted(fields)
    back = context_from_json(text)
    assert back == ctx and isinstance(back.features, frozenset) and back.device.sm == "12.1"
    for bad in ("not json", "{}", json.dumps({**fields, "device": {"vendor": "tpu"}}), "[]"):
        with pytest.raises(ConfigError) as err:
            context_from_json(bad)
        assert_three_parts(str(err.value), "a serialized selection context that does not parse (")
        if bad == "not json":
            assert "does not parse (JSONDecodeError: " in str(err.value)
        assert str(err.value).endswith("supported: what context_to_json wrote, from this plugin version\n"
                                       "fix: restart the engine so its launcher decides again")


# --- the decision itself: every problem at once, who was passed over and why, what may stand in ------------


def test_both_phases_problems_are_reported_at_once(monkeypatch):
    """selection.select: a refusal lists every phase's problem (forced kernels that cannot run, and
    phases no kernel can run, each with every kernel's reasons)."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(prefill_kernel="flashmla_kv", decode_kernel="trtllm"), registry=_edge_registry())
    given = str(err.value).split("\nsupported: ")[0]
    assert "\n  - prefill kernel flashmla_kv (config) cannot run: flashmla_kv is another engine's impl" in given
    assert "\n  - decode kernel trtllm (config) cannot run: trtllm is another engine's impl" in given
    assert given.count("can run: edge, ") == 2
    problems = given.splitlines()[1:]
    assert len(problems) == 2 and all(p.endswith(", torch_sparse_mla") for p in problems)
    monkeypatch.setenv("MLA_SM120_DISABLE_PLUGINS", "mla_sm120.kernels")  # only the edge kernel
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4), registry=_edge_registry(heads=(8, 32), topk_min=4096))
    given = str(err.value).split("\nsupported: ")[0]
    for phase in ("prefill", "decode"):
        assert (f"\n  - no kernel can run {phase}:\n      edge: heads per rank 4 outside [8, 32]; index_topk 2048 "
                "< 4096") in given
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4, decode_kernel="edge"), registry=_edge_registry(heads=(8, 32)))
    assert "decode kernel edge (config) cannot run: heads per rank 4 outside [8, 32]; decode can run: nothing" in str(err.value)


def test_the_decision_says_why_each_viable_kernel_was_passed_over_and_keeps_them_as_stand_ins():
    """selection.select: "records every rejection with reasons": a viable kernel that was not chosen
    is "lower priority than" the pick, or "not the forced kernel"; the chosen one is never listed as
    rejected; the others stay, best first, as the phase's alternates (the self-check's fallbacks)."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry()
    d = select(_edge_ctx(kv_cache_dtype_given=None), registry=reg)
    assert d.decode == "edge"
    assert ("decode", ("lower priority than edge",)) in {(r.phase, r.reasons) for r in d.rejections if r.kernel == TORCH}
    assert not [r for r in d.rejections if r.kernel == "edge"]
    assert d.alternates["decode"][0] != "edge" and TORCH in d.alternates["decode"]
    assert list(d.alternates["decode"]) == [n for n in d.alternates["decode"] if n != "edge"]
    forced = select(_edge_ctx(decode_kernel=TORCH, cuda_graphs=False), registry=reg)
    assert forced.decode == TORCH and "edge" in forced.alternates["decode"]
    assert {r.reasons for r in forced.rejections if r.kernel == "edge" and r.phase == "decode"} == \
        {("not the forced kernel",)}
    assert not [r for r in forced.rejections if r.kernel == TORCH and r.phase == "decode"]


def test_a_select_hook_sees_the_context_and_the_phase():
    """hooks/specs.py ``mla_sm120_select(ctx, phase, candidates)``: the policy override is asked with
    the real context and phase."""
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.selection import select

    class TorchDecodesAt16Heads:
        @hookimpl
        def mla_sm120_select(self, ctx, phase, candidates):
            return TORCH if phase == "decode" and ctx.num_heads == 16 and TORCH in candidates else None

    reg = build_registry(load_entry_points=False, extra_plugins={"torch16": TorchDecodesAt16Heads()})
    d = select(_edge_ctx(heads=16, cuda_graphs=False), registry=reg)
    assert d.decode == TORCH and d.prefill != TORCH
    assert select(_edge_ctx(heads=32, cuda_graphs=False), registry=reg).decode != TORCH


def test_select_uses_the_process_registry_by_default():
    """selection.select: ``registry`` defaults to the process-wide one (the built-ins here)."""
    from mla_sm120_plugin.selection import select

    assert select(_edge_ctx()).decode == FLASHINFER


# --- every refusal of the file reader, in its three parts (files.py) --------------------------------------


@pytest.mark.parametrize("data, given, supported, fix", [
    (b"\xff = 1", "c: not UTF-8: ", "a UTF-8 TOML file", "re-save the file as UTF-8"),
    (b"decode_kernel = ", "c: invalid TOML: ", "TOML 1.0", "fix the syntax at the position given"),
    (b"a = " + b"9" * 5000, "c: a value too large to read: ", "TOML 1.0, whose integers fit in 64 bits",
     "correct the value"),
    (b"a = " + b"[" * 5000 + b"]" * 5000, "c: nested more than 64 levels deep",
     "a plugin config TOML file nested at most 64 levels", "point at the right file"),
    (b"a = " + b"[" * NESTING + b"]" * NESTING, "c: nested more than 64 levels deep",
     "a plugin config TOML file nested at most 64 levels", "point at the right file"),
], ids=["not-utf8", "syntax", "huge-int", "deep-parser", "deep-value"])
def test_each_toml_refusal_names_what_was_given_what_is_read_and_the_fix(data, given, supported, fix):
    """files.py: "each refusal is a ConfigError that names the path, what it is, and what is accepted"."""
    with pytest.raises(ConfigError) as err:
        files.parse_toml(data, label="c")
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"given: {given}") and lines[1:] == [f"supported: {supported}", f"fix: {fix}"]


@pytest.mark.parametrize("data, given, supported, fix", [
    (b'{"a": ', "m: invalid JSON: ", "a HF config.json", "fix the syntax at the position given, or point at the "
                                                         "model's config.json"),
    (b"[" * 5000 + b"]" * 5000, "m: nested more than 64 levels deep", "a HF config.json nested at most 64 levels",
     "point at the right file"),
    (b'{"a": 1e999}', "m: the number '1e999', outside the float range",
     "a HF config.json: finite numbers, integers of at most 100 digits",
     "write the value as a plain finite number, or point at the model's own config.json"),
], ids=["syntax", "deep", "overflow"])
def test_each_json_refusal_names_what_was_given_what_is_read_and_the_fix(data, given, supported, fix):
    """files.py: the same three parts for a model's config.json."""
    with pytest.raises(ConfigError) as err:
        files.parse_json(data, label="m")
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"given: {given}") and lines[1:] == [f"supported: {supported}", f"fix: {fix}"]


def test_a_missing_or_unreadable_path_is_named_with_what_was_expected(tmp_path):
    """files.py: a missing file and an unreadable one name the path and the kind of file expected."""
    with pytest.raises(ConfigError) as err:
        files.read_toml(str(tmp_path / "nope.toml"), label="cfg")
    assert str(err.value) == ("given: cfg: no such file\nsupported: an existing regular file: a plugin config TOML "
                              "file\nfix: fix the path")
    with pytest.raises(ConfigError) as err:
        files.read_json(str(tmp_path), label="m")
    assert str(err.value) == ("given: m: a directory\nsupported: a regular file: a HF config.json\n"
                              "fix: point at the file itself, on disk")


def test_a_plugin_refusal_without_supported_or_fix_still_gets_both_parts_and_every_refusal_is_listed():
    """selection: validate refusals are listed one per line, a third party's marked "(refused by
    plugin ...)"; their supported and fix parts joined once each, with a fallback when none says."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.rules import SERVED_DEVICE
    from mla_sm120_plugin.selection import select

    class Site:
        @hookimpl
        def mla_sm120_validate(self, ctx):
            return ["not validated on this site"]

    reg = build_registry(load_entry_points=False, extra_plugins={"site": Site()})
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(), registry=reg)
    lines = str(err.value).splitlines()
    assert lines[1].startswith("  - not validated on this site (refused by plugin ") and lines[1].endswith(")")
    assert lines[2:] == ["supported: what those plugins allow", "fix: see the reasons above"]
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    with pytest.raises(UnsupportedConfiguration) as err:
        select(SelectionContext(GLM_ARCH, "fp8", 64, 2048, parse_device("9.0", source="--sm"),
                                features=frozenset({"hisparse", "dcp"})), registry=_edge_registry())
    lines = str(err.value).splitlines()
    for line, start in zip(lines[1:5], ["  - device sm_90: this plugin serves SM12x only",
                                        "  - kv_cache_dtype fp8: no kernel reads that layout",
                                        "  - dcp is on: decode context parallelism", "  - hisparse is on: HiSparse"]):
        assert line.startswith(start), (line, start)
    supported = lines[5]
    assert supported.startswith(f"supported: {SERVED_DEVICE}; fp8_ds_mla (656 B a token")
    assert supported.endswith("; the standard DSA cache and top-k path") and supported.count("standard DSA") == 1
    assert lines[6].startswith("fix: on sm_90 serve without this plugin: drop --attention-backend CUSTOM; ")
    assert "; set --decode-context-parallel-size 1, or serve without --attention-backend CUSTOM" in lines[6]


def test_a_context_with_an_unknown_scale_format_is_refused():
    """selection.select: a context built by hand (not through config.py, which refuses it first) with
    an unknown kv_scale_format is refused in three parts."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(kv_scale_format="e8m0"))
    assert str(err.value) == ("given: kv_scale_format='e8m0'\nsupported: auto or one of ['pow2', 'arbitrary']\n"
                              "fix: fix kv_scale_format in the plugin config")


def test_a_model_no_profile_serves_is_refused_with_how_to_serve_it(tmp_path, capsys):
    """README: "Enabled for a model it cannot serve, it fails at init with the fix in the message"."""
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32}))
    lines = _refusal(capsys, "--model", str(d), "--sm", "12.0")
    assert lines[0].endswith(": LlamaForCausalLM is not a DeepSeek-Sparse-Attention model this plugin serves")
    assert lines[-1] == ("fix: serve this model without --attention-backend CUSTOM, or install a plugin with a "
                         "profile for it")


def test_notes_say_when_probes_were_skipped_and_carry_each_kernels_table_note():
    """selection.select: a planned device's decision says its probes were not run; a kernel's
    ``envelope_note`` is added for the caches it reads (a failing note is reported, not raised)."""
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo

    planned = select(_edge_ctx(device=parse_device("12.0", source="--sm")),
                     registry=_edge_registry(probe=lambda device: [], envelope_note=lambda: "from the packaged table",
                                             kv_cache_dtypes=frozenset({"fp8_ds_mla"})))
    assert ("device sm_120 is planned (--sm), not present here: kernel probes (installed packages, GPU, JIT compiler) "
            "were not run; run `mla-sm120 doctor` on that machine") in planned.notes
    assert "edge: from the packaged table" in planned.notes
    bf16 = select(_edge_ctx().__class__(GLM_ARCH, "bf16", 16, 2048, parse_device("12.0", source="--sm")),
                  registry=_edge_registry(envelope_note=lambda: "from the packaged table",
                                          kv_cache_dtypes=frozenset({"fp8_ds_mla"})))
    assert not [n for n in bf16.notes if n.startswith("edge: ")]

    def broken():
        raise KeyError("version")

    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(envelope_note=broken))
    assert "edge: envelope note failed: KeyError: 'version'" in d.notes
    assert not [n for n in d.notes if "is planned" in n]


def test_the_fp8_flag_fix_is_only_for_cache_reasons_and_sm_families_are_listed():
    """selection: a bf16 cache refused for another reason gets no fp8 advice; the supported line
    lists a kernel's SM families as SM9x/12x."""
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import SelectionContext

    with pytest.raises(UnsupportedConfiguration) as err:
        select(SelectionContext(GLM_ARCH, "bf16", 4, 2048, parse_device("12.0", source="--sm"), decode_kernel="edge"),
               registry=_edge_registry(heads=(8, 32), topk_min=4096, sm_families=frozenset({9, 12})))
    msg = str(err.value)
    assert "--kv-cache-dtype fp8_ds_mla" not in msg.split("\nfix: ")[1]
    assert "cannot run: heads per rank 4 outside [8, 32]; index_topk 2048 < 4096; decode can run: " in msg
    assert "edge (cpu/nvidia SM9x/12x, kv bf16/fp8_ds_mla, heads 8-32)" in msg


def test_plugin_config_is_cached_per_inline_content():
    """context.plugin_config: "read once per process for the same sources": a different inline dict
    is another source."""
    from mla_sm120_plugin.context import plugin_config

    a = plugin_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS).for_model(None, None)
    b = plugin_config({"decode_kernel": TORCH}, kernel_names=BUILTIN_KERNELS).for_model(None, None)
    assert (a.decode_kernel, b.decode_kernel) == (TRITON, TORCH)
    assert plugin_config(None, kernel_names=BUILTIN_KERNELS).for_model(None, None).decode_kernel == "auto"


def test_an_unreadable_path_is_refused_with_the_systems_reason(tmp_path):
    """files.py: an OSError other than a missing file is shown with its reason (here ENOTDIR)."""
    (tmp_path / "file.toml").write_text("")
    path = str(tmp_path / "file.toml" / "x.toml")
    with pytest.raises(ConfigError) as err:
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path})
    assert str(err.value) == (f"given: MLA_SM120_CONFIG={path!r}: Not a directory\n"
                              "supported: a readable regular file: a plugin config TOML file\n"
                              "fix: fix the path or permissions")


@pytest.mark.parametrize("text, shown", [
    ("mla_sm120.toml", "mla_sm120.toml"),
    ("caf\u00e9.toml", "caf\u00e9.toml"),  # valid UTF-8 stays as it is
    ("caf\udce9.toml", "caf\\xe9.toml"),  # the byte 0xe9 alone, kept by Python as a lone surrogate
    ("\udc80\u00e9\udcff", "\\x80\u00e9\\xff"),  # the ends of the escaped range, beside valid text
    ("\udc80", "\\x80"), ("a\udcff", "a\\xff"),  # each end of the range on its own
    ("\udc7f\udd00", "\udc7f\udd00"),  # just outside it: not an escaped byte, left alone
    ("\udc80\udd00", "\\x80\udd00"),  # ... also beside one that is
])
def test_printable_writes_undecodable_bytes_as_hex(text, shown):
    """files.printable: bytes that were not valid UTF-8 (0x80..0xff, kept as U+DC80..U+DCFF) are
    written \\xNN; everything else is left as it is."""
    assert files.printable(text) == shown


# --- a model's config.json: each refusal in its three parts (modelinfo.py) -----------------------------------


def _model_dir(tmp_path, text: str):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize("config, given, supported, fix", [
    ({"num_attention_heads": 64}, "config has no 'architectures'", "a HF config.json", "point at the model's config"),
    ({"architectures": []}, "architectures=[] (list)",
     'a non-empty list of non-empty strings, e.g. ["GlmMoeDsaForCausalLM"]',
     "point at the model's own config.json, or correct 'architectures' in it"),
    ({"architectures": [GLM_ARCH], "num_attention_heads": "64"}, "num_attention_heads='64' (str)",
     "an integer from 1 to 1024 (not a bool, float or string)",
     "set num_attention_heads to the model's value, or remove it to use the glm-5 profile's 64"),
    ({"architectures": ["OtherForCausalLM"], "index_topk": 0}, "index_topk=0 (int)",
     "an integer from 1 to 1048576 (not a bool, float or string)", "set index_topk to the model's value"),
    ({"architectures": [GLM_ARCH], "index_topk": 0}, "index_topk=0 (int)",
     "an integer from 1 to 1048576 (not a bool, float or string)",
     "set index_topk to the model's value, or remove it to use the glm-5 profile's 2048"),
    ({"architectures": [GLM_ARCH], "qk_rope_head_dim": -1}, "qk_rope_head_dim=-1 (int)",
     "an integer from 0 to 65536 (not a bool, float or string)",
     "set qk_rope_head_dim to the model's value, or remove it to use the glm-5 profile's 64"),
    ({"architectures": ["Glm5NextForCausalLM"], "index_kpool": 65}, "index_kpool=65 (int)",
     "an integer from 1 to 64 (not a bool, float or string)",
     "set index_kpool to the model's value, or remove it to use the glm-5.3-flash profile's 4"),
    # no profile serves the architecture: no profile's value to point at
    ({"architectures": ["OtherForCausalLM"], "index_kpool": True}, "index_kpool=True (bool)",
     "an integer from 1 to 64 (not a bool, float or string)", "set index_kpool to the model's value"),
], ids=["no-architectures", "empty-architectures", "heads-string", "unknown-arch-topk", "glm5-topk",
        "glm5-rope", "flash-kpool", "unknown-arch-kpool"])
def test_each_config_json_refusal_names_the_file_the_key_and_the_fix(tmp_path, config, given, supported, fix):
    """modelinfo.py: a config.json field of the wrong type or range is refused naming the file, the
    key and value (with its type), the range, and how to fix it (the profile's value where one serves)."""
    d = _model_dir(tmp_path, json.dumps(config))
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d), registry=get_registry())
    assert str(err.value) == f"given: {d / 'config.json'}: {given}\nsupported: {supported}\nfix: {fix}"


def test_a_config_json_that_is_not_an_object_is_refused_naming_the_model_and_the_file(tmp_path):
    """modelinfo.resolve_model: the message names ``--model`` as given and, for a directory, the file read."""
    d = _model_dir(tmp_path, "[1, 2]")
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d), registry=get_registry())
    assert str(err.value) == (f"given: --model {str(d)!r} ({d / 'config.json'}): the top level is a JSON list\n"
                              "supported: a HF config.json: a JSON object\nfix: point at the model's config.json")
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d / "config.json"), registry=get_registry())
    assert str(err.value).startswith(f"given: --model {str(d / 'config.json')!r}: the top level is a JSON list\n")


@pytest.mark.parametrize("config, kpool", [
    ({"architectures": ["Glm5NextForCausalLM"], "index_kpool": 2}, 2),  # the config's own value
    ({"architectures": ["Glm5NextForCausalLM"]}, 4),  # absent: GLM-5.3-Flash's profile pools 4
    ({"architectures": [GLM_ARCH]}, 1),  # absent: GLM-5's profile does not pool
    ({"architectures": ["OtherForCausalLM"]}, 1),  # absent, no profile: no pooling
    ({"architectures": ["OtherForCausalLM"], "index_kpool": 64}, 64),  # the bound itself is allowed
])
def test_index_kpool_comes_from_the_config_else_the_profile_else_no_pooling(tmp_path, config, kpool):
    """modelinfo.ModelFacts.index_kpool: "indexer keys pooled per top-k pick (1: none)"."""
    d = _model_dir(tmp_path, json.dumps(config))
    assert resolve_model(str(d), registry=get_registry()).index_kpool == kpool


def test_a_profile_name_gives_the_profiles_own_geometry():
    """modelinfo.resolve_model: a profile name (or alias) stands for the profile's architecture,
    heads, top-k, latent and rope widths and pooling (GLM-5.3-Flash: rope-less, pools 4)."""
    reg = get_registry()
    for spec in ("glm-5.3-flash", "zai-org/GLM-5.3-Flash-FP8"):
        f = resolve_model(spec, registry=reg)
        assert (f.arch, f.name, f.num_heads, f.index_topk, f.kv_lora_rank, f.qk_rope_head_dim, f.index_kpool) == (
            "Glm5NextForConditionalGeneration", spec, 64, 2048, 512, 0, 4)
    f = resolve_model("deepseek-v3.2", registry=reg)
    assert (f.arch, f.num_heads, f.kv_lora_rank, f.qk_rope_head_dim, f.index_kpool) == (
        "DeepseekV32ForCausalLM", 128, 512, 64, 1)


def test_a_directory_without_config_json_named_like_a_profile_is_the_profile(tmp_path, monkeypatch):
    """modelinfo.resolve_model: "a path that exists wins over a profile of the same name, except a
    directory without a config.json"; a directory without one and no such profile is a missing file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "glm-5").mkdir()
    assert resolve_model("glm-5", registry=get_registry()).arch == GLM_ARCH
    (tmp_path / "glm-5" / "config.json").write_text(json.dumps({"architectures": ["OtherForCausalLM"]}))
    assert resolve_model("glm-5", registry=get_registry()).arch == "OtherForCausalLM"  # the file wins
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        resolve_model("empty", registry=get_registry())
    assert str(err.value).startswith("given: --model 'empty' (empty/config.json): no such file\n")


def test_an_unknown_model_name_is_refused_listing_every_profile_name_and_alias():
    """modelinfo.resolve_model: neither a path nor a profile: every name it would take, sorted."""
    with pytest.raises(ConfigError) as err:
        resolve_model("nope-model", registry=get_registry())
    assert str(err.value) == (
        "given: --model 'nope-model' is neither a profile name nor a path to a config.json\n"
        "supported: a model directory, a config.json, or one of ['deepseek-ai/DeepSeek-V3.2', "
        "'deepseek-ai/DeepSeek-V3.2-Exp', 'deepseek-ai/DeepSeek-V4-Flash', 'deepseek-ai/DeepSeek-V4-Flash-Base', "
        "'deepseek-ai/DeepSeek-V4-Pro', 'deepseek-ai/DeepSeek-V4.1-Flash', 'deepseek-v3.2', 'deepseek-v4', "
        "'deepseek-v4-flash', 'deepseek-v4-pro', 'deepseek-v4.1', 'deepseek-v4.1-flash', 'glm-5', 'glm-5.3', "
        "'glm-5.3-flash', 'glm-dsa', 'zai-org/GLM-5', 'zai-org/GLM-5-FP8', 'zai-org/GLM-5.3-Flash', "
        "'zai-org/GLM-5.3-Flash-FP8']\n"
        "fix: pass a local model directory or a listed name")
    # a long name or path is shown whole up to 300 characters (a path is often longer than 60)
    long_name = "org/" + "m" * 200
    for spec in (long_name, long_name + "\x00"):
        with pytest.raises(ConfigError) as err:
            resolve_model(spec, registry=get_registry())
        assert str(err.value).startswith(f"given: --model {spec!r}")
    with pytest.raises(ConfigError) as err:
        resolve_model("a\x00b", registry=get_registry())
    assert str(err.value) == ("given: --model 'a\\x00b': the path contains a NUL byte\n"
                              "supported: a path to a HF config.json\nfix: remove the NUL (\\u0000) from the path")


def test_an_architecture_no_profile_serves_may_omit_its_counts(tmp_path):
    """modelinfo.ModelFacts: heads and index top-k are "0 when the config omits it and no profile
    serves arch" (the selection then refuses the architecture)."""
    d = _model_dir(tmp_path, json.dumps({"architectures": ["OtherForCausalLM"]}))
    facts = resolve_model(str(d), registry=get_registry())
    assert (facts.arch, facts.num_heads, facts.index_topk) == ("OtherForCausalLM", 0, 0)
