"""The built-in servability policy: what the plugin serves at all, before any kernel is weighed.

A built-in ``mla_sm120_validate`` implementation, registered like a third party's, so that
``mla-sm120 check``, ``doctor`` and every engine adapter refuse the same contexts with the same
text. Kernel envelopes (:class:`~mla_sm120_plugin.types.KernelSpec`) then decide which kernel
serves a context that passed here.
"""

from __future__ import annotations

from typing import Iterator

from ..kernels.layout import FP8_DS_MLA, KV_LAYOUTS, KV_LORA_RANK, ROPE_DIM
from ..types import ModelProfile, Refusal, SelectionContext
from .specs import hookimpl

# The plugin serves SM12x. On SM90/SM100 the engines' own sparse-MLA backends (FlashMLA and
# FlashInfer's datacenter kernels) are faster and maintained upstream, so the plugin refuses
# other families even where its Triton kernel could run.
SERVED_SM_FAMILIES = frozenset({12})

# What the engines serve DSA models with on the families the plugin leaves to them.
ENGINE_BACKENDS = {
    9: "vLLM: FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90; SGLang: flashmla_sparse / flashmla_kv",
    10: "vLLM: FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE; SGLang: flashmla_sparse / flashmla_kv / trtllm",
}
_ENGINE_BACKENDS_OTHER = "vLLM's and SGLang's own attention backends"

# Engine features that change how the cache is written or how top-k ids are read; no kernel here
# reads their layout. Each maps to why, for the message.
FEATURE_REASONS = {
    "hisparse": "HiSparse writes the cache through another path and remaps top-k through its own index group",
    "dcp": "decode context parallelism shards the cache across ranks; the kernels read one rank's whole cache",
    "index_kpool": "an indexer k-pool over 1 returns pooled top-k ids, not token slots",
    "skip_softmax": "skip-softmax changes the attention output the kernels compute",
}
_FEATURE_FLAGS = {
    "hisparse": "drop the HiSparse attention config (vLLM: attention_config.hisparse_config)",
    "dcp": "set the decode context parallel size to 1",
    "index_kpool": "leave the indexer k-pool at 1",
    "skip_softmax": "turn skip-softmax off",
}

SERVED_DEVICE = "an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)"
ENABLE_FLAG = "--attention-backend CUSTOM (vLLM) or the plugin's --dsa-*-backend choices (SGLang)"


def _device_refusal(ctx: SelectionContext) -> Refusal | None:
    dev = ctx.device
    if dev.vendor == "nvidia" and dev.sm_family in SERVED_SM_FAMILIES:
        return None
    if dev.vendor == "nvidia":
        label = f"sm_{dev.sm_major}{dev.sm_minor}"
        backends = ENGINE_BACKENDS.get(dev.sm_family, _ENGINE_BACKENDS_OTHER)
        fix = (f"on {label} serve without this plugin: drop {ENABLE_FLAG}; the engine's own sparse-MLA "
               f"backends serve DSA models there ({backends})")
        return Refusal(f"device {label}: this plugin serves SM12x only", SERVED_DEVICE, fix)
    where = "a ROCm GPU" if dev.vendor == "amd" else "no GPU (CPU)"
    return Refusal(
        f"device {where}: this plugin serves NVIDIA SM12x GPUs only",
        SERVED_DEVICE,
        "run on an SM12x GPU, or plan for one with --sm 12.0 (RTX 50xx / RTX PRO 6000) or --sm 12.1 (DGX Spark)",
    )


def kv_dtype_fix(kv: str) -> str:
    """How to name a KV cache dtype the kernels read, given the unreadable ``kv``."""
    if kv.startswith("fp8"):
        # vLLM canonicalises fp8 -> fp8_ds_mla only for its own backends, by name.
        return (f"pass --kv-cache-dtype {FP8_DS_MLA} (the 656-byte DSA layout); plain {kv} is not rewritten "
                "for a plugin backend (SGLang's fp8_e4m3 is that layout: plan for it with mla-sm120 check "
                "--engine sglang)")
    return f"pass --kv-cache-dtype {FP8_DS_MLA}, or auto/bfloat16 for a bf16 cache"


@hookimpl
def mla_sm120_validate(ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
    """SM family, engine features, KV layout and model geometry: the rules every engine shares."""
    device = _device_refusal(ctx)
    if device is not None:
        yield device
    if ctx.kv_cache_dtype not in KV_LAYOUTS:
        yield Refusal(
            f"kv_cache_dtype {ctx.kv_cache_dtype}: no kernel reads that layout",
            f"{FP8_DS_MLA} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or bf16",
            kv_dtype_fix(ctx.kv_cache_dtype),
        )
    for feature in sorted(ctx.features):
        yield Refusal(
            f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
            "the standard DSA cache and top-k path",
            f"{_FEATURE_FLAGS.get(feature, f'turn {feature} off')}, or serve with the engine's own sparse-MLA backend",
        )
    if profile is not None and (profile.kv_lora_rank, profile.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
        yield Refusal(
            f"profile {profile.name} has kv_lora_rank={profile.kv_lora_rank}, qk_rope_head_dim="
            f"{profile.qk_rope_head_dim}: the kernels read {KV_LORA_RANK}+{ROPE_DIM}-wide caches",
            f"kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim={ROPE_DIM} (GLM-5, DeepSeek-V3.2)",
            "serve this model with a plugin whose kernels read its geometry",
        )
