"""``mla-sm120 check`` on random model configs, plugin configs and flags: exit 0 or 2, never a crash.

Hypothesis writes a ``config.json`` and a plugin TOML into a temporary directory and calls
``cli.main`` in-process. Allowed outcomes: 0 (servable; with ``--json`` the output parses), 2 (a
refusal with a message) or argparse's usage error (``SystemExit(2)``). Any other exception, or
another exit code, is a bug.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mla_sm120_plugin import cli
from mla_sm120_plugin.config import CONFIG_ENV

GLM = {"architectures": ["GlmMoeDsaForCausalLM"], "num_attention_heads": 64, "index_topk": 2048}
ARCHS = ["GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLMNextN", "LlamaForCausalLM", ""]
KERNEL_VALUES = ["auto", "flashinfer_sparse_mla", "triton_sparse_mla", "torch_sparse_mla", "trtllm", "garbage"]
SCALE_VALUES = ["auto", "pow2", "arbitrary", "garbage"]

# --- (a) model config.json ---------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6), st.integers(), st.sampled_from([0, 1, 4, 64, 2048, 1 << 20, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10), st.sampled_from(ARCHS),
)
_json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
_ABSENT = object()


def _mostly(valid: st.SearchStrategy, rare: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """``valid`` ``odds`` times in ``odds + 1``, else ``rare``: enough valid input to get past the parser."""
    return st.integers(min_value=0, max_value=odds).flatmap(lambda i: rare if i == 0 else valid)


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    return _mostly(_mostly(valid, st.just(_ABSENT), odds=3), _json_values, odds=3)


_model_dicts = _mostly(
    st.just(GLM),
    st.builds(
        lambda archs, heads, topk, extra: {
            **extra,
            **{k: v for k, v in (("architectures", archs), ("num_attention_heads", heads), ("index_topk", topk))
               if v is not _ABSENT},
        },
        _field(st.lists(st.sampled_from(ARCHS), min_size=1, max_size=2)),
        _field(st.sampled_from([1, 4, 16, 64, 128, 1024, 1025, 3])),
        _field(st.sampled_from([1, 64, 100, 2048, 4096, 1 << 20, (1 << 20) + 1])),
        st.dictionaries(st.text(max_size=8), _json_values, max_size=3),
    ),
    odds=1,
)
_deep = st.integers(min_value=1, max_value=3000).map(lambda n: '{"x": ' + "[" * n + "]" * n + "}")
_model_texts = _mostly(
    _model_dicts.map(json.dumps),  # allow_nan: NaN / Infinity tokens appear as Python writes them
    st.one_of(
        _deep,
        st.text(max_size=30),
        st.just('{"architectures": ["GlmMoeDsaForCausalLM"], "num_attention_heads": ' + "9" * 5000 + "}"),
    ),
)

# --- (b) plugin TOML ---------------------------------------------------------------------------

_toml_key = st.sampled_from(["prefill_kernel", "decode_kernel", "kv_scale_format", "config_file", "typo_kernel"])
_toml_value = st.one_of(
    st.sampled_from(KERNEL_VALUES + SCALE_VALUES).map(lambda v: f'"{v}"'),
    st.integers(min_value=-5, max_value=5).map(str),
    st.sampled_from(["true", "[1, 2]", "{a = 1}", "nan", "inf", "1979-05-27", "'''x'''", '"\\u0000"', "", "9" * 5000]),
)
_toml_header = st.sampled_from([
    '[models."x"]', '[models."zai-org/*"]', '[models."glm-5"]', "[architectures.GlmMoeDsaForCausalLM]",
    "[architectures]", "[models]", "[[models]]", "models = 3", "[", "a = " + "[" * 200 + "]" * 200,
])
_toml_line = st.one_of(st.builds(lambda k, v: f"{k} = {v}", _toml_key, _toml_value), _toml_header,
                       st.text(max_size=12))
_settings = st.fixed_dictionaries({}, optional={
    "prefill_kernel": st.sampled_from(KERNEL_VALUES), "decode_kernel": st.sampled_from(KERNEL_VALUES),
    "kv_scale_format": st.sampled_from(SCALE_VALUES),
})


def _render(top: dict, sections: dict) -> str:
    lines = [f'{k} = "{v}"' for k, v in top.items()]
    for header, body in sections.items():
        lines += [header, *(f'{k} = "{v}"' for k, v in body.items())]
    return "\n".join(lines) + "\n"


_toml_valid = st.builds(  # well-formed TOML; "garbage" values still make it a ConfigError
    _render,
    _settings,
    st.dictionaries(st.sampled_from(['[models."x"]', '[models."zai-org/*"]', '[models."glm-5"]',
                                     "[architectures.GlmMoeDsaForCausalLM]"]), _settings, max_size=3),
)
_toml_texts = st.one_of(st.none(), _mostly(_toml_valid, st.lists(_toml_line, max_size=8).map("\n".join), odds=1))

# --- (c) flags ---------------------------------------------------------------------------------

_garbage = st.one_of(st.sampled_from(["", "x", "-1", "1.5", "0x10", "１２", "nan"]), st.text(max_size=6))


def _opt(flag: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just([]), values.map(lambda v: [flag, v]))


def _int_flag(flag: str, values: list[int]) -> st.SearchStrategy:
    """Mostly a positive count; sometimes 0, -1 (refused: by argparse or by the check) or garbage."""
    return _opt(flag, _mostly(st.sampled_from(values).map(str), st.one_of(st.sampled_from(["0", "-1"]), _garbage)))


_flags = st.tuples(
    _mostly(st.sampled_from(["12.0", "12.1", "sm_121"]), st.sampled_from(["9.0", "10.0", "garbage", "0", ""]), odds=3)
    .map(lambda v: ["--sm", v]),
    _opt("--tp", _mostly(st.sampled_from(["1", "2", "4", "8", "16", "3", "64"]), _garbage, odds=6)),
    _opt("--kv-cache-dtype", _mostly(st.sampled_from(["fp8_ds_mla", "bf16", "auto", "fp8", "bfloat16"]), _garbage)),
    _int_flag("--max-decode-tokens", [1, 64, 65, 4096, 10**9]),
    _int_flag("--max-prefill-tokens", [1, 8192, 10**12]),
    _opt("--decode-kernel", st.sampled_from(KERNEL_VALUES)),
    _opt("--prefill-kernel", st.sampled_from(KERNEL_VALUES)),
    st.sampled_from([[], ["--enforce-eager"]]),
    st.sampled_from([[], ["--json"]]),
)
_model_arg = st.sampled_from(["dir", "file", "glm-5", "deepseek-v3.2", "zai-org/GLM-5-FP8", "no-such-model"])


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in (CONFIG_ENV, "MLA_SM120_DEVICE"):
        monkeypatch.delenv(var, raising=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model_text=_model_texts, toml_text=_toml_texts, model_arg=_model_arg, flags=_flags)
def test_check_exits_0_or_2_and_never_crashes(capsys, model_text, toml_text, model_arg, flags):
    capsys.readouterr()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8", errors="surrogatepass") as fh:
            fh.write(model_text)
        model = {"dir": tmp, "file": os.path.join(tmp, "config.json")}.get(model_arg, model_arg)
        argv = ["check", "--model", model]
        if toml_text is not None:
            with open(os.path.join(tmp, "mla_sm120.toml"), "w", encoding="utf-8", errors="surrogatepass") as fh:
                fh.write(toml_text)
            argv += ["--config", os.path.join(tmp, "mla_sm120.toml")]
        for flag in flags:
            argv += flag
        try:
            rc = cli.main(argv)
        except SystemExit as exc:  # argparse's usage error
            assert exc.code == 2, f"SystemExit({exc.code!r}) for {argv}"
            event("usage error")
            return
        out = capsys.readouterr()
    assert rc in (cli.EXIT_OK, cli.EXIT_UNSERVABLE), f"rc={rc!r} for {argv}"
    event(f"exit {rc}")
    if rc == cli.EXIT_UNSERVABLE:
        assert "given:" in out.err and "fix:" in out.err, out.err
    elif "--json" in argv:
        json.loads(out.out)
