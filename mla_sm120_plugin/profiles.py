"""The built-in model profiles: GLM-5 (GLM DSA), DeepSeek-V3.2, the rope-less GLM-5.3-Flash, HY V4
(Hy4-preview: DSA with learned per-head sinks), Kimi K3.1 and Mistral Large 4 (vLLM 0.34) and the
DeepSeek-V4 family (V4-Flash, V4-Pro, V4.1-Flash and their drafts).

Registered through the same hook (``mla_sm120_model_profiles``) as a third party's profiles.

:data:`SOURCES` says where each profile's geometry comes from (heads, rope and latent widths, index
top-k, key pooling, the layer counts its model configs state): the key of the model's public
config.json and the engine code or config class that names the value, with the release.
``tests/fixtures/public_model_configs.json`` keeps a copy of those public values (where and when they
were read); ``tests/unit/test_profile_sources.py`` holds the profiles to it and
``tests/vllm/test_profile_sources_vllm.py`` / ``tests/sglang_engine/test_profile_sources_sglang.py`` to the
installed engine's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

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
    num_heads=64,  # the released config's (SOURCES); HYV4Config's default 32 is a placeholder
    index_topk=2048,
    # vLLM fills the cache with concat_and_cache_mla, SGLang with its amax/448 writer (bf16 under
    # sinks there): read as values, either is right for every kernel here.
    kv_scale_format=SCALE_ARBITRARY,
    sinks=True,  # learnable_sink: one learned logit a head, in the softmax denominator
    aliases=("hy4-preview", "tencent/Hy4-preview"),
)


# vLLM 0.34's two new sparse-MLA models (docs/facts.md, vLLM 0.34). Neither is built by vLLM 0.33 or SGLang
# 0.5.23 (engines.py: missing_architectures). The values serve a plan by name (SOURCES says where each comes
# from); a config.json's own keys win.
KIMI_K31 = ModelProfile(
    name="kimi-k3.1",
    # One multimodal architecture (vLLM builds KimiK3ForConditionalGeneration for it); its text part is
    # a kimi_linear config whose DSA layers are NoPE MLA (mla_use_nope: the 64 rope columns are kept in
    # the cache, unrotated) with an optional output gate (g_proj) outside the attention call.
    architectures=("KimiK31ForConditionalGeneration",),
    model_type="kimi_k3",
    num_heads=96,  # Kimi K3's config (K3.1's is not public); vLLM 0.34's K3.1 code is written for 96 (SOURCES)
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
    num_heads=64,  # vLLM 0.34's Mistral Large 4 code is written for 64 (SOURCES); no config.json is public
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
# V4-Pro: 128 heads, 16 output groups, top-k 1024, 61 layers (its config.json, vLLM's V4-Pro constants).
_V4_PRO = {**_V4_FLASH, "num_hidden_layers": 61, "num_attention_heads": 128, "o_groups": 16, "index_topk": 1024}
# V4.1-Flash: 64 heads, 8 groups, top-k 512 (vLLM's V4.1 constants). Its per-layer compress_ratios
# (0 / 1 / 2) are in its config.json only: the profile plans one layer of each kind V4.1 has (3 layers
# stand in for the model's 40; LAYER_COUNTS_UNKNOWN says so).
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



# Where each built-in profile's geometry comes from. Data, read by the tests (a third party's profile needs none).
@dataclass(frozen=True)
class ValueSource:
    """Where one geometry value of a built-in profile comes from.

    :param repo: the HF repo whose config.json states the value ("" when no public config does: ``engine``
        is then the source, and the value it names is recorded beside the public ones in
        ``tests/fixtures/public_model_configs.json``).
    :param key: the value's key in that config.json (``text_config.num_attention_heads``).
    :param engine: the engine's model code or config class that names the value, with the release
        ("" when no engine names it).
    :param note: what a reader needs besides (a copy read instead of the hub file, an engine default that is
        not the model's, a planning stand-in).
    :param stand_in: the profile's value is not the model's on purpose (``note`` says why); the profile's model
        config then says so (:data:`~mla_sm120_plugin.types.LAYER_COUNTS_UNKNOWN`).
    """

    repo: str
    key: str
    engine: str
    note: str = ""
    stand_in: bool = False


@dataclass(frozen=True)
class ProfileSources:
    """Where a built-in profile's geometry comes from: one :class:`ValueSource` for each of
    :data:`GEOMETRY` (``index_kpool`` where the profile pools keys), and for each named model config
    (``model_configs``, by the name under which the profile lists it) one for each of its
    :data:`CONFIG_GEOMETRY` keys.

    :param repo: the HF repo of the model the profile plans (listed in the fixture, public or not).
    """

    repo: str
    num_heads: ValueSource
    qk_rope_head_dim: ValueSource
    kv_lora_rank: ValueSource
    index_topk: ValueSource
    index_kpool: ValueSource | None = None
    model_configs: Mapping[str, Mapping[str, ValueSource]] = field(default_factory=dict)


# The profile fields SOURCES covers; index_kpool only where a profile pools keys (index_kpool > 1).
GEOMETRY = ("num_heads", "qk_rope_head_dim", "kv_lora_rank", "index_topk", "index_kpool")
# The keys of a named model config SOURCES covers (a DeepSeek-V4 config's latent is its head_dim).
CONFIG_GEOMETRY = ("num_attention_heads", "qk_rope_head_dim", "kv_lora_rank", "head_dim", "index_topk",
                   "index_kpool", "num_hidden_layers")

_TF = "transformers 5.20.2 / 5.22.2 (with vLLM 0.33 / 0.34; vLLM reads the config.json with it)"
_V4_MONO = "vLLM 0.33.0 / 0.34.0 vllm/models/deepseek_v4/amd/mono/dims.py"
_V41_MONO = "vLLM 0.33.0 / 0.34.0 vllm/models/deepseek_v41/amd/mono/attention/plan.py"
_KIMI_MLA = "vLLM 0.33.0 / 0.34.0 vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/mla/"
_ML4 = "vLLM 0.34.0 vllm/models/mistral/mistral_large4/amd/specialized_decode/"


def _named(repo: str, prefix: str, engine: dict[str, str]) -> dict[str, ValueSource]:
    """A named model config's sources: ``repo``'s config.json (``prefix``: where it nests the keys) for each key
    ``engine`` maps to the engine code that names it."""
    return {key: ValueSource(repo, prefix + key, where) for key, where in engine.items()}


_SGL_V4 = "; SGLang 0.5.23 srt/configs/deepseek_v4.py DeepSeekV4Config default"
_V4_FLASH_SOURCES = _named("deepseek-ai/DeepSeek-V4-Flash", "", {
    key: f"{_TF} DeepseekV4Config default {key}" + ("" if key == "head_dim" else _SGL_V4)
    for key in ("num_attention_heads", "qk_rope_head_dim", "head_dim", "index_topk", "num_hidden_layers")})
_V4_PRO_SOURCES = _named("deepseek-ai/DeepSeek-V4-Pro", "", {
    "num_attention_heads": f"{_V4_MONO} N_HEADS", "qk_rope_head_dim": f"{_V4_MONO} ROPE",
    "head_dim": f"{_V4_MONO} HEAD_DIM", "index_topk": f"{_V4_MONO} INDEX_TOPK",
    "num_hidden_layers": "vLLM 0.33.0 / 0.34.0 vllm/models/deepseek_v4/amd/mono/README.md (61 backbone layers)"})
_V41_FLASH_SOURCES = _named("deepseek-ai/DeepSeek-V4.1-Flash", "text_config.", {
    "num_attention_heads": f"{_V41_MONO} N_HEADS", "qk_rope_head_dim": f"{_V41_MONO} ROPE",
    "head_dim": f"{_V41_MONO} HEAD_DIM", "index_topk": f"{_V41_MONO} TOPK"})
_V41_FLASH_SOURCES["num_hidden_layers"] = ValueSource(
    "deepseek-ai/DeepSeek-V4.1-Flash", "text_config.num_hidden_layers",
    "vLLM 0.33.0 / 0.34.0 vllm/models/deepseek_v41/amd/mono/README.md (40 backbone layers)",
    note="3 layers, one of each compress ratio (0 / 1 / 2), stand in for the model's 40: the model's per-layer "
         "compress_ratios are in its own config.json", stand_in=True)
_LATENT = "a DeepSeek-V4 layer's latent is its whole 512-wide head"

SOURCES: Mapping[str, ProfileSources] = {
    "glm-5": ProfileSources(
        repo="zai-org/GLM-5",
        num_heads=ValueSource("zai-org/GLM-5", "num_attention_heads", f"{_TF} GlmMoeDsaConfig default"),
        qk_rope_head_dim=ValueSource("zai-org/GLM-5", "qk_rope_head_dim", f"{_TF} GlmMoeDsaConfig default"),
        kv_lora_rank=ValueSource("zai-org/GLM-5", "kv_lora_rank", f"{_TF} GlmMoeDsaConfig default"),
        index_topk=ValueSource("zai-org/GLM-5", "index_topk", f"{_TF} GlmMoeDsaConfig default"),
    ),
    "deepseek-v3.2": ProfileSources(
        repo="deepseek-ai/DeepSeek-V3.2",
        num_heads=ValueSource("deepseek-ai/DeepSeek-V3.2", "num_attention_heads", f"{_TF} DeepseekV32Config default"),
        qk_rope_head_dim=ValueSource("deepseek-ai/DeepSeek-V3.2", "qk_rope_head_dim",
                                     f"{_TF} DeepseekV32Config default"),
        kv_lora_rank=ValueSource("deepseek-ai/DeepSeek-V3.2", "kv_lora_rank", f"{_TF} DeepseekV32Config default"),
        index_topk=ValueSource("deepseek-ai/DeepSeek-V3.2", "index_topk", f"{_TF} DeepseekV32Config default",
                               note="vLLM reads deepseek_v32 with DeepseekV3Config, which has no index_topk"),
    ),
    "glm-5.3-flash": ProfileSources(
        repo="zai-org/GLM-5.3-Flash",
        num_heads=ValueSource("zai-org/GLM-5.3-Flash", "text_config.num_attention_heads",
                              f"{_TF} Glm5NextTextConfig default; SGLang 0.5.23 srt/configs/glm5_next.py default"),
        qk_rope_head_dim=ValueSource("zai-org/GLM-5.3-Flash", "text_config.qk_rope_head_dim",
                                     f"{_TF} Glm5NextTextConfig default; SGLang 0.5.23 srt/configs/glm5_next.py "
                                     "default"),
        kv_lora_rank=ValueSource("zai-org/GLM-5.3-Flash", "text_config.kv_lora_rank",
                                 f"{_TF} Glm5NextTextConfig default; SGLang 0.5.23 srt/configs/glm5_next.py default"),
        index_topk=ValueSource("zai-org/GLM-5.3-Flash", "text_config.index_topk", f"{_TF} Glm5NextTextConfig default"),
        index_kpool=ValueSource("zai-org/GLM-5.3-Flash", "text_config.index_kpool", "",
                                note="no engine names it: transformers' Glm5NextTextConfig defaults to 16, the "
                                     "released model pools 4"),
    ),
    "hy-v4": ProfileSources(
        repo="tencent/Hy4-preview",
        num_heads=ValueSource("tencent/Hy4-preview", "num_attention_heads", "",
                              note="vLLM's, SGLang's and transformers' HYV4Config default 32 is a placeholder "
                                   "(with hidden_size 2816 and 34 layers), not the released model's"),
        qk_rope_head_dim=ValueSource("tencent/Hy4-preview", "qk_rope_head_dim",
                                     "vLLM 0.33.0 / 0.34.0 vllm/transformers_utils/configs/hy_v4.py HYV4Config "
                                     "default; SGLang 0.5.23 srt/configs/hy_v4.py default"),
        kv_lora_rank=ValueSource("tencent/Hy4-preview", "kv_lora_rank",
                                 "vLLM 0.33.0 / 0.34.0 vllm/transformers_utils/configs/hy_v4.py HYV4Config default; "
                                 "SGLang 0.5.23 srt/configs/hy_v4.py default"),
        index_topk=ValueSource("tencent/Hy4-preview", "index_topk",
                               "vLLM 0.33.0 / 0.34.0 vllm/transformers_utils/configs/hy_v4.py HYV4Config default; "
                               "SGLang 0.5.23 srt/configs/hy_v4.py default"),
    ),
    "kimi-k3.1": ProfileSources(
        repo="moonshotai/Kimi-K3.1",
        num_heads=ValueSource("moonshotai/Kimi-K3", "text_config.num_attention_heads",
                              f"{_KIMI_MLA}query.py TILED_FROM (12 and 6 heads a GPU at TP 8 / 16); vLLM 0.34.0 "
                              "cutedsl/mla/dcp.py and cutedsl/dsa/prepared.py (96 heads)",
                              note="Kimi K3's config: no K3.1 config.json is public; vLLM 0.34's K3.1 code is "
                                   "written for the same 96 (q_b_proj [18432, 1536] = 96 x 192)"),
        qk_rope_head_dim=ValueSource("moonshotai/Kimi-K3", "text_config.qk_rope_head_dim",
                                     f"{_KIMI_MLA} qk_rope_head_dim=64",
                                     note="mla_use_nope: the 64 rope columns are stored unrotated (656-byte rows)"),
        kv_lora_rank=ValueSource("moonshotai/Kimi-K3", "text_config.kv_lora_rank", f"{_KIMI_MLA} kv_lora_rank=512"),
        index_topk=ValueSource("", "text_config.dsa_config.index_topk",
                               "vLLM 0.34.0 vllm/transformers_utils/configs/kimi_linear.py KimiLinearDSAConfig "
                               "default index_topk",
                               note="Kimi K3's config has no dsa_config and no K3.1 config.json is public"),
    ),
    "mistral-large-4": ProfileSources(
        repo="mistralai/Mistral-Large-4.0-1T05-A52B",
        num_heads=ValueSource("", "num_attention_heads",
                              f"{_ML4}mono/geometry_config.py ML4_CONFIG local_heads x ML4_REFERENCE_TP "
                              "(runtime/weights.py checks num_local_heads x TP == 64)",
                              note="no config.json (params.json) of Mistral Large 4 is public"),
        qk_rope_head_dim=ValueSource("", "qk_rope_head_dim", f"{_ML4}mono/geometry_config.py ML4_CONFIG pe_dim",
                                     note="NoPE layers keep the 64 rope columns as zeros"),
        kv_lora_rank=ValueSource("", "kv_lora_rank", f"{_ML4}mono/geometry_config.py ML4_CONFIG kv_lora"),
        index_topk=ValueSource("", "index_topk", f"{_ML4}runtime/spec.py DecodeConfig topk"),
    ),
    "deepseek-v4": ProfileSources(
        repo="deepseek-ai/DeepSeek-V4-Flash",
        num_heads=_V4_FLASH_SOURCES["num_attention_heads"],
        qk_rope_head_dim=_V4_FLASH_SOURCES["qk_rope_head_dim"],
        kv_lora_rank=ValueSource("deepseek-ai/DeepSeek-V4-Flash", "head_dim",
                                 f"{_TF} DeepseekV4Config default head_dim", note=_LATENT),
        index_topk=_V4_FLASH_SOURCES["index_topk"],
        model_configs={"deepseek-v4-flash": _V4_FLASH_SOURCES, "deepseek-v4-pro": _V4_PRO_SOURCES},
    ),
    "deepseek-v4.1": ProfileSources(
        repo="deepseek-ai/DeepSeek-V4.1-Flash",
        num_heads=_V41_FLASH_SOURCES["num_attention_heads"],
        qk_rope_head_dim=_V41_FLASH_SOURCES["qk_rope_head_dim"],
        kv_lora_rank=ValueSource("deepseek-ai/DeepSeek-V4.1-Flash", "text_config.head_dim", f"{_V41_MONO} HEAD_DIM",
                                 note=_LATENT),
        index_topk=_V41_FLASH_SOURCES["index_topk"],
        model_configs={"deepseek-v4.1-flash": _V41_FLASH_SOURCES},
    ),
}

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
