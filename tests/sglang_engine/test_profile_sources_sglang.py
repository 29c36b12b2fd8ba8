"""The built-in profiles against the installed SGLang's config classes (issue 52).

Where ``mla_sm120_plugin/profiles.py: SOURCES`` names an SGLang config class for a profile value, the
class's default is read from the installed SGLang's source (not imported) and held to the profile. The
vLLM side: ``tests/vllm/test_profile_sources_vllm.py``; the public configs: ``tests/unit/test_profile_sources.py``.
"""

from __future__ import annotations

import pytest
from support.engine_sources import default, package_file

from mla_sm120_plugin.engines import installed_release
from mla_sm120_plugin.profiles import GEOMETRY, SOURCES, mla_sm120_model_profiles

BUILT_IN = {profile.name: profile for profile in mla_sm120_model_profiles()}
# (profile, target: a profile field or <model config>:<key>, the config file under sglang/srt/configs, its class,
# the attribute)
FACTS = [
    *[("glm-5.3-flash", field, "glm5_next.py", "Glm5NextTextConfig", attr)
      for field, attr in (("num_heads", "num_attention_heads"), ("qk_rope_head_dim", "qk_rope_head_dim"),
                          ("kv_lora_rank", "kv_lora_rank"))],
    *[("hy-v4", field, "hy_v4.py", "HYV4Config", field)
      for field in ("qk_rope_head_dim", "kv_lora_rank", "index_topk")],
    *[("deepseek-v4", f"deepseek-v4-flash:{key}", "deepseek_v4.py", "DeepSeekV4Config", key)
      for key in ("num_attention_heads", "qk_rope_head_dim", "index_topk", "num_hidden_layers")],
    *[("deepseek-v4", field, "deepseek_v4.py", "DeepSeekV4Config", attr)
      for field, attr in (("num_heads", "num_attention_heads"), ("qk_rope_head_dim", "qk_rope_head_dim"),
                          ("index_topk", "index_topk"))],
]


def _source(profile: str, target: str):
    if ":" in target:
        config, key = target.split(":")
        return SOURCES[profile].model_configs[config][key]
    return getattr(SOURCES[profile], target)


def _value(profile: str, target: str) -> object:
    if ":" in target:
        config, key = target.split(":")
        return BUILT_IN[profile].model_configs[config][key]
    return getattr(BUILT_IN[profile], target)


@pytest.mark.parametrize("profile, target, module, cls, attr", FACTS, ids=lambda v: str(v))
def test_the_profile_is_what_sglangs_config_class_names(profile, target, module, cls, attr):
    stated = _source(profile, target).engine
    assert f"srt/configs/{module}" in stated, f"{profile} {target}: SOURCES does not name srt/configs/{module}"
    release = installed_release("sglang")
    assert f"SGLang {release} srt/configs/{module}" in stated, f"SOURCES names another SGLang than {release}"
    found = default(package_file("sglang", f"srt/configs/{module}"), cls, attr)
    assert found == _value(profile, target), f"{profile} {target}: SGLang {release} {cls}.{attr} = {found}"


def test_every_sglang_source_is_checked_here():
    checked = {(profile, target) for profile, target, *_ in FACTS}
    named = {(name, field) for name, sources in SOURCES.items() for field in GEOMETRY
             if (source := getattr(sources, field)) is not None and "SGLang" in source.engine}
    named |= {(name, f"{config}:{key}") for name, sources in SOURCES.items()
              for config, keys in sources.model_configs.items() for key, source in keys.items()
              if "SGLang" in source.engine}
    assert named <= checked, f"SGLang sources named but not read: {sorted(named - checked)}"
