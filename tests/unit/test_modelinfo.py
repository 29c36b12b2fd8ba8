"""The model reader (``modelinfo.py``): a config.json's refusals in their three parts, word for
word, the tensor-parallel size, and what a profile name or a missing key stands for.

Every test names the promise it pins (the docstrings of ``mla_sm120_plugin/modelinfo.py``).
"""

from __future__ import annotations

import json

import pytest

from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.modelinfo import resolve_model

GLM_ARCH = "GlmMoeDsaForCausalLM"


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


# --- what a profile name, a directory or a missing key stands for --------------------------------------------


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
        "'glm-5.3-flash', 'glm-dsa', 'hy-v4', 'hy4-preview', 'kimi-k3.1', 'kimi-k31', 'mistral-large-4', "
        "'mistralai/Mistral-Large-4', 'moonshotai/Kimi-K3.1', 'tencent/Hy4-preview', 'zai-org/GLM-5', "
        "'zai-org/GLM-5-FP8', 'zai-org/GLM-5.3-Flash', 'zai-org/GLM-5.3-Flash-FP8']\n"
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
