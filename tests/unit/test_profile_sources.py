"""Every built-in profile's geometry is held to where it comes from (issue 52).

``mla_sm120_plugin/profiles.py: SOURCES`` says, for each built-in profile, where its heads, rope width,
latent width, index top-k, key pooling and its model configs' layer counts come from: a key of the model's
public config.json, and the engine code that names the value. ``tests/fixtures/public_model_configs.json``
records those public values (which copy was read, when); where no public config states a value, the value
the engine's code names is recorded there instead (``tests/vllm/test_profile_sources_vllm.py`` reads it
from the installed vLLM). These tests fail when a profile differs from its recorded source, or when a
profile has a geometry value without a source.

Torch-free: only the package's pure-Python modules, json and pathlib (the last test checks that).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.modelinfo import resolve_model
from mla_sm120_plugin.profiles import CONFIG_GEOMETRY, GEOMETRY, SOURCES, mla_sm120_model_profiles
from mla_sm120_plugin.types import LAYER_COUNTS_UNKNOWN

FIXTURE_PATH = Path(__file__).resolve().parent.parent / "fixtures" / "public_model_configs.json"
FIXTURE = json.loads(FIXTURE_PATH.read_text())
BUILT_IN = {profile.name: profile for profile in mla_sm120_model_profiles()}
# The modules this file imports, for the torch-free check.
IMPORTS = ("mla_sm120_plugin.hooks.manager", "mla_sm120_plugin.modelinfo", "mla_sm120_plugin.profiles",
           "mla_sm120_plugin.types")


def _recorded(profile: str, field: str, source) -> tuple[object, str]:
    """The recorded value ``source`` points at, and where it was read (for messages)."""
    if not source.repo:
        entry = FIXTURE["engine"].get(profile, {}).get(field)
        assert entry is not None, f"{profile}.{field}: no public config states it, and no engine value is recorded"
        return entry["value"], f"{entry['release']} {entry['where']}"
    config = FIXTURE["configs"][source.repo]["config"]
    value = config
    for part in source.key.split("."):
        assert isinstance(value, dict) and part in value, f"{profile}.{field}: {source.repo} records no {source.key}"
        value = value[part]
    return value, f"{source.repo} config.json {source.key}"


def _named_configs(profile):
    """(name, config) of each distinct named model config a profile's SOURCES covers."""
    return [(name, profile.model_configs[name]) for name in SOURCES[profile.name].model_configs]


PROFILE_VALUES = [(name, field) for name in sorted(BUILT_IN) for field in GEOMETRY
                  if field != "index_kpool" or BUILT_IN[name].index_kpool > 1]
CONFIG_VALUES = [(name, config, key) for name in sorted(BUILT_IN)
                 for config, keys in SOURCES[name].model_configs.items() for key in keys]


def test_every_built_in_profile_has_a_source_for_every_geometry_value():
    assert set(SOURCES) == set(BUILT_IN)
    for name, profile in BUILT_IN.items():
        sources = SOURCES[name]
        assert sources.repo in FIXTURE["configs"], f"{name}: its model's repo {sources.repo} is not in the fixture"
        for field in GEOMETRY:
            source = getattr(sources, field)
            if field == "index_kpool" and profile.index_kpool == 1:
                continue  # no pooling: nothing to source
            assert source is not None, f"{name}.{field} has no source"
            assert source.key and (source.repo or source.engine), f"{name}.{field}: {source}"
        # Every named model config (aliases share one dict) is covered, each geometry key it states has a source.
        covered = {id(config) for _, config in _named_configs(profile)}
        for config_name, config in profile.model_configs.items():
            assert id(config) in covered, f"{name}: model config {config_name!r} has no sources"
        for config_name, config in _named_configs(profile):
            stated = {key for key in CONFIG_GEOMETRY if key in config}
            missing = stated - set(sources.model_configs[config_name])
            assert not missing, f"{name}: model config {config_name!r} states {sorted(missing)} without a source"


def test_every_public_source_is_recorded_with_where_it_was_read():
    for repo, entry in FIXTURE["configs"].items():
        if entry["config"] is None:
            assert entry.get("not_public"), f"{repo}: no config and no word on why"
        else:
            assert entry["read_from"], f"{repo}: where was it read?"
    repos = {source.repo for sources in SOURCES.values() for field in GEOMETRY
             for source in [getattr(sources, field)] if source is not None and source.repo}
    repos |= {source.repo for sources in SOURCES.values() for keys in sources.model_configs.values()
              for source in keys.values()}
    for repo in repos:
        assert FIXTURE["configs"].get(repo, {}).get("config"), f"a source names {repo}, whose config is not recorded"


@pytest.mark.parametrize("name, field", PROFILE_VALUES)
def test_a_profile_value_is_its_sources(name, field):
    source = getattr(SOURCES[name], field)
    expected, where = _recorded(name, field, source)
    actual = getattr(BUILT_IN[name], field)
    assert actual == expected, f"profile {name}: {field}={actual}, but {where} says {expected} ({source.engine})"


@pytest.mark.parametrize("name, config_name, key", CONFIG_VALUES)
def test_a_model_config_value_is_its_sources(name, config_name, key):
    source = SOURCES[name].model_configs[config_name][key]
    expected, where = _recorded(name, f"{config_name}:{key}", source)
    config = BUILT_IN[name].model_configs[config_name]
    if source.stand_in:
        # A planning stand-in (V4.1's one layer of each kind) must not pass for the model's own count.
        assert LAYER_COUNTS_UNKNOWN in config, f"{name} {config_name}: {key} is a stand-in, but the config claims it"
        assert config[key] != expected, f"{name} {config_name}: {key} is the model's {expected}: drop stand_in"
    else:
        assert config[key] == expected, f"{name} {config_name}: {key}={config[key]}, but {where} says {expected}"


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_a_model_config_that_claims_its_layers_carries_the_public_list(name):
    """A named model config plans its layers' kinds from a per-layer list only when it is the model's own;
    otherwise it says it does not know the counts (the plan then states no per-kind layer counts)."""
    for config_name, config in _named_configs(BUILT_IN[name]):
        if LAYER_COUNTS_UNKNOWN in config:
            continue
        source = SOURCES[name].model_configs[config_name]["num_hidden_layers"]
        recorded = FIXTURE["configs"][source.repo]["config"]
        text = recorded.get("text_config", recorded)
        for key in ("compress_ratios", "layer_types"):
            if key in config or key in text:
                assert config.get(key) == text.get(key), f"{name} {config_name}: {key} differs from {source.repo}'s"


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_a_plan_by_name_takes_the_sourced_values(name):
    """``mla-sm120 check --model <name>`` reads the same numbers: the model facts of a profile name (or its
    first named model config) are the sourced ones."""
    facts = resolve_model(name, registry=get_registry())
    sources = SOURCES[name]
    if sources.model_configs:
        config_name, config = _named_configs(BUILT_IN[name])[0]
        keys = sources.model_configs[config_name]
        heads, _ = _recorded(name, f"{config_name}:num_attention_heads", keys["num_attention_heads"])
        topk, _ = _recorded(name, f"{config_name}:index_topk", keys["index_topk"])
    else:
        heads, _ = _recorded(name, "num_heads", sources.num_heads)
        topk, _ = _recorded(name, "index_topk", sources.index_topk)
    assert (facts.num_heads, facts.index_topk) == (heads, topk)


def test_kimi_k31_plans_twelve_heads_a_gpu_at_tp8():
    """Kimi K3 / K3.1 has 96 heads (the public Kimi-K3 config; vLLM 0.34's K3.1 code): 12 a GPU at TP 8, 6 at
    TP 16. Its 64-wide rope part is stored unrotated, so the latent row stays 512 + 64."""
    facts = resolve_model("kimi-k3.1", registry=get_registry())
    assert (facts.num_heads, facts.heads_per_rank(8), facts.heads_per_rank(16)) == (96, 12, 6)
    assert (facts.kv_lora_rank, facts.qk_rope_head_dim) == (512, 64)


def test_this_file_runs_without_torch():
    heavy = ("torch", "triton", "flashinfer", "vllm", "sglang", "numpy")
    code = f"import json, pathlib, sys, {', '.join(IMPORTS)}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"this file's imports pulled in {out.strip()}"
