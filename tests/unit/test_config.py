"""Plugin config: sources, per-model matching, and errors that name file, key and choices."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_sm120_plugin.config import CONFIG_ENV, load_config
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS
from mla_sm120_plugin.types import ENGINE_NATIVE_IMPLS

KERNELS = BUILTIN_KERNELS
GLM = ("zai-org/GLM-5-FP8", "GlmMoeDsaForCausalLM")
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
