"""The rule book: what the plugin serves at all, before any kernel is weighed.

A built-in ``mla_sm120_validate`` implementation (registered by the plugin manager exactly like a
third party's), so that ``mla-sm120 check``, ``doctor`` and every engine adapter refuse the same
contexts with the same text: the SM family (:func:`device_refusal`, one text for every model
family, the family choosing only its words), the KV layout, engine features and the model
geometry. Kernel envelopes (:class:`~mla_sm120_plugin.types.KernelSpec`) then decide which kernel
serves a context that passed here. Pure Python.
"""

from __future__ import annotations

from typing import Iterator

from .engines import ENGINES, Engine
from .hooks.specs import hookimpl
from .kernels.dsa.layout import BF16, FP8_DS_MLA, KV_LAYOUTS, KV_LORA_RANK, LAYOUTS, NVFP4_DS_MLA, ROPE_DIM
from .kernels.dsv4.layout import FP8_DSV4
from .kernels.dsv4.layout import RECORDS as DSV4_RECORDS
from .types import DSA_FAMILY, DSV4_FAMILY, DeviceInfo, ModelProfile, Refusal, SelectionContext

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

# A family's words in the device refusal: how its models' own path is called, what it serves, and
# what the user switches off to get there.
_FAMILY_WORDS = {
    DSA_FAMILY: ("sparse-MLA backends", "DSA models", "this plugin"),
    DSV4_FAMILY: ("DeepSeek-V4 backends", "DeepSeek-V4", "the plugin's opt-in"),
}


def _own_path(engine: Engine, family: str, sm_family: int | None) -> str:
    return engine.own_dsv4_path(sm_family) if family == DSV4_FAMILY else engine.own_backends(sm_family)


def device_refusal(device: DeviceInfo, engine: str, family: str = DSA_FAMILY,
                   kv_layout: str | None = None, sinks: bool = False) -> Refusal | None:
    """Why the plugin does not serve ``family`` on ``device`` (None: an SM12x GPU), naming the
    engine's own path there as the fix (and where it reads ``kv_layout``, when the engine says; for
    a model with learned sinks, the path that applies them).

    :param engine: the engine key (:data:`~mla_sm120_plugin.engines.ENGINES`).
    :param family: the model family (``"dsa"``, ``"dsv4"``): it chooses the words, never the rule.
    """
    if device.vendor == "nvidia" and device.sm_family in SERVED_SM_FAMILIES:
        return None
    words = ENGINES[engine]
    backends, models, opt_in = _FAMILY_WORDS[family]
    if device.vendor == "nvidia":
        label = device.label
        own = words.native_sink_backends.get(device.sm_family) if sinks else None
        fix = (f"on {label} serve without {opt_in}: drop {words.enable_flag}; {words.label}'s own {backends} "
               f"serve {models} there ({own or _own_path(words, family, device.sm_family)})")
        note = words.native_layout_notes.get(kv_layout) if kv_layout is not None else None
        if note:
            fix += f" ({note})"
        return Refusal(f"device {label}: this plugin serves SM12x only", SERVED_DEVICE, fix)
    where = "a ROCm GPU" if device.vendor == "amd" else "no GPU (CPU)"
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


def _feature_refusals(ctx: SelectionContext, path: str, fix_tail: str) -> Iterator[Refusal]:
    engine = ENGINES[ctx.engine]
    for feature in sorted(ctx.features):
        yield Refusal(f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
                      path, f"{engine.feature_flags.get(feature, f'turn {feature} off')}{fix_tail}")


def _dsv4_refusals(ctx: SelectionContext) -> Iterator[Refusal]:
    """A DeepSeek-V4 layer kind: the SM family and the record (the planner checked TP and the KV
    dtype's spelling; here a third party's context is held to the same)."""
    device = device_refusal(ctx.device, ctx.engine, DSV4_FAMILY, ctx.kv_cache_dtype)
    if device is not None:
        yield device
    if ctx.kv_cache_dtype not in DSV4_RECORDS:
        yield Refusal(
            f"kv layout {ctx.kv_cache_dtype}: DeepSeek-V4 layers read the {DSV4_RECORDS[FP8_DSV4].token_bytes}-byte record",
            f"kv layouts {sorted(DSV4_RECORDS)}",
            f"pass --kv-cache-dtype {ENGINES[ctx.engine].dsv4.kv_spellings[-1]} (or auto)",
        )
    yield from _feature_refusals(ctx, "the standard DeepSeek-V4 cache path", "")


def _kv_refusal(ctx: SelectionContext) -> Refusal | None:
    engine = ENGINES[ctx.engine]
    spelled = ctx.kv_cache_dtype_given or ctx.kv_cache_dtype
    if ctx.kv_cache_dtype not in KV_LAYOUTS:
        return Refusal(
            f"kv_cache_dtype {spelled}: no kernel reads that layout",
            f"{engine.spelling(FP8_DS_MLA)} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or "
            f"{engine.spelling(BF16)}",
            kv_dtype_fix(spelled, ctx.engine),
        )
    if ctx.sinks and engine.sink_layout is not None and ctx.kv_cache_dtype != engine.sink_layout:
        return Refusal(
            f"kv_cache_dtype {spelled} for a model with learned attention sinks: {engine.sink_layout_refused}",
            f"{engine.spelling(engine.sink_layout)} ({engine.sink_layout} rows) for this model under {engine.label}",
            f"pass {engine.bf16_flag} or leave it at auto",
        )
    missing = engine.writer_missing(ctx.kv_cache_dtype, ctx.qk_rope_head_dim)
    if missing:
        return Refusal(
            f"kv_cache_dtype {spelled}: {missing}",
            f"the layouts {engine.label} writes for this model: "
            + " or ".join(f"{engine.spelling(w)} ({engine.kv_layout(w, ctx.device.sm_family, ctx.qk_rope_head_dim)} rows)"
                          for w in (FP8_DS_MLA, BF16)),
            kv_dtype_fix(spelled, ctx.engine)
            + ("" if ctx.engine == "vllm" else "; the 352-byte nvfp4 cache is served with vLLM "
               f"({ENGINES['vllm'].enable_flag} --kv-cache-dtype {NVFP4_DS_MLA})"),
        )
    return None


def _profile_refusal(ctx: SelectionContext, profile: ModelProfile | None) -> Refusal | None:
    if profile is None:
        return None
    if (profile.kv_lora_rank not in SERVED_GEOMETRY["kv_lora_rank"]
            or profile.qk_rope_head_dim not in SERVED_GEOMETRY["qk_rope_head_dim"]):
        return Refusal(
            f"profile {profile.name} has kv_lora_rank={profile.kv_lora_rank}, qk_rope_head_dim="
            f"{profile.qk_rope_head_dim}: the kernels read {KV_LORA_RANK}+{ROPE_DIM}-wide or {KV_LORA_RANK}-wide caches",
            f"kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim {ROPE_DIM} or 0 (GLM-5, DeepSeek-V3.2, GLM-5.3-Flash)",
            "serve this model with a plugin whose kernels read its geometry",
        )
    if profile.qk_rope_head_dim != ctx.qk_rope_head_dim:
        # The engine picks its cache writer by architecture: a DSA architecture writes rope bytes,
        # GLM-5.3-Flash's writes none. A config that disagrees with its architecture is not a model
        # either engine serves as written; reading it with either layout would be a guess.
        return Refusal(
            f"the model's config.json has qk_rope_head_dim={ctx.qk_rope_head_dim}, but its architecture "
            f"{ctx.model_arch} ({profile.name}) has qk_rope_head_dim={profile.qk_rope_head_dim}: the engine's cache writer for "
            "that architecture does not write the rows this geometry needs",
            f"qk_rope_head_dim={profile.qk_rope_head_dim} for {ctx.model_arch}"
            + (" (a rope-less model is GLM-5.3-Flash: Glm5Next* architectures)" if ctx.qk_rope_head_dim == 0 else ""),
            "check that the model's config.json is its own (a copied config edited by hand?); for a rope-less "
            "(NoPE) model use its own architecture name",
        )
    return None


@hookimpl
def mla_sm120_validate(ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
    """SM family, engine features, KV layout and model geometry: the rules every engine shares."""
    if ctx.dsv4 is not None:
        yield from _dsv4_refusals(ctx)
        return
    engine = ENGINES[ctx.engine]
    for refusal in (device_refusal(ctx.device, ctx.engine, DSA_FAMILY, ctx.kv_cache_dtype, ctx.sinks),
                    _kv_refusal(ctx)):
        if refusal is not None:
            yield refusal
    yield from _feature_refusals(ctx, "the standard DSA cache and top-k path",
                                 f", or serve without {engine.enable_flag} ({engine.label}'s own sparse-MLA backends)")
    geometry = _geometry_refusal(ctx)
    profile_refusal = _profile_refusal(ctx, profile) if geometry is None else None
    for refusal in (geometry, profile_refusal):
        if refusal is not None:
            yield refusal
