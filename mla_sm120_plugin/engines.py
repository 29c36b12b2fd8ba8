"""What each engine calls things: its KV-cache spellings, its flags, its own backends.

A refusal must speak the language of the engine the user runs: vLLM users opt in with
``--attention-backend CUSTOM`` and ask for the 656-byte DSA cache with ``fp8_ds_mla``; SGLang
users opt in with ``--mla-sm120`` and call the same bytes ``fp8_e4m3``. Every message, and the
context builder's reading of ``--kv-cache-dtype``, takes these words from one :class:`Engine`
per engine, so ``mla-sm120 check --engine X`` and engine X say the same thing.

Pure Python: nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .kernels.dsa.layout import (BF16, BF16_NOPE, FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE, NVFP4_DS_MLA, ROPE_DIM,
                            SCALE_ARBITRARY)


@dataclass(frozen=True)
class Engine:
    """One engine's vocabulary and the facts about it the decision depends on.

    :param name: the key (``"vllm"``, ``"sglang"``), as ``mla-sm120 check --engine`` takes it.
    :param label: how messages name it.
    :param kv_spellings: ``--kv-cache-dtype`` values -> the cache layout they mean for a DSA model
        (other values pass through, and the policy refuses them naming :attr:`fp8_flag`).
    :param auto_fp8_from_sm: ``auto`` means the fp8 layout on NVIDIA SM families from this one up
        (SGLang resolves it so before any plugin sees it); None: ``auto`` is the model's bf16.
    :param scale_format: how the engine's cache writer stores fp8 scales when that is the engine's
        fact rather than the model's (SGLang: amax/448 for every model); None: the model's.
    :param enable_flag: how the plugin is switched on.
    :param fp8_flag: how to ask for the 656-byte fp8 DSA layout.
    :param bf16_flag: how to ask for a bf16 cache.
    :param kernel_flags: how a kernel is forced per phase.
    :param decode_bound: the settings that bound the tokens of one decode call.
    :param eager_flag: how CUDA graphs are switched off.
    :param native_backends: SM family -> the engine's own sparse-MLA backends there.
    :param feature_flags: engine feature (see :data:`mla_sm120_plugin.hooks.policy.FEATURE_REASONS`)
        -> how to switch it off.
    :param nope_layouts: the layout a ``--kv-cache-dtype`` gives a rope-less model instead (vLLM
        keeps fp8 rows 656 bytes wide, SGLang packs 528).
    :param no_writer: layouts the kernels read that this engine never writes -> why (a refusal's text).
    :param native_layout_notes: layout -> where the engine's own backends read it (a device refusal's fix).
    :param pooled_ids_align: for a pooled indexer (``index_kpool`` > 1) the engine hands the kernels
        ``index_topk + kpool - 1`` token ids a row (each pick's tokens plus the partial tail),
        rounded up to a multiple of this.
    """

    name: str
    label: str
    kv_spellings: Mapping[str, str]
    enable_flag: str
    fp8_flag: str
    bf16_flag: str
    kernel_flags: str
    decode_bound: str
    eager_flag: str
    native_backends: Mapping[int, str] = field(default_factory=dict)
    feature_flags: Mapping[str, str] = field(default_factory=dict)
    auto_fp8_from_sm: int | None = None
    scale_format: str | None = None
    nope_layouts: Mapping[str, str] = field(default_factory=dict)
    no_writer: Mapping[str, str] = field(default_factory=dict)
    native_layout_notes: Mapping[str, str] = field(default_factory=dict)
    pooled_ids_align: int = 1

    def kv_layout(self, value: str | None, sm_family: int | None, rope: int = ROPE_DIM) -> str:
        """The layout ``--kv-cache-dtype value`` gives a DSA model with a ``rope``-wide rope part on a
        GPU of ``sm_family``."""
        if value is None or str(value) == "auto":
            fp8 = self.auto_fp8_from_sm is not None and sm_family is not None and sm_family >= self.auto_fp8_from_sm
            base = FP8_DS_MLA if fp8 else BF16
        else:
            base = self.kv_spellings.get(str(value), str(value))
        return self.nope_layouts.get(base, base) if rope == 0 else base

    def index_width(self, index_topk: int, index_kpool: int) -> int:
        """How many ids a row of top-k indices holds when the kernels get it."""
        if index_kpool <= 1:
            return index_topk
        wide = index_topk + index_kpool - 1
        return -(-wide // self.pooled_ids_align) * self.pooled_ids_align

    def writer_missing(self, layout: str, rope: int) -> str | None:
        """Why this engine never writes ``layout`` for a model with a ``rope``-wide rope, or None."""
        return self.no_writer.get(layout) or (self.no_writer.get(f"{layout}@rope0") if rope == 0 else None)

    def spelling(self, layout: str) -> str:
        """The engine's own name for ``layout`` (its first spelling that means it)."""
        return next((word for word, meant in self.kv_spellings.items() if meant == layout), layout)

    def own_backends(self, sm_family: int | None) -> str:
        """The engine's own sparse-MLA backends on ``sm_family``."""
        return self.native_backends.get(sm_family, f"{self.label}'s own attention backends")


_SHARED_SPELLINGS: Mapping[str, str] = {BF16: BF16, "bfloat16": BF16}

VLLM = Engine(
    name="vllm",
    label="vLLM",
    # vLLM calls the packed DSA layout fp8_ds_mla; its fp8/fp8_e4m3 are a plain fp8 cache, which
    # vLLM rewrites to fp8_ds_mla only for its in-tree backends (by name), never for CUSTOM.
    kv_spellings={FP8_DS_MLA: FP8_DS_MLA, NVFP4_DS_MLA: NVFP4_DS_MLA, **_SHARED_SPELLINGS},
    enable_flag="--attention-backend CUSTOM",
    fp8_flag=f"--kv-cache-dtype {FP8_DS_MLA}",
    bf16_flag="--kv-cache-dtype auto (or bfloat16)",
    kernel_flags="--additional-config '{\"mla_sm120\": {\"prefill_kernel\": ..., \"decode_kernel\": ...}}'",
    decode_bound="--max-num-seqs x (1 + --num-speculative-tokens)",
    eager_flag="--enforce-eager",
    native_backends={
        9: "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90",
        10: "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE",
    },
    feature_flags={
        "hisparse": "drop the HiSparse attention config (attention_config.hisparse_config)",
        "dcp": "set --decode-context-parallel-size 1",
    },
    nope_layouts={FP8_DS_MLA: FP8_DS_MLA_NOPE, BF16: BF16_NOPE},
    # vLLM 0.33 writes nvfp4_ds_mla in its DSA models' fused_norm_rope only (DeepSeek-V3.2 geometry);
    # its own reader, FLASHMLA_SPARSE, refuses it off SM100.
    no_writer={NVFP4_DS_MLA + "@rope0": "vLLM writes nvfp4_ds_mla only for the DSA geometry (512 latent + 64 rope: "
               "the DSA models' fused_norm_rope writer); a rope-less model (GLM-5.3-Flash) has no nvfp4 writer"},
    native_layout_notes={NVFP4_DS_MLA: "vLLM's own FLASHMLA_SPARSE reads nvfp4_ds_mla on SM100 only; elsewhere pass "
                         f"--kv-cache-dtype {FP8_DS_MLA}"},
    pooled_ids_align=128,  # the kpool indexer's buffer: round_up(2048 + 3, 128) = 2176 for GLM-5.3-Flash
)

SGLANG = Engine(
    name="sglang",
    label="SGLang",
    # SGLang's DSA pool packs fp8 latent + fp32 scales + bf16 rope under the name fp8_e4m3.
    kv_spellings={"fp8_e4m3": FP8_DS_MLA, FP8_DS_MLA: FP8_DS_MLA, **_SHARED_SPELLINGS, "bf16": BF16},
    enable_flag="--mla-sm120",
    fp8_flag="--kv-cache-dtype fp8_e4m3",
    bf16_flag="--kv-cache-dtype bfloat16",
    kernel_flags="--dsa-prefill-backend / --dsa-decode-backend (or --mla-sm120-config)",
    decode_bound="--max-running-requests x --speculative-num-draft-tokens",
    eager_flag="--disable-cuda-graph",
    native_backends={
        9: "--dsa-*-backend flashmla_sparse / flashmla_kv",
        10: "--dsa-*-backend flashmla_sparse / flashmla_kv / trtllm",
    },
    feature_flags={
        "hisparse": "drop --enable-hisparse",
        "dcp": "set --dcp-size 1",
        "skip_softmax": "unset SGLANG_SKIP_SOFTMAX_PREFILL/DECODE_THRESHOLD_SCALE_FACTOR",
    },
    # _dsa_kv_cache_dtype_default: auto -> fp8_e4m3 for DSA models on SM >= 10 (no learnable sinks).
    auto_fp8_from_sm=10,
    scale_format=SCALE_ARBITRARY,  # its DSA cache writer stores amax/448 for every model
    nope_layouts={FP8_DS_MLA: FP8_NOPE, BF16: BF16_NOPE},
    no_writer={NVFP4_DS_MLA: "SGLang 0.5.23 has no nvfp4_ds_mla cache writer (its DSA pool writes fp8_e4m3 "
               "or bf16 rows; only vLLM's DSA writer fills the 352-byte nvfp4 rows)"},
    pooled_ids_align=1,  # 2048 + 3 = 2051 ids for GLM-5.3-Flash
)

ENGINES: Mapping[str, Engine] = {engine.name: engine for engine in (VLLM, SGLANG)}
