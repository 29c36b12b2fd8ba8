"""What each engine calls things and how it shapes the attention calls, one :class:`Engine` each.

A refusal must speak the language of the engine the user runs: vLLM users opt in with
``--attention-backend CUSTOM`` and ask for the 656-byte DSA cache with ``fp8_ds_mla``; SGLang
users opt in with ``--mla-sm120`` and call the same bytes ``fp8_e4m3``. Every message, the context
builder's reading of ``--kv-cache-dtype`` and the DeepSeek-V4 call shapes (:class:`Dsv4Calls`: page
sizes, head padding, the record's spellings) take these facts from the one :data:`ENGINES` table,
so ``mla-sm120 check --engine X`` and engine X say the same thing. Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from dataclasses import dataclass, field
from typing import Mapping

from .errors import UnsupportedConfiguration, format_error
from .kernels.dsa.layout import (BF16, BF16_NOPE, FP8_DS_MLA, FP8_DS_MLA_NOPE, FP8_NOPE, NVFP4_DS_MLA, ROPE_DIM,
                                 SCALE_ARBITRARY)
from .kernels.dsv4.layout import NVFP4_DSV4
from .types import DECODE, PREFILL, SelectionContext


@dataclass(frozen=True)
class Dsv4Calls:
    """How one engine shapes DeepSeek-V4 attention calls on SM12x, and what it calls the record.

    :param kv_spellings: ``--kv-cache-dtype`` values that give the 584-byte fp8 record (the last one
        is the spelling a fix names).
    :param nvfp4_spellings: values that give the 384-byte NVFP4 record with the plugin's opt-in.
    :param kv_refused: values the engine itself refuses for DeepSeek-V4, and how it fails.
    :param window_page: model version -> entries a window-cache page holds as FlashInfer's kernels
        see it.
    :param call_window_page: model version -> entries a window-cache page holds as the engine's
        attention call passes it (SGLang passes its 256-token pages and copies them into 64-entry
        ones for FlashInfer only).
    :param compressed_page_tokens: model version -> tokens a compressed-cache page covers (the call
        site and FlashInfer see the same pages).
    :param decode_heads: q head counts a decode call is padded up to (the smallest that fits).
    :param prefill_heads: the same for prefill; empty: the rank's own count.
    :param decode_pad_default: decode q is padded to this unless the rank's count is listed (SGLang).
    :param own_path: SM family -> the engine's own DeepSeek-V4 attention there.
    :param opt_in: what switching the plugin on does for DeepSeek-V4 in this engine today.
    :param full_row_pow2: a C128A row (every compressed entry of the context) is widened to a power of two
        (vLLM) before :attr:`full_row_align` rounds it.
    :param full_row_align: a C128A row's width is a multiple of this (vLLM 128, SGLang 64).
    :param dspark_widens_window: a DSpark draft's decode window rows carry the draft tokens too, rounded up
        to 64 (vLLM's ``get_dspark_swa_index_width``).
    """

    kv_spellings: tuple[str, ...]
    kv_refused: Mapping[str, str]
    window_page: Mapping[str, int]
    call_window_page: Mapping[str, int]
    compressed_page_tokens: Mapping[str, int]
    decode_heads: tuple[int, ...]
    prefill_heads: tuple[int, ...]
    own_path: Mapping[int, str]
    opt_in: str
    decode_pad_default: int | None = None
    nvfp4_spellings: tuple[str, ...] = ()
    full_row_pow2: bool = False
    full_row_align: int = 64
    dspark_widens_window: bool = False

    def padded(self, heads: int, phase: str) -> int:
        """The q heads a ``phase`` call carries for ``heads`` heads a rank."""
        sizes = self.prefill_heads if phase == PREFILL else self.decode_heads
        if not sizes or heads in sizes:
            return heads
        if self.decode_pad_default is not None and phase == DECODE and heads < self.decode_pad_default:
            return self.decode_pad_default
        return next((size for size in sizes if size >= heads), heads)


LSE_BASES = ("e", "2")  # natural log, base 2: the bases an engine's merge may read a rank's LSE in


@dataclass(frozen=True)
class DcpFacts:
    """How one engine runs decode context parallelism (DCP) for sparse MLA, and what it refuses there.

    The engine shards the cache by token over ranks of its TP group, gathers the group's query heads for
    each call and merges the ranks' partial outputs by the LSE each returns; the plugin computes a rank's
    share (:mod:`mla_sm120_plugin.dispatch.dcp`). What the plan refuses under DCP is in
    :func:`mla_sm120_plugin.rules.dcp_refusals`, from these facts.

    :param flag: how the DCP size is set (vLLM's ``--decode-context-parallel-size``, SGLang's ``--dcp-size``).
    :param lse_base: the base the engine's merge reads a rank's LSE in (``"e"`` or ``"2"``): what the
        kernel is asked for, never converted after.
    :param interleave_flag: how the tokens a rank owns in a row are set (empty: one token at a time).
    :param merge_picks: the indexer's picks a row that the engine's DCP top-k merge ranks (vLLM: its
        CuteDSL merge of every rank's candidates); empty: no merge (the index cache is replicated).
    :param merge_note: what that merge runs on (a plan note under DCP).
    :param layouts_refused: cache layouts the engine refuses under DCP -> why.
    :param features: engine features (:attr:`~mla_sm120_plugin.types.SelectionContext.features`) the
        engine refuses under DCP only -> (its words, the fix); the plugin serves them without DCP.
    :param kpool_refused: why the engine refuses DCP for a pooled indexer (``index_kpool`` > 1) whatever
        the interleave (empty: a pooled key's tokens are kept on one rank by the interleave).
    :param sinks_note: what the engine itself does about a model with learned sinks under DCP (a plan note
        beside the plugin's one rule; empty: nothing to add).
    """

    flag: str
    lse_base: str
    interleave_flag: str = ""
    merge_picks: tuple[int, ...] = ()
    merge_note: str = ""
    layouts_refused: Mapping[str, str] = field(default_factory=dict)
    features: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    kpool_refused: str = ""
    sinks_note: str = ""

    def __post_init__(self) -> None:
        if self.lse_base not in LSE_BASES:
            raise ValueError(format_error(f"DcpFacts.lse_base={self.lse_base!r}", f"one of {LSE_BASES}",
                                          "say which base the engine's DCP merge reads"))

    @property
    def lse_base_on_e(self) -> bool:
        """:attr:`lse_base` as both engines' merges spell it (vLLM's ``lse_base_on_e``, SGLang's
        ``is_mla_dcp_lse_base_on_e``): natural log or not."""
        return self.lse_base == "e"


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
    :param feature_flags: engine feature (see :data:`mla_sm120_plugin.rules.FEATURE_REASONS`)
        -> how to switch it off.
    :param nope_layouts: the layout a ``--kv-cache-dtype`` gives a rope-less model instead (vLLM
        keeps fp8 rows 656 bytes wide, SGLang packs 528).
    :param no_writer: layouts the kernels read that this engine never writes -> why (a refusal's text).
    :param native_layout_notes: layout (a DSA layout or a DeepSeek-V4 record) -> where the engine's own
        backends read it (a device refusal's fix).
    :param pooled_ids_align: for a pooled indexer (``index_kpool`` > 1) the engine hands the kernels
        ``index_topk + kpool - 1`` token ids a row (each pick's tokens plus the partial tail),
        rounded up to a multiple of this.
    :param dsv4: how the engine shapes DeepSeek-V4's calls and names its record.
    :param sink_layout: the layout the engine gives a model with learned sinks under ``auto``, and
        the only one it accepts for one (SGLang: bf16); None: as for any model.
    :param sink_layout_refused: why the engine refuses another layout for a sink model.
    :param native_sink_backends: SM family -> the engine's own sparse-MLA path that applies sinks there.
    :param sink_note: what the engine does with a model's sinks on SM12x, without the plugin and with it.
    :param release: the engine release these facts are for (a key of :data:`RELEASES`).
    :param dist: the engine's distribution name (what ``pip`` installs, what the installed version is read from).
    :param install: how to install this release with the plugin (a fix names it).
    :param missing_architectures: model architectures this release does not build -> what to do
        instead (a refusal's fix).
    :param opt_in_every_layer: the opt-in gives every attention layer the plugin's backend (vLLM's
        ``--attention-backend``), so a dense MLA layer cannot be left to the engine's own backends.
    :param plain_fp8: what a plain ``fp8*`` ``--kv-cache-dtype`` means to this engine when it is not the
        DSA layout (``{kv}``: the value given), for the refusal's fix; empty: nothing to add.
    :param kernel_flags_by_family: model family -> (how its flags are named in messages, (plugin setting,
        the engine's argument naming a kernel for it) pairs): the engine's own flags that force a kernel per
        phase; a family absent here has none.
    :param dcp: how the engine runs decode context parallelism (:class:`DcpFacts`).
    :param call_lengths: the engine's DSA call hands the kernel per-row top-k lengths without DCP too
        (SGLang: its metadata's lengths where their rows match q's); False: only the ids, -1 padded (vLLM).
        The init self-check runs the call as the engine makes it.
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
    dsv4: Dsv4Calls
    dcp: DcpFacts
    native_backends: Mapping[int, str] = field(default_factory=dict)
    feature_flags: Mapping[str, str] = field(default_factory=dict)
    auto_fp8_from_sm: int | None = None
    scale_format: str | None = None
    nope_layouts: Mapping[str, str] = field(default_factory=dict)
    no_writer: Mapping[str, str] = field(default_factory=dict)
    native_layout_notes: Mapping[str, str] = field(default_factory=dict)
    pooled_ids_align: int = 1
    sink_layout: str | None = None
    sink_layout_refused: str = ""
    native_sink_backends: Mapping[int, str] = field(default_factory=dict)
    sink_note: str = ""
    release: str = ""
    dist: str = ""
    install: str = ""
    missing_architectures: Mapping[str, str] = field(default_factory=dict)
    opt_in_every_layer: bool = False
    plain_fp8: str = ""
    kernel_flags_by_family: Mapping[str, tuple[str, tuple[tuple[str, str], ...]]] = field(default_factory=dict)
    call_lengths: bool = False

    @property
    def versioned(self) -> str:
        """The engine and its release, as messages name them (``vLLM 0.34.0``)."""
        return f"{self.label} {self.release}"

    def kv_layout(self, value: str | None, sm_family: int | None, rope: int = ROPE_DIM, sinks: bool = False) -> str:
        """The layout ``--kv-cache-dtype value`` gives a DSA model with a ``rope``-wide rope part on a
        GPU of ``sm_family`` (``sinks``: a model with learned sinks)."""
        if value is None or str(value) == "auto":
            fp8 = self.auto_fp8_from_sm is not None and sm_family is not None and sm_family >= self.auto_fp8_from_sm
            base = FP8_DS_MLA if fp8 else BF16
            if sinks and self.sink_layout is not None:
                base = self.sink_layout
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

    def own_dsv4_path(self, sm_family: int | None) -> str:
        """The engine's own DeepSeek-V4 attention on ``sm_family``."""
        return self.dsv4.own_path.get(sm_family, f"{self.label}'s own DeepSeek-V4 attention")


_SHARED_SPELLINGS: Mapping[str, str] = {BF16: BF16, "bfloat16": BF16}
# Sparse-MLA architectures vLLM 0.34 added (and the Mistral Large 4 DSpark draft beside them).
_NEW_IN_VLLM_034 = ("KimiK31ForConditionalGeneration", "MistralLarge4ForCausalLM", "MistralLarge4DSparkModel")
_VLLM_034_MODELS = ('vLLM 0.34.0 is the first vLLM that builds it: pip install "mla-sm120-plugin[vllm034]", or plan '
                    "with --engine-version 0.34.0")

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
    dsv4=Dsv4Calls(
        # _resolve_dsv4_kv_cache_dtype: auto and every fp8* spelling become fp8_ds_mla (the 584-byte record).
        kv_spellings=("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"),
        kv_refused={"bfloat16": "vLLM's DeepSeek-V4 layer raises at model build: the packed layout only supports fp8",
                    "bf16": "vLLM's DeepSeek-V4 layer raises at model build: the packed layout only supports fp8"},
        # vLLM's own name for an NVFP4 MLA cache: its parser and config take it for MLA models; its
        # DeepSeek-V4 layer refuses it (_resolve_dsv4_kv_cache_dtype) unless the plugin's layer class
        # answers first, which it does with --attention-backend CUSTOM.
        nvfp4_spellings=(NVFP4_DS_MLA,),
        window_page={"v4": 64, "v4.1": 32},  # DeepseekV4SWACache's block; V4.1's 32
        call_window_page={"v4": 64, "v4.1": 32},
        compressed_page_tokens={"v4": 256, "v4.1": 128},  # the backends' kernel block sizes
        decode_heads=(8, 16, 32, 64, 128),  # _pad_to_supported_q_heads, both phases
        prefill_heads=(8, 16, 32, 64, 128),
        # C128A rows: a power of two >= max_seq_len // 128, a multiple of 128
        full_row_pow2=True,
        full_row_align=128,
        dspark_widens_window=True,
        own_path={9: "FLASHMLA_SPARSE_DSV4 (FlashMLA)", 10: "FLASHMLA_SPARSE_DSV4 or FLASHINFER_MLA_SPARSE_DSV4",
                  12: "DeepseekV4FlashInferSM120Attention (FlashInfer's SM120 DeepSeek-V4 kernels, JIT-built)"},
        opt_in=("vLLM: --attention-backend CUSTOM makes every DeepSeek-V4 layer the plugin's subclass of vLLM's SM120 "
                "class, planned as above while the model is built (before weights): each (layer kind, phase) runs the "
                "kernel named here, after its self-check; without it vLLM builds its own class (FlashInfer's kernels "
                "only)"),
    ),
    native_backends={
        9: "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90",
        10: "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE",
    },
    feature_flags={
        "hisparse": "drop the HiSparse attention config (attention_config.hisparse_config)",
        "pcp": "set --prefill-context-parallel-size 1",
    },
    dcp=DcpFacts(
        flag="--decode-context-parallel-size",
        # The merge reads the impl's lse_base_on_e, which the plugin's impl declares from this fact.
        lse_base="e",
        interleave_flag="--cp-kv-cache-interleave-size",
        # sparse_attn_indexer._merge_dcp_topk_global: each rank scores its own shard of the index cache and
        # the exact global top-k is picked from every rank's candidates, by CuteDSL only (no torch path).
        merge_picks=(512, 1024, 2048),
        merge_note=("vLLM merges the ranks' index top-k with its CuteDSL kernel (_merge_dcp_topk_global; "
                    "nvidia-cutlass-dsl, a vLLM dependency; no SM gate in its code, not yet run on an SM12x GPU by "
                    "this project)"),
    ),
    call_lengths=False,  # forward_mqa hands the kernels global slots alone (-1 padded) without DCP
    nope_layouts={FP8_DS_MLA: FP8_DS_MLA_NOPE, BF16: BF16_NOPE},
    # vLLM 0.33 writes nvfp4_ds_mla in its DSA models' fused_norm_rope only (DeepSeek-V3.2 geometry);
    # its own reader, FLASHMLA_SPARSE, refuses it off SM100.
    no_writer={NVFP4_DS_MLA + "@rope0": "vLLM writes nvfp4_ds_mla only for the DSA geometry (512 latent + 64 rope: "
               "the DSA models' fused_norm_rope writer); a rope-less model (GLM-5.3-Flash) has no nvfp4 writer"},
    native_layout_notes={NVFP4_DS_MLA: "vLLM's own FLASHMLA_SPARSE reads nvfp4_ds_mla on SM100 only; elsewhere pass "
                         f"--kv-cache-dtype {FP8_DS_MLA}",
                         NVFP4_DSV4: f"with --kv-cache-dtype {FP8_DS_MLA}: no engine has an NVFP4 DeepSeek-V4 cache "
                         "there (FlashInfer's 384-byte record is SM120/SM121 only)"},
    pooled_ids_align=128,  # the kpool indexer's buffer: round_up(2048 + 3, 128) = 2176 for GLM-5.3-Flash
    # HYV4MLAAttention._resolve_sink_backend keeps the selected backend if it supports_sink(), else
    # tries its FLASHMLA_SPARSE sink subclass (SM90 / SM100 only), else loads the sink and disables it.
    native_sink_backends={9: "HY V4's own FLASHMLA_SPARSE sink backend (vLLM picks it without --attention-backend)",
                          10: "HY V4's own FLASHMLA_SPARSE sink backend (vLLM picks it without --attention-backend)"},
    sink_note=("without --attention-backend CUSTOM vLLM runs this model on SM12x with the sink disabled "
               "(its sink path, FLASHMLA_SPARSE, is SM90/SM100 only; 'the sink bias is disabled' in its log); with "
               "it the plugin's backend answers supports_sink(), vLLM hands it the sink weights and every phase's "
               "kernel applies them"),
    release="0.33.0",
    dist="vllm",
    install='pip install "mla-sm120-plugin[vllm]" (vLLM 0.33.0)',
    opt_in_every_layer=True,
    # vLLM canonicalises fp8 -> fp8_ds_mla only for its own backends, by name.
    plain_fp8=("plain {kv} is not rewritten for a plugin backend (SGLang's fp8_e4m3 is that layout: plan for SGLang "
               "with mla-sm120 check --engine sglang)"),
    missing_architectures={arch: _VLLM_034_MODELS for arch in _NEW_IN_VLLM_034},
)

# vLLM 0.34.0: what moved for the plugin (docs/facts.md, vLLM 0.34). V4.1's compressed backends force a
# 64-entry kernel block on SM12x (vllm#59203, was 128); Kimi K3.1 and Mistral Large 4 are new sparse-MLA
# models built through the generic sparse-MLA layer.
VLLM_034 = dataclasses.replace(
    VLLM,
    # MLAAttention sizes fp8_ds_mla rows by the impl's get_fp8_ds_mla_row_bytes(): vLLM's own SM120 impl
    # answers 528 for a rope-less model (its writer fills the packed row), and so does the plugin's.
    nope_layouts={FP8_DS_MLA: FP8_NOPE, BF16: BF16_NOPE},
    dsv4=dataclasses.replace(VLLM.dsv4, compressed_page_tokens={"v4": 256, "v4.1": 64}),
    release="0.34.0",
    dcp=dataclasses.replace(VLLM.dcp, layouts_refused={
        NVFP4_DS_MLA: "vLLM 0.34.0 refuses it at config (validate_nvfp4_kv_cache_with_mla: its chunked-context "
                      "prefill gather is not validated under DCP)"}),
    install='pip install "mla-sm120-plugin[vllm034]" (vLLM 0.34.0; where the index lacks flashinfer-python 0.7.3, '
            "uv pip install ... --override .ci/vllm034-overrides.txt)",
    missing_architectures={},
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
    dsv4=Dsv4Calls(
        kv_spellings=("auto", "fp8_e4m3"),
        kv_refused={"bfloat16": "SGLang 0.5.23's paged DeepSeek-V4 pool stores uint8 records only (an assert at pool "
                                "creation)",
                    "bf16": "SGLang 0.5.23 refuses it for DeepseekV4ForCausalLM (only fp8_e4m3 or bfloat16)",
                    "nvfp4": "SGLang 0.5.23 refuses it for DeepseekV4ForCausalLM (its NVFP4 recipe, sglang#38646, is "
                             "an open pull request)"},
        window_page={"v4": 64, "v4.1": 64},  # 256-token pages, copied into 64-entry pages for FlashInfer
        call_window_page={"v4": 256, "v4.1": 256},  # what flash_mla_with_kvcache_sm120 is handed
        compressed_page_tokens={"v4": 256, "v4.1": 256},  # page_size 256, forced by the model override
        decode_heads=(8, 16, 32, 64, 128),  # the counts FlashInfer 0.7.2 lists; else padded to 64
        prefill_heads=(),  # prefill drops the pad: the rank's own heads
        decode_pad_default=64,
        full_row_align=64,  # SGLang pads index rows to multiples of 64
        own_path={9: "--attention-backend dsv4 (FlashMLA)", 10: "--attention-backend dsv4 (FlashMLA / TRT-LLM)",
                  12: "flash_mla_with_kvcache_sm120 (FlashInfer's SM120 kernels, SGLANG_SM120_FLASHMLA_BACKEND)"},
        opt_in=("SGLang: --mla-sm120 plans and refuses at launch (after SGLang forces --attention-backend dsv4 and "
                "256-token pages); each scheduler binds the kernels named here and self-checks them when SGLang builds "
                "its DeepSeek-V4 backend, and routes every flash_mla_with_kvcache_sm120 call to the kernel for its "
                "(layer kind, phase): SGLang's own FlashInfer call, or the plugin's Triton kernel on the same "
                "arguments; without it SGLang runs its own path"),
    ),
    native_backends={
        9: "--dsa-*-backend flashmla_sparse / flashmla_kv",
        10: "--dsa-*-backend flashmla_sparse / flashmla_kv / trtllm",
    },
    feature_flags={
        "hisparse": "drop --enable-hisparse",
        "skip_softmax": "unset SGLANG_SKIP_SOFTMAX_PREFILL/DECODE_THRESHOLD_SCALE_FACTOR",
    },
    # SGLang's DSA DCP (arg_groups/model_overrides/deepseek_v2.py, _dsa_dcp_overrides): slot % dcp owns a token,
    # one token at a time (no interleave flag); the indexer's cache is replicated, so no top-k merge.
    dcp=DcpFacts(
        flag="--dcp-size",
        # is_mla_dcp_lse_base_on_e("dsa") is False: its merges read base 2 (checked against SGLang at the call).
        lse_base="2",
        merge_note=("SGLang merges the ranks' partial outputs by their base-2 LSE (cp_lse_ag_out_rs_mla, or "
                    "dcp_a2a_lse_reduce under --dcp-comm-backend a2a); its indexer cache is replicated, so every "
                    "rank picks the same top-k; with --mla-sm120 the DSA backends are the plugin's, not trtllm "
                    "(which SGLang forces under --dcp-size > 1 and which does not run on SM12x)"),
        features={
            "hicache": ("SGLang 0.5.23 refuses it: 'DSA DCP does not support HiSparse or HiCache.'",
                        "drop --enable-hierarchical-cache"),
            "pd_disaggregation": ("SGLang 0.5.23 refuses it: 'DSA DCP does not support PD disaggregation.'",
                                  "serve without --disaggregation-mode"),
            "eagle_topk": ("SGLang 0.5.23 refuses it: 'DSA DCP requires --speculative-eagle-topk 1.'",
                           "pass --speculative-eagle-topk 1"),
        },
        kpool_refused=("SGLang 0.5.23 refuses it: 'a pooled index key spans positions owned by different DCP "
                       "ranks' (it shards the cache one token at a time)"),
        # SGLang alone refuses HY V4 under DCP (no single owner for the sinks); the plugin lifts that refusal.
        sinks_note="SGLang alone refuses --dcp-size > 1 for HY V4 (no single owner of a sink); --mla-sm120 lifts it",
    ),
    call_lengths=True,  # flashinfer_sparse_mla_forward's seq_lens: per-row top-k lengths where rows match q's
    # _dsa_kv_cache_dtype_default: auto -> fp8_e4m3 for DSA models on SM >= 10 (no learnable sinks).
    auto_fp8_from_sm=10,
    scale_format=SCALE_ARBITRARY,  # its DSA cache writer stores amax/448 for every model
    nope_layouts={FP8_DS_MLA: FP8_NOPE, BF16: BF16_NOPE},
    native_layout_notes={NVFP4_DSV4: "with --kv-cache-dtype fp8_e4m3: no engine has an NVFP4 DeepSeek-V4 cache there "
                         "(FlashInfer's 384-byte record is SM120/SM121 only)"},
    no_writer={NVFP4_DS_MLA: "SGLang 0.5.23 has no nvfp4_ds_mla cache writer (its DSA pool writes fp8_e4m3 "
               "or bf16 rows; only vLLM's DSA writer fills the 352-byte nvfp4 rows)"},
    pooled_ids_align=1,  # 2048 + 3 = 2051 ids for GLM-5.3-Flash
    # _dsa_kv_cache_dtype_default: learnable sinks force a bfloat16 cache (auto) and refuse fp8.
    sink_layout=BF16,
    sink_layout_refused="SGLang 0.5.23 refuses it for a model with learnable DSA attention sinks (a ValueError at "
                        "launch: 'Learnable DSA attention sinks require a bfloat16 KV cache')",
    native_sink_backends={9: "--dsa-*-backend flashmla_sparse (SGLang forces it for sink models)",
                          10: "--dsa-*-backend flashmla_sparse (SGLang forces it for sink models)"},
    sink_note=("SGLang 0.5.23 serves learnable sinks only with flashmla_sparse (SM90a / SM100f) and a bfloat16 "
               "cache, so on SM12x its own path has no kernel for this model; with --mla-sm120 every forward's "
               "attn_sink goes to the plugin's kernel for its phase"),
    # --dsa-prefill-backend / --dsa-decode-backend name DSA's impls (the plugin's kernel names are SGLang's:
    # flashinfer_sparse_mla, triton_sparse_mla); SGLang's DeepSeek-V4 path reads none.
    kernel_flags_by_family={"dsa": ("--dsa-*-backend", (("prefill_kernel", "dsa_prefill_backend"),
                                                        ("decode_kernel", "dsa_decode_backend")))},
    release="0.5.23",
    dist="sglang",
    install='pip install "mla-sm120-plugin[sglang]" (SGLang 0.5.23)',
    missing_architectures={arch: "SGLang 0.5.23 has no such model: serve it with vLLM 0.34.0 (--engine vllm)"
                           for arch in _NEW_IN_VLLM_034},
)

# Every engine release the plugin supports, oldest first.
RELEASES: Mapping[str, Mapping[str, Engine]] = {
    "vllm": {VLLM.release: VLLM, VLLM_034.release: VLLM_034},
    "sglang": {SGLANG.release: SGLANG},
}
# Each engine at its oldest supported release: the facts a context that names no release reads (the
# vocabulary, flags and spellings every release of an engine shares).
ENGINES: Mapping[str, Engine] = {name: next(iter(releases.values())) for name, releases in RELEASES.items()}


@functools.cache
def installed_release(name: str) -> str | None:
    """The release of engine ``name`` installed in this environment (read from its distribution's
    metadata once a process: nothing is imported), or None."""
    try:
        return importlib.metadata.version(ENGINES[name].dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def release_refusal(name: str, release: str | None, first_fix: str | None = None) -> str | None:
    """Why ``release`` of engine ``name`` is not served (given / supported / fix, one a line), or None
    when it is; ``first_fix``: a fix to offer before installing a supported release."""
    releases = RELEASES[name]
    if release in releases:
        return None
    label = ENGINES[name].label
    fixes = [*filter(None, [first_fix]), *(engine.install for engine in releases.values())]
    return format_error(f"{label} {release}" if release else f"no {label} installed",
                        f"{label} " + " or ".join(releases) + " (the releases the plugin's hooks were read from)",
                        "; or ".join(fixes))


def lookup(name: str, release: str | None = None) -> Engine:
    """Engine ``name`` at ``release`` (None: its oldest supported release, :data:`ENGINES`).

    :raises UnsupportedConfiguration: a release the plugin does not support (given / supported / fix).
    """
    if release is None:
        return ENGINES[name]
    refusal = release_refusal(name, release)
    if refusal is not None:
        raise UnsupportedConfiguration(refusal)
    return RELEASES[name][release]


def for_context(ctx: SelectionContext) -> Engine:
    """The facts of the engine and release a selection context was built for (the one door the decision
    and report code read them through)."""
    return lookup(ctx.engine, ctx.release)


def others(engine: Engine) -> tuple[Engine, ...]:
    """Every other engine, at its oldest supported release (their shared vocabulary: spellings, flags)."""
    return tuple(other for other in ENGINES.values() if other.name != engine.name)
