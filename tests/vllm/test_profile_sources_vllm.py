"""The built-in profiles against the installed vLLM's own code (issue 52).

``mla_sm120_plugin/profiles.py: SOURCES`` names, for each profile value, the engine code or config class
that names it; ``tests/unit/test_profile_sources.py`` holds the profiles to the recorded public configs.
Here each named engine source is read from the installed vLLM (0.33.0 or 0.34.0, whichever this
environment has) and from the transformers it reads configs with: config-class defaults by instantiating
the class, constants of vLLM's model-specific kernels (CuTe DSL / ROCm paths that import what a CPU
machine lacks) from their source text. A value a release lacks the model for is skipped, naming the
release. No weights, no Triton: seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from support.engine_sources import constant, default, keyword_values, numbers, package_file

from mla_sm120_plugin.engines import installed_release
from mla_sm120_plugin.profiles import GEOMETRY, SOURCES, mla_sm120_model_profiles

BOTH, V034 = ("0.33.0", "0.34.0"), ("0.34.0",)
BUILT_IN = {profile.name: profile for profile in mla_sm120_model_profiles()}
FIXTURE = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "public_model_configs.json").read_text())


def vllm_file(relative: str) -> Path:
    return package_file("vllm", relative)


def tf_default(cls: str, attr: str) -> Callable[[], object]:
    def read():
        import transformers

        return getattr(getattr(transformers, cls)(), attr)

    return read


def only(values: set[object]) -> object:
    assert len(values) == 1, f"several values: {sorted(values)}"
    return next(iter(values))


KIMI_MLA = "models/kimi_k3/nvidia/specialized_decode/cutedsl/mla/"
ML4 = "models/mistral/mistral_large4/amd/specialized_decode/"
V4_MONO, V41_MONO = "models/deepseek_v4/amd/mono/dims.py", "models/deepseek_v41/amd/mono/attention/plan.py"
HY_V4 = "transformers_utils/configs/hy_v4.py"


def kimi_heads_from_tiling() -> int:
    """Kimi K3's MLA query kernel tiles per local head count, at TP 8 and 16 only (``unsupported``): the
    model's heads are the count both give."""
    local = set(constant(vllm_file(KIMI_MLA + "query.py"), "TILED_FROM"))
    return only({h * 8 for h in local} & {h * 16 for h in local})


def ml4_heads() -> int:
    geometry = vllm_file(ML4 + "mono/geometry_config.py")
    return only(keyword_values(geometry, "local_heads", call="LayerConfig")) * constant(geometry, "ML4_REFERENCE_TP")


@dataclass(frozen=True)
class Fact:
    """One value vLLM's code names: ``target`` is a profile field or ``<model config>:<config key>``;
    ``where`` is what the profile's SOURCES must name for it (part of its engine text)."""

    profile: str
    target: str
    releases: tuple[str, ...]
    where: str
    read: Callable[[], object]


def _class_facts(profile: str, cls: str, fields: dict[str, str]) -> list[Fact]:
    return [Fact(profile, field, BOTH, f"{cls} default", tf_default(cls, attr)) for field, attr in fields.items()]


_MLA_FIELDS = {"num_heads": "num_attention_heads", "qk_rope_head_dim": "qk_rope_head_dim",
               "kv_lora_rank": "kv_lora_rank", "index_topk": "index_topk"}
_V4_KEYS = ("num_attention_heads", "qk_rope_head_dim", "head_dim", "index_topk", "num_hidden_layers")

FACTS = [
    *_class_facts("glm-5", "GlmMoeDsaConfig", _MLA_FIELDS),
    *_class_facts("deepseek-v3.2", "DeepseekV32Config", _MLA_FIELDS),
    *_class_facts("glm-5.3-flash", "Glm5NextTextConfig", _MLA_FIELDS),
    *[Fact("hy-v4", field, BOTH, f"vllm/{HY_V4} HYV4Config default",
           lambda attr=attr: default(vllm_file(HY_V4), "HYV4Config", attr))
      for field, attr in _MLA_FIELDS.items() if field != "num_heads"],
    Fact("kimi-k3.1", "num_heads", BOTH, f"{KIMI_MLA}query.py TILED_FROM", kimi_heads_from_tiling),
    Fact("kimi-k3.1", "num_heads", V034, "cutedsl/mla/dcp.py",
         lambda: only(numbers(vllm_file(KIMI_MLA + "dcp.py"), r"attention layer of (\d+) heads"))),
    Fact("kimi-k3.1", "num_heads", V034, "cutedsl/dsa/prepared.py",
         lambda: only(numbers(vllm_file(KIMI_MLA + "../dsa/prepared.py"), r"TP1's (\d+) heads"))),
    Fact("kimi-k3.1", "kv_lora_rank", BOTH, KIMI_MLA,
         lambda: only(keyword_values(vllm_file(KIMI_MLA), "kv_lora_rank"))),
    Fact("kimi-k3.1", "qk_rope_head_dim", BOTH, KIMI_MLA,
         lambda: only(keyword_values(vllm_file(KIMI_MLA), "qk_rope_head_dim"))),
    Fact("kimi-k3.1", "index_topk", V034, "transformers_utils/configs/kimi_linear.py KimiLinearDSAConfig",
         lambda: default(vllm_file("transformers_utils/configs/kimi_linear.py"), "KimiLinearDSAConfig", "index_topk")),
    Fact("mistral-large-4", "num_heads", V034, "ML4_CONFIG local_heads x ML4_REFERENCE_TP", ml4_heads),
    Fact("mistral-large-4", "num_heads", V034, "runtime/weights.py",
         lambda: only(numbers(vllm_file(ML4 + "runtime/weights.py"), r"num_local_heads \* npes != (\d+)"))),
    Fact("mistral-large-4", "kv_lora_rank", V034, "ML4_CONFIG kv_lora",
         lambda: only(keyword_values(vllm_file(ML4 + "mono/geometry_config.py"), "kv_lora", call="LayerConfig"))),
    Fact("mistral-large-4", "qk_rope_head_dim", V034, "ML4_CONFIG pe_dim",
         lambda: only(keyword_values(vllm_file(ML4 + "mono/geometry_config.py"), "pe_dim", call="LayerConfig"))),
    Fact("mistral-large-4", "index_topk", V034, "runtime/spec.py DecodeConfig topk",
         lambda: default(vllm_file(ML4 + "runtime/spec.py"), "DecodeConfig", "topk")),
    *_class_facts("deepseek-v4", "DeepseekV4Config", {"num_heads": "num_attention_heads",
                                                      "qk_rope_head_dim": "qk_rope_head_dim",
                                                      "kv_lora_rank": "head_dim", "index_topk": "index_topk"}),
    *[Fact("deepseek-v4", f"deepseek-v4-flash:{key}", BOTH, f"DeepseekV4Config default {key}",
           tf_default("DeepseekV4Config", key)) for key in _V4_KEYS],
    *[Fact("deepseek-v4", f"deepseek-v4-pro:{key}", BOTH, f"{V4_MONO} {name}",
           lambda name=name: constant(vllm_file(V4_MONO), name))
      for key, name in (("num_attention_heads", "N_HEADS"), ("qk_rope_head_dim", "ROPE"), ("head_dim", "HEAD_DIM"),
                        ("index_topk", "INDEX_TOPK"))],
    Fact("deepseek-v4", "deepseek-v4-pro:num_hidden_layers", BOTH, "deepseek_v4/amd/mono/README.md",
         lambda: only(numbers(vllm_file("models/deepseek_v4/amd/mono/README.md"), r"all (\d+) backbone layers"))),
    *[Fact("deepseek-v4.1", target, BOTH, f"{V41_MONO} {name}", lambda name=name: constant(vllm_file(V41_MONO), name))
      for target, name in (("num_heads", "N_HEADS"), ("qk_rope_head_dim", "ROPE"), ("kv_lora_rank", "HEAD_DIM"),
                           ("index_topk", "TOPK"), ("deepseek-v4.1-flash:num_attention_heads", "N_HEADS"),
                           ("deepseek-v4.1-flash:qk_rope_head_dim", "ROPE"),
                           ("deepseek-v4.1-flash:head_dim", "HEAD_DIM"), ("deepseek-v4.1-flash:index_topk", "TOPK"))],
    Fact("deepseek-v4.1", "deepseek-v4.1-flash:num_hidden_layers", BOTH, "deepseek_v41/amd/mono/README.md",
         lambda: only(numbers(vllm_file("models/deepseek_v41/amd/mono/README.md"), r"all (\d+) backbone layers"))),
]


def _source(fact: Fact):
    sources = SOURCES[fact.profile]
    if ":" in fact.target:
        config, key = fact.target.split(":")
        return sources.model_configs[config][key]
    return getattr(sources, fact.target)


def _expected(fact: Fact) -> object:
    """The profile's value, or for a planning stand-in the model's recorded one (the engine names the model's)."""
    profile = BUILT_IN[fact.profile]
    if ":" not in fact.target:
        return getattr(profile, fact.target)
    config, key = fact.target.split(":")
    source = _source(fact)
    if source.stand_in:
        recorded = FIXTURE["configs"][source.repo]["config"]
        for part in source.key.split("."):
            recorded = recorded[part]
        return recorded
    return profile.model_configs[config][key]


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f"{f.profile}-{f.target}-{f.where.rsplit('/', 1)[-1]}")
def test_the_profile_is_what_vllms_code_names(fact):
    assert fact.where in _source(fact).engine, (
        f"{fact.profile} {fact.target}: SOURCES does not name {fact.where!r} ({_source(fact).engine!r})")
    release = installed_release("vllm")
    if release not in fact.releases:
        pytest.skip(f"vLLM {release} lacks this source (in vLLM {' / '.join(fact.releases)} only)")
    assert fact.read() == _expected(fact), f"{fact.profile} {fact.target}: vLLM {release} {fact.where}"


def test_every_vllm_or_transformers_source_is_checked_here():
    checked = {(fact.profile, fact.target) for fact in FACTS}
    named = {(name, field) for name, sources in SOURCES.items() for field in GEOMETRY
             if (source := getattr(sources, field)) is not None and ("vLLM" in source.engine
                                                                     or "transformers" in source.engine)}
    named |= {(name, f"{config}:{key}") for name, sources in SOURCES.items()
              for config, keys in sources.model_configs.items() for key, source in keys.items()
              if "vLLM" in source.engine or "transformers" in source.engine}
    assert named <= checked, f"sources named but not read from the engine: {sorted(named - checked)}"
