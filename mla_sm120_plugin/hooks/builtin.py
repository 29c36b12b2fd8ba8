"""Built-in model profiles: GLM-5 (GLM DSA), DeepSeek-V3.2 and the rope-less GLM-5.3-Flash.

Registered through the same hook as a third party's profiles.
"""

from __future__ import annotations

from typing import Iterator

from ..kernels.dsa.layout import SCALE_ARBITRARY, SCALE_POW2
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


GLM53_FLASH = ModelProfile(
    name="glm-5.3-flash",
    # vLLM 0.33 (models/glm5next: the multimodal and text-only models, the MTP draft) and SGLang 0.5.23
    # (the model and its NextN draft) names; every one runs the same sparse-MLA layers.
    architectures=("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM", "Glm5NextMTPModel",
                   "Glm5NextForConditionalGenerationNextN"),
    model_type="glm5_next",  # transformers' Glm5NextConfig; its text part is glm5_next_text
    num_heads=64,
    index_topk=2048,
    # SGLang's writer stores amax/448; vLLM's concat_and_cache_mla stores powers of two (read as
    # values, both are right for every kernel here; FlashInfer's only NoPE format reads either).
    kv_scale_format=SCALE_ARBITRARY,
    qk_rope_head_dim=0,  # no rope part: 512-wide q and keys
    index_kpool=4,  # the released model (2048 + 3 = 2051 ids in SGLang); transformers' default is 16
    aliases=("glm-5.3", "zai-org/GLM-5.3-Flash", "zai-org/GLM-5.3-Flash-FP8"),
)


@hookimpl
def mla_sm120_model_profiles() -> Iterator[ModelProfile]:
    yield GLM_DSA
    yield DEEPSEEK_V32
    yield GLM53_FLASH
