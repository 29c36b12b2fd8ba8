"""DeepSeek Sparse Attention, as a family: one latent cache, one call shape, one layer kind.

Every DSA layer (GLM-5, DeepSeek-V3.2, the rope-less GLM-5.3-Flash, HY V4, Kimi K3.1, Mistral Large 4)
makes the same call, so a plan holds one context (:data:`KIND`): the one the shared context builder
made from the engine's settings. Its rules are the cache layouts the kernels of
:mod:`mla_sm120_plugin.kernels.dsa` read and the model geometry those layouts have room for. Pure Python.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ..engines import Engine, for_context, others
from ..kernels.dsa.layout import BF16, FP8_DS_MLA, KV_LAYOUTS, KV_LORA_RANK, LAYOUTS, ROPE_DIM
from ..rules import device_refusal, feature_refusals
from ..types import DcpService, Decision, DeviceInfo, ModelProfile, Refusal, SelectionContext
from .base import Shaped

NAME = "dsa"
KIND = "dsa"  # the one layer kind of a DSA model's plan

# The widths the kernels here read: a 512-wide latent, with a 64-wide rope (GLM-5, DeepSeek-V3.2:
# 576-wide q/k) or none (GLM-5.3-Flash: 512-wide).
SERVED_GEOMETRY = {"kv_lora_rank": (KV_LORA_RANK,), "qk_rope_head_dim": (ROPE_DIM, 0)}
GIB = 1 << 30


def kv_dtype_fix(kv: str, engine: Engine) -> str:
    """How to name, in ``engine``'s flags, a KV cache dtype the kernels read, given the unreadable ``kv``."""
    if kv.startswith("fp8") and engine.plain_fp8:
        return f"pass {engine.fp8_flag} (the 656-byte DSA layout); " + engine.plain_fp8.format(kv=kv)
    return f"pass {engine.fp8_flag} (the 656-byte DSA layout), or {engine.bf16_flag} for a bf16 cache"


def _served_elsewhere(engine: Engine, layout: str, rope: int) -> str:
    """Where another engine writes ``layout`` for a model with a ``rope``-wide rope part ('' : nowhere)."""
    for other in others(engine):
        spelled = next((word for word, meant in other.kv_spellings.items() if meant == layout), None)
        if spelled is not None and not other.writer_missing(layout, rope):
            return (f"; the {LAYOUTS[layout].token_bytes}-byte {layout} cache is served with {other.label} "
                    f"({other.enable_flag} --kv-cache-dtype {spelled})")
    return ""


def _kv_refusal(ctx: SelectionContext, engine: Engine) -> Refusal | None:
    spelled = ctx.kv_cache_dtype_given or ctx.kv_cache_dtype
    if ctx.kv_cache_dtype not in KV_LAYOUTS:
        return Refusal(
            f"kv_cache_dtype {spelled}: no kernel reads that layout",
            f"{engine.spelling(FP8_DS_MLA)} (656 B a token: fp8 latent + fp32 scales + bf16 rope) or "
            f"{engine.spelling(BF16)}",
            kv_dtype_fix(spelled, engine),
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
            kv_dtype_fix(spelled, engine) + _served_elsewhere(engine, ctx.kv_cache_dtype, ctx.qk_rope_head_dim),
        )
    return None


def _geometry_refusal(ctx: SelectionContext, engine: Engine) -> Refusal | None:
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
            f"serve this model without {engine.enable_flag}, or check that the model's config.json "
            "is its own (a copied config edited by hand?)",
        )
    cache = LAYOUTS.get(ctx.kv_cache_dtype)
    if engine.writer_missing(ctx.kv_cache_dtype, ctx.qk_rope_head_dim):
        return None  # refused already, with the reason the engine has no writer for it
    if cache is not None and cache.rope != ctx.qk_rope_head_dim:
        meant = engine.kv_layout(ctx.kv_cache_dtype_given, ctx.device.sm_family, ctx.qk_rope_head_dim)
        return Refusal(
            f"kv layout {ctx.kv_cache_dtype} has a {cache.rope}-wide rope part; the model's qk_rope_head_dim is "
            f"{ctx.qk_rope_head_dim}: the engine writes {meant} rows for it",
            f"a layout whose rope width is the model's ({meant})",
            "let the plugin derive the layout from the engine's --kv-cache-dtype and the model (do not name a "
            "layout of another geometry)",
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


class DsaFamily:
    """The DSA family (:class:`~mla_sm120_plugin.families.base.Family`)."""

    name = NAME
    label = "DSA"
    has_call = False
    layouts = frozenset(KV_LAYOUTS)
    selfcheck_case = "mla_sm120_plugin.dispatch.selfcheck_dsa"
    device_words = ("sparse-MLA backends", "DSA models", "this plugin")
    # One latent cache sharded by token: a rank attends the ids it owns and returns its LSE.
    dcp = DcpService(served=True)

    def own_path(self, engine: Engine, sm_family: int | None) -> str:
        return engine.own_backends(sm_family)

    def shape(self, base: SelectionContext, facts: "ModelFacts", kv_cache_dtype: str | None, limits: "EngineLimits",
              *, speculative_tokens: int = 0, dspark: bool = False) -> Shaped:
        """The one context of a DSA model: ``base`` itself (``speculative_tokens`` and ``dspark`` shape
        nothing here: the engine's decode bound in ``limits`` carries the draft tokens)."""
        return Shaped(contexts={KIND: base}, kv_cache=base.kv_cache_dtype)

    def config_geometry(self, cfg: Any, *, arch: str, where: str) -> None:
        """Nothing of its own: every DSA key is the shared reader's (:mod:`mla_sm120_plugin.modelinfo`)."""
        return None

    def kv_layout(self, engine: Engine, value: str | None, device: DeviceInfo, facts: Any) -> str:
        """The engine's spelling read for this model's rope width and sinks (:meth:`Engine.kv_layout`)."""
        return engine.kv_layout(value, device.sm_family, facts.qk_rope_head_dim, facts.sinks)

    def check_kv_cache_dtype(self, engine: Engine) -> str:
        """The engine's fp8 DSA cache."""
        return engine.spelling(FP8_DS_MLA)

    def refusals(self, ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
        """SM family, KV layout, engine features and model geometry."""
        engine = for_context(ctx)
        device = device_refusal(ctx.device, engine, self.device_words, self.own_path(engine, ctx.device.sm_family),
                                ctx.kv_cache_dtype, ctx.sinks)
        for refusal in (device, _kv_refusal(ctx, engine)):
            if refusal is not None:
                yield refusal
        yield from feature_refusals(ctx, "the standard DSA cache and top-k path",
                                    f", or serve without {engine.enable_flag} ({engine.label}'s own sparse-MLA backends)")
        geometry = _geometry_refusal(ctx, engine)
        profile_refusal = _profile_refusal(ctx, profile) if geometry is None else None
        for refusal in (geometry, profile_refusal):
            if refusal is not None:
                yield refusal

    def call_from_json(self, fields: Mapping[str, Any] | None) -> None:
        return None

    def token_bytes(self, layout: str) -> int | None:
        return LAYOUTS[layout].token_bytes if layout in LAYOUTS else None

    def capacity(self, ctx: SelectionContext) -> dict[str, Any]:
        """Cache tokens one GiB holds, per layer, in the context's layout beside the engine's fp8 and bf16
        layouts for the same model geometry (at the planned release)."""
        engine = for_context(ctx)
        names = [ctx.kv_cache_dtype] + [engine.kv_layout(base, ctx.device.sm_family, ctx.qk_rope_head_dim)
                                        for base in (FP8_DS_MLA, BF16)]
        rows = {name: {"token_bytes": LAYOUTS[name].token_bytes, "tokens_per_gib": GIB // LAYOUTS[name].token_bytes}
                for name in dict.fromkeys(names) if name in LAYOUTS}
        mine = rows.get(ctx.kv_cache_dtype)
        ratios = {name: round(mine["tokens_per_gib"] / row["tokens_per_gib"], 2)
                  for name, row in rows.items() if mine and name != ctx.kv_cache_dtype}
        cap = {"scope": "cache tokens a GiB holds, per layer", "layouts": rows, "ratio_vs": ratios}
        dcp = ctx.decode_context_parallel_size
        if dcp > 1 and mine:
            # Each GPU keeps the tokens it owns (position // interleave % dcp): 1/dcp of every request.
            cap["decode_context_parallel"] = {"size": dcp, "kept_per_gpu": f"1/{dcp}",
                                              "tokens_per_gib_per_gpu": mine["tokens_per_gib"] * dcp,
                                              "ratio_vs_dcp_1": float(dcp)}
        return cap

    def scales(self, ctx: SelectionContext, decision: Decision) -> str:
        lay = LAYOUTS.get(ctx.kv_cache_dtype)
        if lay is not None and lay.nvfp4:
            return f"e4m3 per {lay.latent_format.block} values, fixed by the layout"
        return decision.scale_format

    def plan_capacity(self, plan: "Plan") -> dict[str, Any]:
        return self.capacity(next(iter(plan.decisions.values())).context)

    def plan_rows(self, plan: "Plan") -> list[str]:
        return []

    def details(self, plan: "Plan") -> dict[str, Any]:
        return {}

    def layers(self, ctx: SelectionContext) -> None:
        return None


FAMILY = DsaFamily()
