"""The built-in servability policy: what the plugin serves at all, before any kernel is weighed.

A built-in ``mla_sm120_validate`` implementation, registered like a third party's, so that
``mla-sm120 check``, ``doctor`` and every engine adapter refuse the same contexts with the same
text. Kernel envelopes (:class:`~mla_sm120_plugin.types.KernelSpec`) then decide which kernel
serves a context that passed here.
"""

from __future__ import annotations

from typing import Iterator

from ..engines import ENGINES
from ..kernels.dsa.layout import BF16, FP8_DS_MLA, KV_LAYOUTS, KV_LORA_RANK, LAYOUTS, NVFP4_DS_MLA, ROPE_DIM
from ..kernels.dsv4.layout import FP8_DSV4
from ..kernels.dsv4.layout import RECORDS as DSV4_RECORDS
from ..types import ModelProfile, Refusal, SelectionContext
from .specs import hookimpl

# The plugin serves SM12x. On SM90/SM100 the engines' own sparse-MLA backends (FlashMLA and
# FlashInfer's datacenter kernels) are faster and maintained upstream, so the plugin refuses
# other families even where its Triton kernel could run.
SERVED_SM_FAMILIES = frozenset({12})

# Engine features that change how the cache is written or how top-k ids are read; no kernel here
# reads their layout. Each maps to why, for the message.
FEATURE_REASONS = {
    "hisparse": "HiSparse writes the cache through another path and remaps top-k through its own index group",
    "dcp": "decode context parallelism shards the cache across ranks; the kernels read one rank's whole cache",
    "skip_softmax": "skip-softmax changes the attention output the kernels compute",
}

SERVED_DEVICE = "an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)"
# The widths the kernels here read: a 512-wide latent, with a 64-wide rope (GLM-5, DeepSeek-V3.2:
# 576-wide q/k) or none (GLM-5.3-Flash: 512-wide).
SERVED_GEOMETRY = {"kv_lora_rank": (KV_LORA_RANK,), "qk_rope_head_dim": (ROPE_DIM, 0)}


def _device_refusal(ctx: SelectionContext) -> Refusal | None:
    dev = ctx.device
    if dev.vendor == "nvidia" and dev.sm_family in SERVED_SM_FAMILIES:
        return None
    engine = ENGINES[ctx.engine]
    if dev.vendor == "nvidia":
        label = f"sm_{dev.sm_major}{dev.sm_minor}"
        fix = (f"on {label} serve without this plugin: drop {engine.enable_flag}; {engine.label}'s own sparse-MLA "
               f"backends serve DSA models there ({engine.own_backends(dev.sm_family)})")
        note = engine.native_layout_notes.get(ctx.kv_cache_dtype)
        if note:
            fix += f" ({note})"
        return Refusal(f"device {label}: this plugin serves SM12x only", SERVED_DEVICE, fix)
    where = "a ROCm GPU" if dev.vendor == "amd" else "no GPU (CPU)"
    return Refusal(
        f"device {where}: this plugin serves NVIDIA SM12x GPUs only",
        SERVED_DEVICE,
        "run on an SM12x GPU, or plan for one with --sm 12.0 (RTX 50xx / RTX PRO 6000) or --sm 12.1 (DGX Spark)",
    )


def kv_dtype_fix(kv: str, engine: str = "vllm") -> str:
    """How to name, in ``engine``'s flags, a KV cache dtype the kernels read, given the unreadable ``kv``."""
    words = ENGINES[engine]
    if kv.startswith("fp8") and engine == "vllm":
        # vLLM canonicalises fp8 -> fp8_ds_mla only for its own backends, by name.
        return (f"pass {words.fp8_flag} (the 656-byte DSA layout); plain {kv} is not rewritten for a plugin "
                "backend (SGLang's fp8_e4m3 is that layout: plan for SGLang with mla-sm120 check --engine sglang)")
    return f"pass {words.fp8_flag} (the 656-byte DSA layout), or {words.bf16_flag} for a bf16 cache"


def _geometry_refusal(ctx: SelectionContext) -> Refusal | None:
    model = {"kv_lora_rank": ctx.kv_lora_rank, "qk_rope_head_dim": ctx.qk_rope_head_dim}
    wrong = {key: value for key, value in model.items() if value not in SERVED_GEOMETRY[key]}
    if wrong:
        given = ", ".join(f"{key}={value}" for key, value in wrong.items())
        return Refusal(
            f"model geometry {given}: the kernels read caches of a {KV_LORA_RANK}-wide fp8/bf16 latent with a "
            f"{ROPE_DIM}-wide rope (q/k {KV_LORA_RANK + ROPE_DIM} wide) or none (q/k {KV_LORA_RANK} wide); "
            "this model writes other rows",
            " or ".join(f"{key} in {list(values)}" for key, values in SERVED_GEOMETRY.items())
            + " (GLM-5, DeepSeek-V3.2, GLM-5.3-Flash)",
            f"serve this model without {ENGINES[ctx.engine].enable_flag}, or check that the model's config.json "
            "is its own (a copied config edited by hand?)",
        )
    cache = LAYOUTS.get(ctx.kv_cache_dtype)
    if ENGINES[ctx.engine].writer_missing(ctx.kv_cache_dtype, ctx.qk_rope_head_dim):
        return None  # refused already, with the reason the engine has no writer for it
    if cache is not None and cache.rope != ctx.qk_rope_head_dim:
        engine = ENGINES[ctx.engine]
        meant = engine.kv_layout(ctx.kv_cache_dtype_given, ctx.device.sm_family, ctx.qk_rope_head_dim)
        return Refusal(
            f"kv layout {ctx.kv_cache_dtype} has a {cache.rope}-wide rope part; the model's qk_rope_head_dim is "
            f"{ctx.qk_rope_head_dim}: the engine writes {meant} rows for it",
            f"a layout whose rope width is the model's ({meant})",
            "let the plugin derive the layout from the engine's --kv-cache-dtype and the model (do not name a "
            "layout of another geometry)",
        )
    return None


def _dsv4_refusals(ctx: SelectionContext) -> Iterator[Refusal]:
    """A DeepSeek-V4 layer kind: the SM family and the record (the planner checked TP and the KV
    dtype's spelling; here a third party's context is held to the same)."""
    from ..dsv4_plan import ENGINES as DSV4_ENGINES
    from ..dsv4_plan import device_refusal

    engine = DSV4_ENGINES[ctx.engine]
    device = device_refusal(ctx.device, ctx.engine)
    if device is not None:
        yield device
    if ctx.kv_cache_dtype not in DSV4_RECORDS:
        yield Refusal(
            f"kv layout {ctx.kv_cache_dtype}: DeepSeek-V4 layers read the {DSV4_RECORDS[FP8_DSV4].token_bytes}-byte record",
            f"kv layouts {sorted(DSV4_RECORDS)}",
            f"pass --kv-cache-dtype {engine.kv_spellings[-1]} (or auto)",
        )
    for feature in sorted(ctx.features):
        yield Refusal(f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
                      "the standard DeepSeek-V4 cache path",
                      f"{ENGINES[ctx.engine].feature_flags.get(feature, f'turn {feature} off')}")


@hookimpl
def mla_sm120_validate(ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
    """SM family, engine features, KV layout and model geometry: the rules every engine shares."""
    if ctx.dsv4 is not None:
        yield from _dsv4_refusals(ctx)
        return
    engine = ENGINES[ctx.engine]
    device = _device_refusal(ctx)
    if device is not None:
        yield device
    if ctx.kv_cache_dtype not in KV_LAYOUTS:
        spelled = ctx.kv_cache_dtype_given or ctx.kv_cache_dtype
        yield Refusal(
            f"kv_cache_dtype {spelled}: no kernel reads that layout",
            f"{engine.spelling(FP8_DS_MLA)} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or "
            f"{engine.spelling(BF16)}",
            kv_dtype_fix(spelled, ctx.engine),
        )
    elif engine.writer_missing(ctx.kv_cache_dtype, ctx.qk_rope_head_dim):
        spelled = ctx.kv_cache_dtype_given or ctx.kv_cache_dtype
        yield Refusal(
            f"kv_cache_dtype {spelled}: {engine.writer_missing(ctx.kv_cache_dtype, ctx.qk_rope_head_dim)}",
            f"the layouts {engine.label} writes for this model: "
            + " or ".join(f"{engine.spelling(w)} ({engine.kv_layout(w, ctx.device.sm_family, ctx.qk_rope_head_dim)} rows)"
                          for w in (FP8_DS_MLA, BF16)),
            kv_dtype_fix(spelled, ctx.engine)
            + ("" if ctx.engine == "vllm" else "; the 352-byte nvfp4 cache is served with vLLM "
               f"({ENGINES['vllm'].enable_flag} --kv-cache-dtype {NVFP4_DS_MLA})"),
        )
    for feature in sorted(ctx.features):
        yield Refusal(
            f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
            "the standard DSA cache and top-k path",
            f"{engine.feature_flags.get(feature, f'turn {feature} off')}, or serve without {engine.enable_flag} "
            f"({engine.label}'s own sparse-MLA backends)",
        )
    geometry = _geometry_refusal(ctx)
    if geometry is not None:
        yield geometry
    elif profile is not None and (profile.kv_lora_rank not in SERVED_GEOMETRY["kv_lora_rank"]
                                  or profile.qk_rope_head_dim not in SERVED_GEOMETRY["qk_rope_head_dim"]):
        yield Refusal(
            f"profile {profile.name} has kv_lora_rank={profile.kv_lora_rank}, qk_rope_head_dim="
            f"{profile.qk_rope_head_dim}: the kernels read {KV_LORA_RANK}+{ROPE_DIM}-wide or {KV_LORA_RANK}-wide caches",
            f"kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim {ROPE_DIM} or 0 (GLM-5, DeepSeek-V3.2, GLM-5.3-Flash)",
            "serve this model with a plugin whose kernels read its geometry",
        )
    elif profile is not None and profile.qk_rope_head_dim != ctx.qk_rope_head_dim:
        # The engine picks its cache writer by architecture: a DSA architecture writes rope bytes,
        # GLM-5.3-Flash's writes none. A config that disagrees with its architecture is not a model
        # either engine serves as written; reading it with either layout would be a guess.
        yield Refusal(
            f"the model's config.json has qk_rope_head_dim={ctx.qk_rope_head_dim}, but its architecture "
            f"{ctx.model_arch} ({profile.name}) has qk_rope_head_dim={profile.qk_rope_head_dim}: the engine's cache writer for "
            "that architecture does not write the rows this geometry needs",
            f"qk_rope_head_dim={profile.qk_rope_head_dim} for {ctx.model_arch}"
            + (" (a rope-less model is GLM-5.3-Flash: Glm5Next* architectures)" if ctx.qk_rope_head_dim == 0 else ""),
            "check that the model's config.json is its own (a copied config edited by hand?); for a rope-less "
            "(NoPE) model use its own architecture name",
        )
