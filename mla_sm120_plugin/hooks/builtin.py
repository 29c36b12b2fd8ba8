"""Built-in model profiles: GLM-5 (GLM DSA) and DeepSeek-V3.2.

Registered through the same hook as a third party's profiles.
"""

from __future__ import annotations

from typing import Iterator

from ..kernels.layout import SCALE_ARBITRARY, SCALE_POW2
from ..types import ModelProfile
from .specs import hookimpl

GLM_DSA = ModelProfile(
    name="glm-5",
    architectures=("GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN"),
    model_type="glm_moe_dsa",
    num_heads=64,
    index_topk=2048,
    kv_scale_format=SCALE_ARBITRARY,  # GLM writes amax/448 scales
    aliases=("glm-dsa", "zai-org/GLM-5", "zai-org/GLM-5-FP8"),
)

DEEPSEEK_V32 = ModelProfile(
    name="deepseek-v3.2",
    architectures=("DeepseekV32ForCausalLM", "DeepseekV32MTPModel"),
    model_type="deepseek_v32",
    num_heads=128,
    index_topk=2048,
    kv_scale_format=SCALE_POW2,  # DeepSeek-V3.2 writes power-of-two scales
    aliases=("deepseek-ai/DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2-Exp"),
)


@hookimpl
def mla_sm120_model_profiles() -> Iterator[ModelProfile]:
    yield GLM_DSA
    yield DEEPSEEK_V32
