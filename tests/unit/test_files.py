"""The file reader (``files.py``), pinned from both sides: its exact size, nesting and number
limits, the re-check after opening, what transformers reads, and each refusal in its three parts.

Every test names the promise it pins (the docstrings and comments of ``mla_sm120_plugin/files.py``).
A limit test sits on both sides of the boundary, so an off-by-one fails.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from support.cli import assert_three_parts
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_sm120_plugin import cli, files
from mla_sm120_plugin.config import CONFIG_ENV, load_config
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS, TRITON
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.modelinfo import resolve_model

GLM_ARCH = "GlmMoeDsaForCausalLM"

# The bounds as the documentation states them (files.py's module docstring and comments; the brief
# of issue 18): written out here, not imported, so a change to the implementation's constants fails.
TOML_CAP = 1 << 20  # "1 MiB"
JSON_CAP = 16 << 20  # "16 MiB"
NESTING = 64  # "nested more than 64 levels"
INT_DIGITS = 100  # "integers of at most 100 digits"


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


def test_size_limits_are_written_in_mib_only_when_whole(tmp_path):
    """files.py: a bound is "N MiB" when it is a whole number of MiB, else "N bytes"."""
    path = tmp_path / "f"
    path.write_bytes(b"#" * ((1 << 20) + 2))
    for cap, words in ((10, "at most 10 bytes"), ((1 << 20) + 1, "at most 1048577 bytes"), (0, "at most 0 bytes")):
        with pytest.raises(ConfigError) as err:
            files.read_bytes(str(path), label="f", what=files.TOML_FILE, max_bytes=cap)
        assert f"supported: {files.TOML_FILE} of {words}\n" in str(err.value)
        assert str(err.value).endswith("fix: point at the right file; this one is far larger than any config")


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
