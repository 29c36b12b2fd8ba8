"""Every bad input is a ConfigError (exit 2 from ``mla-sm120 check``), never a traceback or a hang.

Model ``config.json`` fields of the wrong type or range, JSON/TOML nested thousands deep, FIFOs,
devices, directories and oversized files, NUL bytes in paths, and bad tensor-parallel sizes;
through the public paths: :func:`modelinfo.resolve_model`, :func:`config.load_config` and
``cli.main``.
"""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest

from mla_sm120_plugin import cli, files
from mla_sm120_plugin.config import CONFIG_ENV, load_config
from mla_sm120_plugin.errors import ConfigError, MlaSm120Error, UnsupportedConfiguration
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS
from mla_sm120_plugin.modelinfo import MAX_HEADS, MAX_INDEX_TOPK, ModelFacts, facts_from_hf_config, resolve_model

GLM_ARCH = "GlmMoeDsaForCausalLM"
GLM = {"architectures": [GLM_ARCH], "num_attention_heads": 64, "index_topk": 2048}
HUGE = "9" * 5000


def _model_dir(tmp_path, text: str):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(text)
    return d


def _three_parts(msg: str) -> None:
    assert "given:" in msg and "supported:" in msg and "fix:" in msg, msg


def _check(*argv: str) -> list[str]:
    return ["check", "--sm", "12.0", *argv]


def _cli_refuses(capsys, argv: list[str], *needles: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == cli.EXIT_UNSERVABLE, err
    assert "Traceback" not in err
    _three_parts(err)
    for needle in needles:
        assert needle in err
    return err


def _promptly(fn, timeout: float = 10.0):
    """``fn()``'s result (or exception), failing if it has not returned within ``timeout`` seconds."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)  # a blocked open must not hang pytest's exit
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still blocked after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


# --- config.json fields ------------------------------------------------------------------------

BAD_ARCHITECTURES = [5, {"X": 1}, [["X"]], [], [""], "GlmMoeDsaForCausalLM", None, [GLM_ARCH, 3]]
BAD_COUNTS = ["abc", "64", [64], True, False, 0, -3, None, 64.7, 64.0, 1e30, int(HUGE[:90]), HUGE]


@pytest.mark.parametrize("value", BAD_ARCHITECTURES, ids=repr)
def test_bad_architectures_name_file_key_and_value(tmp_path, value):
    d = _model_dir(tmp_path, json.dumps({**GLM, "architectures": value}))
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d), registry=get_registry())
    msg = str(err.value)
    _three_parts(msg)
    assert str(d / "config.json") in msg and "architectures=" in msg and "non-empty list of non-empty strings" in msg


@pytest.mark.parametrize("key, bound", [("num_attention_heads", MAX_HEADS), ("index_topk", MAX_INDEX_TOPK)])
@pytest.mark.parametrize("value", BAD_COUNTS, ids=lambda v: repr(v)[:20])
def test_bad_counts_name_file_key_value_and_range(tmp_path, key, bound, value):
    d = _model_dir(tmp_path, json.dumps({**GLM, key: value}))
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d), registry=get_registry())
    msg = str(err.value)
    _three_parts(msg)
    assert str(d / "config.json") in msg and f"{key}=" in msg and f"from 1 to {bound}" in msg
    assert files.short_repr(value) in msg
    assert len(msg) < 1000  # a 5000-digit value is cut, not pasted


@pytest.mark.parametrize("key, bound", [("num_attention_heads", MAX_HEADS), ("index_topk", MAX_INDEX_TOPK)])
def test_counts_at_the_bound_pass_and_above_it_fail(tmp_path, key, bound):
    d = _model_dir(tmp_path, json.dumps({**GLM, key: bound}))
    assert getattr(resolve_model(str(d), registry=get_registry()), "num_heads" if key != "index_topk" else key) == bound
    d = _model_dir(tmp_path, json.dumps({**GLM, key: bound + 1}))
    with pytest.raises(ConfigError, match=key):
        resolve_model(str(d), registry=get_registry())


@pytest.mark.parametrize(
    "number, needle",
    [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e400", "1e400"),
     (HUGE, "5000 digits"), ("-" + HUGE, "5000 digits"), (HUGE + ".0", "float range")],
    ids=lambda v: v[:12],
)
@pytest.mark.parametrize("key", ["num_attention_heads", "index_topk"])
def test_non_finite_and_huge_json_numbers_are_refused_while_parsing(tmp_path, capsys, key, number, needle):
    text = json.dumps({**GLM, key: 1}).replace(f'"{key}": 1', f'"{key}": {number}')
    d = _model_dir(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        resolve_model(str(d), registry=get_registry())
    _three_parts(str(err.value))
    assert needle in str(err.value) and str(d) in str(err.value)
    _cli_refuses(capsys, _check("--model", str(d)), needle)


def test_absent_counts_fall_back_to_the_profile(tmp_path):
    d = _model_dir(tmp_path, json.dumps({"architectures": [GLM_ARCH]}))
    facts = resolve_model(str(d), registry=get_registry())
    profile = get_registry().by_arch[GLM_ARCH]
    assert (facts.num_heads, facts.index_topk) == (profile.num_heads, profile.index_topk)


def test_absent_architectures_and_non_object_top_level(tmp_path):
    for text, needle in (('{"num_attention_heads": 64}', "no 'architectures'"), ("[1, 2]", "JSON list"),
                         ('"glm"', "JSON str"), ("{", "invalid JSON"), ("\xff", "invalid JSON")):
        d = _model_dir(tmp_path, text)
        with pytest.raises(ConfigError, match=needle):
            resolve_model(str(d), registry=get_registry())


def test_valid_glm_config_resolves(tmp_path):
    d = _model_dir(tmp_path, json.dumps(GLM))
    assert resolve_model(str(d / "config.json"), registry=get_registry()) == ModelFacts(
        arch=GLM_ARCH, name=str(d / "config.json"), num_heads=64, index_topk=2048
    )


def test_index_topk_1e30_is_not_served(tmp_path, capsys):
    # It was once truncated to an int and "served by FlashInfer".
    d = _model_dir(tmp_path, json.dumps({**GLM, "index_topk": 1e30}))
    _cli_refuses(capsys, _check("--model", str(d)), "index_topk=1e+30", str(d / "config.json"))


@pytest.mark.parametrize("value", [5, [], [""], [["X"]]], ids=repr)
def test_cli_bad_architectures_exit_2(tmp_path, capsys, value):
    d = _model_dir(tmp_path, json.dumps({**GLM, "architectures": value}))
    _cli_refuses(capsys, _check("--model", str(d)), "architectures=")


@pytest.mark.parametrize("value", ["abc", True, 0, -3, None, 64.7, [64]], ids=repr)
def test_cli_bad_heads_exit_2(tmp_path, capsys, value):
    d = _model_dir(tmp_path, json.dumps({**GLM, "num_attention_heads": value}))
    _cli_refuses(capsys, _check("--model", str(d)), "num_attention_heads=")


def test_pretrained_config_objects_treat_none_as_absent():
    reg = get_registry()
    cfg = SimpleNamespace(architectures=[GLM_ARCH], num_attention_heads=64, index_topk=None)
    assert facts_from_hf_config(cfg, name="m", registry=reg).index_topk == reg.by_arch[GLM_ARCH].index_topk
    for attr, value in (("index_topk", "2048"), ("num_attention_heads", 64.0), ("architectures", "GLM")):
        bad = SimpleNamespace(**{**GLM, attr: value})
        with pytest.raises(ConfigError) as err:
            facts_from_hf_config(bad, name="zai-org/GLM-5-FP8", registry=reg)
        assert attr in str(err.value) and "zai-org/GLM-5-FP8" in str(err.value)


# --- tensor-parallel size ----------------------------------------------------------------------


@pytest.mark.parametrize("tp", [0, -1, True, False, 1.5, 8.0, "8", None], ids=repr)
def test_tp_that_is_not_a_positive_int_is_refused(tp):
    facts = ModelFacts(arch=GLM_ARCH, name="glm-5", num_heads=64, index_topk=2048)
    with pytest.raises(ConfigError) as err:
        facts.heads_per_rank(tp)
    _three_parts(str(err.value))
    assert "tensor_parallel_size=" in str(err.value)


def test_tp_must_divide_the_heads():
    facts = ModelFacts(arch=GLM_ARCH, name="glm-5", num_heads=64, index_topk=2048)
    assert facts.heads_per_rank(16) == 4
    with pytest.raises(UnsupportedConfiguration, match="a divisor of 64"):
        facts.heads_per_rank(3)


@pytest.mark.parametrize("tp", ["3", "128"])
def test_cli_tp_that_does_not_divide_exits_2(capsys, tp):
    _cli_refuses(capsys, _check("--model", "glm-5", "--tp", tp), f"tensor_parallel_size={tp}")


@pytest.mark.parametrize("tp", ["0", "-4", "x", "1.5"])
def test_cli_tp_below_one_or_not_an_int_exits_2(capsys, tp):
    # Refused by argparse (a usage error, SystemExit 2) or by heads_per_rank (exit 2): never a crash.
    try:
        rc = cli.main(_check("--model", "glm-5", "--tp", tp))
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert "Traceback" not in capsys.readouterr().err


# --- nesting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [files.MAX_NESTING + 1, 500, 5000, 100_000])
def test_deep_json_is_refused_without_recursion_error(tmp_path, capsys, depth):
    d = _model_dir(tmp_path, '{"architectures": ["X"], "x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ConfigError, match=f"more than {files.MAX_NESTING} levels"):
        resolve_model(str(d), registry=get_registry())
    _cli_refuses(capsys, _check("--model", str(d)), f"more than {files.MAX_NESTING} levels")


def test_nesting_at_the_bound_parses(tmp_path):
    depth = files.MAX_NESTING - 1  # the top-level object is one level
    d = _model_dir(tmp_path, json.dumps({**GLM, "x": json.loads("[" * depth + "]" * depth)}))
    assert resolve_model(str(d), registry=get_registry()).num_heads == 64


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000,
        "a = " + "[" * (files.MAX_NESTING + 1) + "]" * (files.MAX_NESTING + 1),
        "a = " + "{b = " * 3000 + "1" + "}" * 3000,
        "[" + ".".join(["m"] * 5000) + "]",  # dotted keys nest without brackets
    ],
    ids=["arrays-5000", "arrays-65", "inline-tables-3000", "dotted-5000"],
)
def test_deep_toml_is_refused_without_recursion_error(tmp_path, capsys, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"more than {files.MAX_NESTING} levels"):
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: str(path)})
    _cli_refuses(capsys, _check("--model", "glm-5", "--config", str(path)), str(path))


def test_huge_toml_integer_is_a_config_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f"decode_kernel = {HUGE}\n")
    with pytest.raises(ConfigError, match="64 bits"):
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: str(path)})


# --- what a path may point at ------------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs os.mkfifo (POSIX)")
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


def test_fifo_config_is_refused_before_open(fifo, capsys, monkeypatch):
    for env, config_file in (({CONFIG_ENV: fifo}, None), ({}, fifo)):
        with pytest.raises(ConfigError, match="FIFO") as err:
            _promptly(lambda: load_config(None, kernel_names=BUILTIN_KERNELS, env=env, config_file=config_file))
        _three_parts(str(err.value))
    with pytest.raises(ConfigError, match="FIFO"):
        _promptly(lambda: load_config({"config_file": fifo}, kernel_names=BUILTIN_KERNELS, env={}))
    _promptly(lambda: _cli_refuses(capsys, _check("--model", "glm-5", "--config", fifo), "FIFO", fifo))
    monkeypatch.setenv(CONFIG_ENV, fifo)
    _promptly(lambda: _cli_refuses(capsys, _check("--model", "glm-5"), "FIFO", CONFIG_ENV))


def test_fifo_model_is_refused_before_open(fifo, tmp_path, capsys):
    _promptly(lambda: _cli_refuses(capsys, _check("--model", fifo), "FIFO"))
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / "config.json")
    _promptly(lambda: _cli_refuses(capsys, _check("--model", str(d)), "FIFO", str(d / "config.json")))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_devices_are_refused(capsys):
    _promptly(lambda: _cli_refuses(capsys, _check("--model", "glm-5", "--config", "/dev/zero"), "character device"))
    _promptly(lambda: _cli_refuses(capsys, _check("--model", "/dev/zero"), "character device"))
    with pytest.raises(ConfigError, match="character device"):
        _promptly(lambda: load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: "/dev/zero"}))


def test_directories_are_refused(tmp_path, capsys):
    _cli_refuses(capsys, _check("--model", "glm-5", "--config", str(tmp_path)), "a directory")
    # A directory that is not a profile name and has no config.json names the file it looked for.
    _cli_refuses(capsys, _check("--model", str(tmp_path)), str(tmp_path / "config.json"), "no such file")


def test_oversized_files_are_refused_from_their_size(tmp_path, capsys):
    toml = tmp_path / "big.toml"
    with open(toml, "wb") as fh:
        fh.truncate(files.MAX_TOML_BYTES + 1)  # sparse: nothing is written or read
    _cli_refuses(capsys, _check("--model", "glm-5", "--config", str(toml)), f"{files.MAX_TOML_BYTES + 1} bytes", "1 MiB")
    big = tmp_path / "config.json"
    with open(big, "wb") as fh:
        fh.truncate(files.MAX_JSON_BYTES + 1)
    _cli_refuses(capsys, _check("--model", str(big)), "16 MiB")


def test_a_file_that_grows_after_the_stat_is_still_capped(tmp_path, monkeypatch):
    # Simulate growth between stat and read: the stats say 0 bytes, the file holds more than the cap.
    path = tmp_path / "c.toml"
    path.write_bytes(b"#" * 100)
    real_stat, real_fstat = os.stat, os.fstat

    def shrunk(result):
        fields = list(result)
        fields[6] = 0  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(files.os, "stat", lambda p, *a, **k: shrunk(real_stat(p, *a, **k)))
    monkeypatch.setattr(files.os, "fstat", lambda fd: shrunk(real_fstat(fd)))
    with pytest.raises(ConfigError, match="more bytes than that"):
        files.read_bytes(str(path), label="test", what=files.TOML_FILE, max_bytes=10)
    monkeypatch.undo()
    assert files.read_bytes(str(path), label="test", what=files.TOML_FILE, max_bytes=100) == b"#" * 100


def test_missing_and_unreadable_files(tmp_path, capsys):
    _cli_refuses(capsys, _check("--model", "glm-5", "--config", str(tmp_path / "nope.toml")), "no such file")


UNPRIVILEGED_UID = 65534  # nobody


def _locked_config() -> str:
    """A config file nobody but root may read, in a directory anyone may enter."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="mla-sm120-locked-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "locked.toml")
    with open(path, "w") as fh:
        fh.write('decode_kernel = "auto"\n')
    os.chmod(path, 0)
    return path


# Run as root, the child loads everything check needs first (the checkout may be root-only), then
# drops to an unprivileged user and checks with the locked file, which it may then not read.
DROPPED_CHECK = """
import os, sys
from mla_sm120_plugin import cli
argv = ["check", "--model", "glm-5", "--sm", "12.0"]
if os.geteuid() == 0:
    assert cli.main(argv) == 0
    os.setgid(%d)
    os.setuid(%d)
sys.exit(cli.main(argv + ["--config", sys.argv[1]]))
""" % (UNPRIVILEGED_UID, UNPRIVILEGED_UID)


def test_an_unreadable_config_is_refused_for_an_ordinary_user():
    """As an ordinary user: a permission error with the path. The suite also runs as root (CI
    does): then the same check runs in a child process that drops to an unprivileged user."""
    import subprocess
    import sys

    from support.cli import clean_env

    done = subprocess.run([sys.executable, "-c", DROPPED_CHECK, _locked_config()], capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "ConfigError" in done.stderr and "ermission" in done.stderr and "locked.toml" in done.stderr
    assert "Traceback" not in done.stderr


def test_root_reads_a_file_without_read_permission(capsys):
    """Root is not refused by file modes: the same locked file is read and applied."""
    if os.geteuid() != 0:
        pytest.skip("run as root to see root read a mode-0 file (CI runs as root)")
    assert cli.main(_check("--model", "glm-5", "--config", _locked_config())) == 0


# --- NUL bytes and unencodable paths -----------------------------------------------------------


@pytest.mark.parametrize("path", ["a\x00b", "/tmp/\x00", "\ud800.toml"], ids=["nul", "nul-end", "surrogate"])
def test_bad_config_file_strings_are_config_errors(path):
    # --additional-config '{"mla_sm120": {"config_file": "a\u0000b"}}' hands this dict to load_config.
    with pytest.raises(ConfigError) as err:
        load_config({"config_file": path}, kernel_names=BUILTIN_KERNELS, env={})
    _three_parts(str(err.value))
    assert "config_file" in str(err.value)
    with pytest.raises(ConfigError):
        load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path})


def test_nul_in_cli_paths_exits_2(capsys):
    _cli_refuses(capsys, _check("--model", "glm-5", "--config", "a\x00b"), "NUL")
    _cli_refuses(capsys, _check("--model", "/tmp/a\x00b"), "NUL")


def test_every_refusal_here_is_a_config_error_not_a_bare_value_error(tmp_path):
    # ConfigError is a ValueError too; make sure the type raised is ours.
    d = _model_dir(tmp_path, json.dumps({**GLM, "index_topk": "abc"}))
    with pytest.raises(MlaSm120Error):
        resolve_model(str(d), registry=get_registry())


@pytest.mark.parametrize("text", ["0", "1.5", '"GlmMoeDsaForCausalLM"', "null", "true"])
def test_a_scalar_config_json_is_refused_not_crashed(tmp_path, capsys, text):
    # Found by the property test: a config.json holding a bare JSON scalar crashed the nesting check.
    (tmp_path / "config.json").write_text(text)
    assert cli.main(["check", "--model", str(tmp_path), "--sm", "12.0"]) == 2
    assert "the top level is a JSON" in capsys.readouterr().err
