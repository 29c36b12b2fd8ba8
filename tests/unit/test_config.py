"""Plugin config: sources, per-model matching, and errors that name file, key and choices.

The documented precedence is pinned from both sides (the sections from "within one source" on):
each test names the promise it pins (README "Plugin config", the docstrings of
``mla_sm120_plugin/config.py``), and a precedence test sets BOTH sources (or sections) to different
values, so a swapped order fails.
"""

from __future__ import annotations

import string

import pytest
from support.cli import assert_three_parts
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_sm120_plugin import cli
from mla_sm120_plugin.config import CONFIG_ENV, load_config
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS, FLASHINFER, TORCH, TRITON
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.types import ENGINE_NATIVE_IMPLS

KERNELS = BUILTIN_KERNELS
GLM_NAME, GLM_ARCH = "zai-org/GLM-5-FP8", "GlmMoeDsaForCausalLM"
GLM = (GLM_NAME, GLM_ARCH)
DSV = ("deepseek-ai/DeepSeek-V3.2", "DeepseekV32ForCausalLM")


def _write(tmp_path, text, name="mla_sm120.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_auto():
    s = load_config(None, kernel_names=KERNELS, env={}).for_model(*GLM)
    assert (s.prefill_kernel, s.decode_kernel, s.kv_scale_format) == ("auto", "auto", "auto")
    assert s.origin("decode_kernel") == "default"


def test_model_sections_match_exact_then_glob_then_arch(tmp_path):
    path = _write(
        tmp_path,
        """
decode_kernel = "torch_sparse_mla"
[architectures.GlmMoeDsaForCausalLM]
decode_kernel = "triton_sparse_mla"
prefill_kernel = "triton_sparse_mla"
[models."zai-org/*"]
decode_kernel = "flashinfer_sparse_mla"
kv_scale_format = "pow2"
[models."zai-org/GLM-5-FP8"]
kv_scale_format = "arbitrary"
""",
    )
    cfg = load_config(None, kernel_names=KERNELS, env={CONFIG_ENV: path})
    glm = cfg.for_model(*GLM)
    assert glm.decode_kernel == "flashinfer_sparse_mla"  # glob beats arch
    assert glm.prefill_kernel == "triton_sparse_mla"  # arch beats top level
    assert glm.kv_scale_format == "arbitrary"  # exact beats glob
    assert "zai-org/GLM-5-FP8" in glm.origin("kv_scale_format") and path in glm.origin("kv_scale_format")
    # A section for one model does not leak into the next.
    dsv = cfg.for_model(*DSV)
    assert (dsv.decode_kernel, dsv.prefill_kernel, dsv.kv_scale_format) == ("torch_sparse_mla", "auto", "auto")


def test_inline_beats_file_and_names_the_file(tmp_path):
    path = _write(tmp_path, 'decode_kernel = "torch_sparse_mla"\nprefill_kernel = "torch_sparse_mla"\n')
    other = _write(tmp_path, 'decode_kernel = "flashinfer_sparse_mla"\n', name="env.toml")
    inline = {"config_file": path, "decode_kernel": "triton_sparse_mla"}
    s = load_config(inline, kernel_names=KERNELS, env={CONFIG_ENV: other}).for_model(*GLM)
    assert s.decode_kernel == "triton_sparse_mla" and s.prefill_kernel == "torch_sparse_mla"
    assert s.origin("prefill_kernel") == path  # config_file inline beats MLA_SM120_CONFIG


@pytest.mark.parametrize(
    "text, needles",
    [
        ('decode_kernl = "auto"', ["decode_kernl", "unknown key", "decode_kernel"]),
        ('decode_kernel = "trition_sparse_mla"', ["trition_sparse_mla", "triton_sparse_mla", "torch_sparse_mla"]),
        ("decode_kernel = 3", ["decode_kernel=3", "a string"]),
        ('kv_scale_format = "e8m0"', ["kv_scale_format", "pow2", "arbitrary"]),
        ('[models."x"]\nprefil_kernel = "auto"', ["[models.'x']", "prefil_kernel"]),
        ("models = 3", ["models", "table"]),
        ("decode_kernel = ", ["invalid TOML"]),
    ],
)
def test_bad_file_fails_naming_file_key_and_choices(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(None, kernel_names=KERNELS, env={CONFIG_ENV: path})
    msg = str(err.value)
    assert path in msg
    for needle in needles:
        assert needle in msg
    assert "fix:" in msg


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="MLA_SM120_CONFIG='/nonexistent.toml': no such file"):
        load_config(None, kernel_names=KERNELS, env={CONFIG_ENV: "/nonexistent.toml"})


def test_engine_native_names_pass_config_and_fail_in_selection():
    # A stale SGLang name is not a typo: selection explains it (see test_selection).
    s = load_config({"decode_kernel": "trtllm"}, kernel_names=KERNELS, env={}).for_model(*GLM)
    assert s.decode_kernel == "trtllm"


def test_nothing_applies_partially(tmp_path):
    # The file is valid; the inline dict is not: the whole load fails, no half config results.
    path = _write(tmp_path, 'decode_kernel = "triton_sparse_mla"\n')
    with pytest.raises(ConfigError):
        load_config({"config_file": path, "prefill_kernel": 7}, kernel_names=KERNELS, env={})


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
    st.text(max_size=8), st.sampled_from(["auto", *KERNELS, "pow2", "arbitrary", "trtllm"]),
)
_keys = st.one_of(
    st.sampled_from(["prefill_kernel", "decode_kernel", "kv_scale_format", "models", "architectures", "config_file"]),
    st.text(alphabet=string.ascii_letters + "_*/.", max_size=10),
)
_configs = st.recursive(
    _scalars,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_keys, children, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(inline=_configs, name=st.one_of(st.none(), st.text(max_size=12)), arch=st.one_of(st.none(), st.text(max_size=12)))
def test_random_configs_raise_only_config_error(inline, name, arch):
    if isinstance(inline, dict) and isinstance(inline.get("config_file"), str):
        inline = {**inline, "config_file": "/nonexistent/" + inline["config_file"]}
    try:
        cfg = load_config(inline, kernel_names=KERNELS, env={})
    except ConfigError as exc:
        assert "given:" in str(exc) and "fix:" in str(exc)
        return
    s = cfg.for_model(name, arch)
    assert s.prefill_kernel in ("auto", *KERNELS, *ENGINE_NATIVE_IMPLS)
    assert s.decode_kernel in ("auto", *KERNELS, *ENGINE_NATIVE_IMPLS)
    assert s.kv_scale_format in ("auto", "pow2", "arbitrary")


_toml_like = st.one_of(
    st.binary(max_size=80),
    st.lists(
        st.sampled_from(['decode_kernel = "auto"', "[models.x]", "[architectures]", "= =", '"', "\\xff", "a = [1,", "\n"]),
        max_size=6,
    ).map("\n".join).map(str.encode),
)


@settings(max_examples=150, deadline=None)
@given(data=_toml_like)
def test_random_file_bytes_raise_only_config_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_bytes(data)
    try:
        load_config(None, kernel_names=KERNELS, env={CONFIG_ENV: str(path)})
    except ConfigError:
        pass


# Every refusal of config.py, word for word as the user reads it (what was given, what is accepted,
# how to fix it); "<F>" stands for the file's path. Written out by hand from the schema in the
# module docstring, not rendered by the plugin's own formatter.
_KEYS_IN_A_SECTION = "['prefill_kernel', 'decode_kernel', 'kv_scale_format', 'precision']"
_KEYS_IN_A_FILE = "['prefill_kernel', 'decode_kernel', 'kv_scale_format', 'precision', 'models', 'architectures']"
_KEYS_INLINE = _KEYS_IN_A_FILE[:-1] + ", 'config_file']"
_INLINE = "--additional-config mla_sm120"


@pytest.mark.parametrize(
    "file_text, inline, expected",
    [
        (None, [1], f"given: {_INLINE}: list [1]\nsupported: a table/dict of settings\nfix: write it as a table"),
        (None, {"decode_kernl": "auto"},
         f"given: {_INLINE}: unknown key 'decode_kernl'\nsupported: keys {_KEYS_INLINE}\nfix: remove or correct the key"),
        # config_file names a file from the inline form only: a file cannot name another
        ('config_file = "x.toml"', None,
         f"given: <F>: unknown key 'config_file'\nsupported: keys {_KEYS_IN_A_FILE}\nfix: remove or correct the key"),
        ("decode_kernel = 3", None, 'given: <F>: decode_kernel=3 (int)\nsupported: a string\nfix: quote it: decode_kernel = "..."'),
        ('decode_kernel = "trition_sparse_mla"', None,
         "given: <F>: decode_kernel='trition_sparse_mla' is not a known kernel\nsupported: one of ['auto', "
         "'flashinfer_dsv4_sm120', 'flashinfer_sparse_mla', 'torch_sparse_mla', 'triton_dsv4', 'triton_sparse_mla', "
         "'triton_sparse_mla_fast']\nfix: correct the name"),
        ('kv_scale_format = "e8m0"', None,
         "given: <F>: kv_scale_format='e8m0'\nsupported: one of ['auto', 'pow2', 'arbitrary']\nfix: correct the value"),
        ('precision = "fastest"', None,
         "given: <F>: precision='fastest'\nsupported: one of ['fast', 'exact']\nfix: correct the value"),
        ("models = 3", None,
         'given: <F>: models = 3\nsupported: a table of [models.<name>] sections\nfix: write [models."<name>"]'),
        ("architectures = [1]", None,
         'given: <F>: architectures = [1]\nsupported: a table of [architectures.<name>] sections\n'
         'fix: write [architectures."<name>"]'),
        ('[models.""]\ndecode_kernel = "auto"', None,
         "given: <F>: models section name ''\nsupported: a non-empty string\nfix: name the section"),
        ('[models."x"]\nprefil_kernel = "auto"', None,
         f"given: <F> [models.'x']: unknown key 'prefil_kernel'\nsupported: keys {_KEYS_IN_A_SECTION}\n"
         "fix: remove or correct the key"),
        ('[models."x"]\nconfig_file = "y.toml"', None,
         f"given: <F> [models.'x']: unknown key 'config_file'\nsupported: keys {_KEYS_IN_A_SECTION}\n"
         "fix: remove or correct the key"),
        ("[architectures]\nGlm = 3", None,
         "given: <F> [architectures.'Glm']: int 3\nsupported: a table/dict of settings\nfix: write it as a table"),
        (None, {"architectures": {"A": {"precision": 1}}},
         f"given: {_INLINE} [architectures.'A']: precision=1 (int)\nsupported: a string\nfix: quote it: precision = \"...\""),
        (None, {"config_file": 3},
         f"given: {_INLINE}: config_file=3\nsupported: a path string\nfix: give the TOML file's path"),
        (None, {"config_file": "/nonexistent.toml"},
         "given: mla_sm120.config_file='/nonexistent.toml': no such file\n"
         "supported: an existing regular file: a plugin config TOML file\nfix: fix the path"),
    ],
)
def test_each_refusal_word_for_word(tmp_path, file_text, inline, expected):
    env = {CONFIG_ENV: _write(tmp_path, file_text)} if file_text is not None else {}
    with pytest.raises(ConfigError) as err:
        load_config(inline, kernel_names=KERNELS, env=env)
    assert str(err.value) == expected.replace("<F>", env.get(CONFIG_ENV, "<F>"))


def test_the_file_source_is_named_as_the_user_named_it(tmp_path):
    missing = str(tmp_path / "missing.toml")
    tail = ": no such file\nsupported: an existing regular file: a plugin config TOML file\nfix: fix the path"
    for config_file, env, named_by in ((missing, {}, "--config"), (None, {CONFIG_ENV: missing}, CONFIG_ENV)):
        with pytest.raises(ConfigError) as err:
            load_config(None, kernel_names=KERNELS, env=env, config_file=config_file)
        assert str(err.value) == f"given: {named_by}={missing!r}{tail}"


def test_forced_by_names_each_forced_kernel_and_its_source(tmp_path):
    path = _write(tmp_path, 'prefill_kernel = "torch_sparse_mla"\n')
    both = load_config({"decode_kernel": "triton_sparse_mla"}, kernel_names=KERNELS, env={CONFIG_ENV: path})
    assert both.for_model(*GLM).forced_by() == f"prefill_kernel from {path}, decode_kernel from {_INLINE}"
    assert load_config(None, kernel_names=KERNELS, env={}).for_model(*GLM).forced_by() == "config"
    # "auto" forces nothing, wherever it is written
    auto = load_config({"decode_kernel": "auto"}, kernel_names=KERNELS, env={})
    assert auto.for_model(*GLM).forced_by() == "config"


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
    return None, {CONFIG_ENV: _write(tmp_path, "\n".join(lines) + "\n")}


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
        inline, env = None, {CONFIG_ENV: _write(tmp_path, f'decode_kernel = "{TORCH}"\n'
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
    path = _write(tmp_path, f'[models."{first}"]\ndecode_kernel = "{TRITON}"\n'
                            f'[models."{second}"]\ndecode_kernel = "{TORCH}"\n')
    settings = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert settings.decode_kernel == TRITON and repr(first) in settings.origin("decode_kernel")


def test_sections_merge_key_by_key(tmp_path):
    """config.py: each key comes from the strongest section that sets it; a stronger section that
    does not set a key leaves the weaker section's value in place."""
    path = _write(tmp_path, f'kv_scale_format = "pow2"\n[architectures.{GLM_ARCH}]\nprefill_kernel = "{TORCH}"\n'
                            f'[models."{GLM_NAME}"]\ndecode_kernel = "{TRITON}"\n')
    s = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert (s.prefill_kernel, s.decode_kernel, s.kv_scale_format) == (TORCH, TRITON, "pow2")
    assert s.origin("kv_scale_format") == path


def test_an_exact_section_written_before_a_glob_still_leaves_the_globs_other_keys(tmp_path):
    """config.py: an exact section and a glob both match; the exact one wins the keys it sets, the
    glob still supplies the rest (file order decides only between globs). A name with no glob
    character is never taken for a glob."""
    name = "acme/MODEL-X"
    path = _write(tmp_path, f'[models."{name}"]\ndecode_kernel = "{TRITON}"\n'
                            f'[models."acme/*"]\ndecode_kernel = "{TORCH}"\nkv_scale_format = "pow2"\n')
    s = load_config(None, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path}).for_model(name, GLM_ARCH)
    assert (s.decode_kernel, s.kv_scale_format) == (TRITON, "pow2")
    assert s.origin("kv_scale_format") == f"{path} [models.'acme/*']"


# --- between sources: inline > its config_file > MLA_SM120_CONFIG > defaults ------------------------


def test_inline_beats_its_config_file_which_replaces_the_environment_file(tmp_path):
    """config.py: "Strongest first: the inline dict, the file it names (else the one MLA_SM120_CONFIG
    names), then defaults"; each pair with both sides set."""
    env_file = _write(tmp_path, f'prefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\nkv_scale_format = "pow2"\n',
                      "env.toml")
    named = _write(tmp_path, f'prefill_kernel = "{TRITON}"\ndecode_kernel = "{TRITON}"\n', "named.toml")
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
    path = _write(tmp_path, f'[models."{GLM_NAME}"]\ndecode_kernel = "{TORCH}"\n')
    s = load_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS,
                    env={CONFIG_ENV: path}).for_model(GLM_NAME, GLM_ARCH)
    assert s.decode_kernel == TRITON


def test_a_bad_value_in_the_weaker_source_still_fails_the_whole_config(tmp_path):
    """README: "nothing applies partially": a valid inline dict does not hide a broken file."""
    path = _write(tmp_path, 'decode_kernel = "not_a_kernel"\n')
    with pytest.raises(ConfigError) as err:
        load_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS, env={CONFIG_ENV: path})
    assert_three_parts(str(err.value), path)
    assert "not_a_kernel" in str(err.value) and TRITON in str(err.value)


# --- where a forced kernel came from, as refusals name it ------------------------------------------


def test_a_refusal_names_the_source_of_each_forced_kernel_in_phase_order(capsys):
    """config.Settings.forced_by: every forced kernel "from" its source, prefill then decode."""
    assert cli.main(["check", "--model", "glm-5", "--sm", "12.0", "--prefill-kernel", "flashmla_kv",
                     "--decode-kernel", "trtllm"]) == cli.EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert "(prefill_kernel from command-line flags, decode_kernel from command-line flags)" in err
    assert "fix: remove the kernel override (prefill_kernel from command-line flags, decode_kernel from " \
           "command-line flags) or set it to one listed as able to run" in err
