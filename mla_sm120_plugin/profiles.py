"""The built-in model profiles: GLM-5 (GLM DSA), DeepSeek-V3.2, the rope-less GLM-5.3-Flash, HY V4
(Hy4-preview: DSA with learned per-head sinks), Kimi K3.1 and Mistral Large 4 (vLLM 0.34) and the
DeepSeek-V4 family (V4-Flash, V4-Pro, V4.1-Flash and their drafts).

Registered through the same hook (``mla_sm120_model_profiles``) as a third party's profiles.
"""

from __future__ import annotations

from typing import Iterator

from .kernels.dsa.layout import SCALE_ARBITRARY, SCALE_POW2
from .families.dsv4 import NAME as DSV4_FAMILY
from .types import LAYER_COUNTS_UNKNOWN, ModelProfile
from .hooks.specs import hookimpl

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

HY_V4 = ModelProfile(
    name="hy-v4",
    # vLLM 0.33: the model and its MTP draft (class HYV4MTP); SGLang 0.5.23 renames the draft's
    # architecture to HYV4ForCausalLMNextN. Every one builds the same sparse-MLA layer with a sink.
    architectures=("HYV4ForCausalLM", "HYV4MTPModel", "HYV4ForCausalLMNextN"),
    model_type="hy_v4",
    num_heads=32,
    index_topk=2048,
    # vLLM fills the cache with concat_and_cache_mla, SGLang with its amax/448 writer (bf16 under
    # sinks there): read as values, either is right for every kernel here.
    kv_scale_format=SCALE_ARBITRARY,
    sinks=True,  # learnable_sink: one learned logit a head, in the softmax denominator
    aliases=("hy4-preview", "tencent/Hy4-preview"),
)


# vLLM 0.34's two new sparse-MLA models (docs/facts.md, vLLM 0.34). Neither is built by vLLM 0.33 or SGLang
# 0.5.23 (engines.py: missing_architectures). The head counts are defaults for a plan by name: a config.json's
# num_attention_heads wins (neither release's config is read here).
KIMI_K31 = ModelProfile(
    name="kimi-k3.1",
    # One multimodal architecture (vLLM builds KimiK3ForConditionalGeneration for it); its text part is
    # a kimi_linear config whose DSA layers are NoPE MLA (mla_use_nope: the 64 rope columns are kept in
    # the cache, unrotated) with an optional output gate (g_proj) outside the attention call.
    architectures=("KimiK31ForConditionalGeneration",),
    model_type="kimi_k3",
    num_heads=64,
    index_topk=2048,  # dsa_config.index_topk's default; vLLM copies it to the top level
    kv_scale_format=SCALE_POW2,  # vLLM's DSA writer (concat_and_cache_mla) stores power-of-two scales
    aliases=("kimi-k31", "moonshotai/Kimi-K3.1"),
)

MISTRAL_LARGE_4 = ModelProfile(
    name="mistral-large-4",
    # vLLM 0.34 remaps Mistral's params.json (a `dsa` section) to this architecture; NoPE layers keep the
    # 576-wide layout with zero rope columns (q padded with zeros), layers may share another layer's KV
    # (kv_source_layers) and reuse an earlier indexer's top-k (index_sharing).
    architectures=("MistralLarge4ForCausalLM",),
    model_type="mistral_large_4",
    num_heads=128,
    index_topk=2048,
    kv_scale_format=SCALE_POW2,  # vLLM forces fp8_ds_mla for it; its writer stores power-of-two scales
    aliases=("mistralai/Mistral-Large-4",),
)


# DeepSeek-V4 (docs/facts.md, DeepSeek-V4). V4-Flash and V4-Pro share an architecture, so the profile carries each
# model's config.json keys (what differs from transformers' DeepseekV4Config defaults, which are
# V4-Flash's) and the CLI reads a name through the same reader as a config.json on disk.
_V4_FLASH = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": 43,
             "num_attention_heads": 64, "o_groups": 8, "index_topk": 512, "sliding_window": 128,
             "head_dim": 512, "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1,
             "max_position_embeddings": 1048576,
             "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
             # No layer_types: transformers' default pattern (two C128A, then C128A/C4A alternating)
             # gives the kinds; a model's config.json gives its own per-layer list.
             LAYER_COUNTS_UNKNOWN: True}
# V4-Pro: 128 heads, 16 output groups, top-k 1024, 61 layers (vLLM's V4-Pro constants).
_V4_PRO = {**_V4_FLASH, "num_hidden_layers": 61, "num_attention_heads": 128, "o_groups": 16, "index_topk": 1024}
# V4.1-Flash: 64 heads, 8 groups, top-k 512 (vLLM's V4.1 constants). Its per-layer compress_ratios
# (0 / 1 / 2) are in its config.json only: the profile plans one layer of each kind V4.1 has.
_V41_FLASH = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "num_hidden_layers": 3,
              "num_attention_heads": 64, "o_groups": 8, "index_topk": 512, "sliding_window": 128, "head_dim": 512,
              "qk_rope_head_dim": 64, "max_position_embeddings": 1048576, "compress_ratios": [0, 1, 2],
              LAYER_COUNTS_UNKNOWN: True}

DEEPSEEK_V4 = ModelProfile(
    name="deepseek-v4",
    # vLLM 0.33's names: the model, its MTP draft and its DSpark draft (all build DeepseekV4DecoderLayer).
    architectures=("DeepseekV4ForCausalLM", "DeepSeekV4MTPModel", "DSparkDraftModel"),
    model_type="deepseek_v4",
    num_heads=64,
    index_topk=512,
    kv_scale_format=SCALE_POW2,  # UE8M0 exponents
    family=DSV4_FAMILY,
    aliases=("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Flash-Base", "deepseek-ai/DeepSeek-V4-Pro"),
    model_configs={"deepseek-v4-flash": _V4_FLASH, "deepseek-ai/deepseek-v4-flash": _V4_FLASH,
                   "deepseek-ai/deepseek-v4-flash-base": _V4_FLASH, "deepseek-v4": _V4_FLASH,
                   "deepseek-v4-pro": _V4_PRO, "deepseek-ai/deepseek-v4-pro": _V4_PRO},
)

DEEPSEEK_V41 = ModelProfile(
    name="deepseek-v4.1",
    architectures=("DeepseekV41ForCausalLM", "DSparkV41DraftModel"),
    model_type="deepseek_v41",
    num_heads=64,
    index_topk=512,
    kv_scale_format=SCALE_POW2,
    family=DSV4_FAMILY,
    aliases=("deepseek-ai/DeepSeek-V4.1-Flash",),
    model_configs={"deepseek-v4.1-flash": _V41_FLASH, "deepseek-ai/deepseek-v4.1-flash": _V41_FLASH,
                   "deepseek-v4.1": _V41_FLASH},
)


@hookimpl
def mla_sm120_model_profiles() -> Iterator[ModelProfile]:
    yield GLM_DSA
    yield DEEPSEEK_V32
    yield GLM53_FLASH
    yield HY_V4
    yield KIMI_K31
    yield MISTRAL_LARGE_4
    yield DEEPSEEK_V4
    yield DEEPSEEK_V41
