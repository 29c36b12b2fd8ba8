"""The model's own widths, read from its config.json, against the widths the kernels read.

A GLM-5 config edited to another latent or rope width (or GLM-5.3-Flash's rope-less geometry under
GLM-5's architecture name) would make every kernel read a cache layout the model does not write:
``check`` and the engines refuse it, naming the key, the value and what the kernels read.
"""

from __future__ import annotations

import json

import pytest
from support.cli import assert_three_parts

from mla_sm120_plugin import cli
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.modelinfo import GEOMETRY_KEYS, resolve_model

GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "num_attention_heads": 64, "index_topk": 2048,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256}


def _write(tmp_path, **changes) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**GLM5, **changes}))
    return str(d)


def _check(capsys, model: str) -> tuple[int, str]:
    code = cli.main(["check", "--model", model, "--sm", "12.0"])
    captured = capsys.readouterr()
    return code, captured.err


def test_glm5s_own_geometry_is_served(tmp_path, capsys):
    code, err = _check(capsys, _write(tmp_path))
    assert code == 0, err
    facts = resolve_model(_write(tmp_path), registry=get_registry())
    assert (facts.kv_lora_rank, facts.qk_rope_head_dim, facts.qk_nope_head_dim, facts.v_head_dim) == (512, 64, 192, 256)


@pytest.mark.parametrize("key, value, reads", [
    ("kv_lora_rank", 256, "512-wide"),
    ("qk_rope_head_dim", 511, "64-wide rope"),
    ("kv_lora_rank", 1024, "512-wide"),
])
def test_a_geometry_the_kernels_do_not_read_is_refused(tmp_path, capsys, key, value, reads):
    code, err = _check(capsys, _write(tmp_path, **{key: value}))
    assert code == 2
    message = err.split("UnsupportedConfiguration: ", 1)[1]
    assert f"model geometry {key}={value}" in message and reads in message
    assert_three_parts(message)


def test_a_rope_less_config_under_a_dsa_architecture_is_refused(tmp_path, capsys):
    """qk_rope_head_dim 0 is a width the kernels read (GLM-5.3-Flash), but GLM-5's architecture
    makes the engine write rope bytes: the refusal names both and the rope-less architectures."""
    code, err = _check(capsys, _write(tmp_path, qk_rope_head_dim=0))
    assert code == 2
    message = err.split("UnsupportedConfiguration: ", 1)[1]
    assert "qk_rope_head_dim=0" in message and "GlmMoeDsaForCausalLM" in message and "Glm5Next" in message
    assert_three_parts(message)


@pytest.mark.parametrize("key", sorted(GEOMETRY_KEYS))
@pytest.mark.parametrize("value", ["512", 512.0, True, -1, None, 1 << 40])
def test_a_width_of_the_wrong_type_or_range_is_a_config_error(tmp_path, capsys, key, value):
    code, err = _check(capsys, _write(tmp_path, **{key: value}))
    assert code == 2
    assert "ConfigError" in err and f"{key}=" in err, err


def test_absent_widths_fall_back_to_the_profile(tmp_path):
    config = {k: v for k, v in GLM5.items() if k not in GEOMETRY_KEYS}
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    facts = resolve_model(str(d), registry=get_registry())
    assert (facts.kv_lora_rank, facts.qk_rope_head_dim) == (512, 64)


def test_the_reader_takes_a_zero_rope_and_refuses_a_zero_latent():
    """qk_rope_head_dim 0 is a real geometry (NoPE models: refused by the policy, not the reader);
    a zero latent is no model."""
    from mla_sm120_plugin.modelinfo import facts_from_hf_config

    assert facts_from_hf_config({**GLM5, "qk_rope_head_dim": 0}, name="x", registry=get_registry()).qk_rope_head_dim == 0
    with pytest.raises(ConfigError, match="kv_lora_rank=0"):
        facts_from_hf_config({**GLM5, "kv_lora_rank": 0}, name="x", registry=get_registry())
