"""DeepSeek-V4 deployments, planned per layer kind and phase before any weight loads.

A DeepSeek-V4 layer is one of a few kinds (FACTS §14): the sliding window alone (the draft layers,
V4's window-only layers), or the window plus a compressed cache (V4: C4A, the indexer's top-k of
4-token entries, and C128A, every 128-token entry; V4.1: ratios 1 and 2). Each kind makes its own
attention call in each phase, with its own widths, page sizes and q heads, and each engine shapes
those calls its own way (vLLM pads q heads to 8/16/32/64/128 and reads 64-entry window pages;
SGLang uses 256-token pages everywhere, copies window pages into 64-entry ones for FlashInfer and
pads decode q to 64 heads unless FlashInfer lists the rank's count).

:func:`plan` turns a model's facts, the engine and its settings into one
:class:`~mla_sm120_plugin.types.Dsv4Call` per layer kind and decides each with the same constraint
matrix as the DSA models (:func:`mla_sm120_plugin.selection.select`, the context's ``dsv4`` set):
kernels registered for the DeepSeek-V4 record, their envelopes and probes, the plugin config's
forced kernels and precision. It returns a :class:`Dsv4Plan`, or raises one
:class:`~mla_sm120_plugin.errors.UnsupportedConfiguration` naming every layer kind that cannot be
served (given / supported / fix). Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import config as config_mod
from .context import EngineLimits, build_context
from .errors import UnsupportedConfiguration, format_error
from .hooks.manager import Registry, get_registry
from .kernels.dsv4.layout import FP8_DSV4, FP8_RECORD, NVFP4_DSV4, NVFP4_RECORD, RECORDS, Dsv4Record
from .modelinfo import Dsv4Geometry, ModelFacts
from .selection import decision_to_dict, explain
from .selection import select as select_kernels
from .types import DECODE, PHASES, PREFILL, Decision, DeviceInfo, Dsv4Call, Refusal

WINDOW = "window"
GIB = 1 << 30


def kind_name(ratio: int) -> str:
    """``"window"`` for a window-only layer, ``"c<ratio>a"`` for a compressed one."""
    return WINDOW if ratio == 0 else f"c{ratio}a"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Dsv4Engine:
    """How one engine shapes DeepSeek-V4 attention calls on SM12x, and what it calls things.

    :param name: the engine key (``"vllm"``, ``"sglang"``).
    :param label: how messages name it.
    :param kv_spellings: ``--kv-cache-dtype`` values that give the 584-byte record.
    :param nvfp4_spellings: values that give the 384-byte NVFP4 record with the plugin's opt-in.
    :param kv_refused: values the engine itself refuses for DeepSeek-V4, and how it fails.
    :param window_page: model version -> entries a window-cache page holds, as the kernel sees it.
    :param compressed_page_tokens: model version -> tokens a compressed-cache page covers.
    :param decode_heads: q head counts a decode call is padded up to (the smallest that fits).
    :param prefill_heads: the same for prefill; empty: the rank's own count.
    :param decode_pad_default: SGLang pads decode q to this unless the rank's count is listed.
    :param own_path: SM family -> the engine's own DeepSeek-V4 attention there.
    :param opt_in: what switching the plugin on does for DeepSeek-V4 in this engine today.
    """

    name: str
    label: str
    kv_spellings: tuple[str, ...]
    kv_refused: Mapping[str, str]
    window_page: Mapping[str, int]
    compressed_page_tokens: Mapping[str, int]
    decode_heads: tuple[int, ...]
    prefill_heads: tuple[int, ...]
    own_path: Mapping[int, str]
    opt_in: str
    decode_pad_default: int | None = None
    nvfp4_spellings: tuple[str, ...] = ()

    def padded(self, heads: int, phase: str) -> int:
        """The q heads a ``phase`` call carries for ``heads`` heads a rank."""
        sizes = self.prefill_heads if phase == PREFILL else self.decode_heads
        if not sizes or heads in sizes:
            return heads
        if self.decode_pad_default is not None and phase == DECODE and heads < self.decode_pad_default:
            return self.decode_pad_default
        return next((size for size in sizes if size >= heads), heads)


VLLM = Dsv4Engine(
    name="vllm",
    label="vLLM",
    # _resolve_dsv4_kv_cache_dtype: auto and every fp8* spelling become fp8_ds_mla (the 584-byte record).
    kv_spellings=("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"),
    kv_refused={"bfloat16": "vLLM's DeepSeek-V4 layer raises at model build: the packed layout only supports fp8",
                "bf16": "vLLM's DeepSeek-V4 layer raises at model build: the packed layout only supports fp8"},
    # vLLM's own name for an NVFP4 MLA cache: its parser and config take it for MLA models; its
    # DeepSeek-V4 layer refuses it (_resolve_dsv4_kv_cache_dtype) unless the plugin's layer class
    # answers first, which it does with --attention-backend CUSTOM.
    nvfp4_spellings=("nvfp4_ds_mla",),
    window_page={"v4": 64, "v4.1": 32},  # DeepseekV4SWACache's block; V4.1's 32
    compressed_page_tokens={"v4": 256, "v4.1": 128},  # the backends' kernel block sizes
    decode_heads=(8, 16, 32, 64, 128),  # _pad_to_supported_q_heads, both phases
    prefill_heads=(8, 16, 32, 64, 128),
    own_path={9: "FLASHMLA_SPARSE_DSV4 (FlashMLA)", 10: "FLASHMLA_SPARSE_DSV4 or FLASHINFER_MLA_SPARSE_DSV4",
              12: "DeepseekV4FlashInferSM120Attention (FlashInfer's SM120 DeepSeek-V4 kernels, JIT-built)"},
    opt_in=("vLLM: --attention-backend CUSTOM makes every DeepSeek-V4 layer the plugin's subclass of vLLM's SM120 "
            "class, planned as above while the model is built (before weights): each (layer kind, phase) runs the "
            "kernel named here, after its self-check; without it vLLM builds its own class (FlashInfer's kernels "
            "only)"),
)

SGLANG = Dsv4Engine(
    name="sglang",
    label="SGLang",
    kv_spellings=("auto", "fp8_e4m3"),
    kv_refused={"bfloat16": "SGLang 0.5.23's paged DeepSeek-V4 pool stores uint8 records only (an assert at pool "
                            "creation)",
                "bf16": "SGLang 0.5.23 refuses it for DeepseekV4ForCausalLM (only fp8_e4m3 or bfloat16)",
                "nvfp4": "SGLang 0.5.23 refuses it for DeepseekV4ForCausalLM (its NVFP4 recipe, sglang#38646, is "
                         "an open pull request)"},
    window_page={"v4": 64, "v4.1": 64},  # 256-token pages, copied into 64-entry pages for FlashInfer
    compressed_page_tokens={"v4": 256, "v4.1": 256},  # page_size 256, forced by the model override
    decode_heads=(8, 16, 32, 64, 128),  # the counts FlashInfer 0.7.2 lists; else padded to 64
    prefill_heads=(),  # prefill drops the pad: the rank's own heads
    decode_pad_default=64,
    own_path={9: "--attention-backend dsv4 (FlashMLA)", 10: "--attention-backend dsv4 (FlashMLA / TRT-LLM)",
              12: "flash_mla_with_kvcache_sm120 (FlashInfer's SM120 kernels, SGLANG_SM120_FLASHMLA_BACKEND)"},
    opt_in=("SGLang 0.5.23 forces --attention-backend dsv4 and page 256 for DeepSeek-V4 and calls "
            "flash_mla_with_kvcache_sm120 on SM12x; --mla-sm120 plans and refuses at launch and binds nothing "
            "into that call yet"),
)

ENGINES: Mapping[str, Dsv4Engine] = {e.name: e for e in (VLLM, SGLANG)}


def _extra_width(engine: Dsv4Engine, geometry: Dsv4Geometry, ratio: int, index_topk: int) -> int:
    """Compressed slots a query row holds for a ``ratio`` layer."""
    if ratio == 0:
        return 0
    if geometry.version == "v4" and ratio == 128:
        entries = _cdiv(geometry.max_model_len, ratio)  # C128A attends every entry
        if engine.name == "vllm":  # a power of two >= max_seq_len // 128, a multiple of 128
            return max(_pow2_at_least(entries), 128)
        return _cdiv(entries, 64) * 64  # SGLang pads index rows to multiples of 64
    return index_topk


def _window_widths(engine: Dsv4Engine, geometry: Dsv4Geometry, speculative_tokens: int,
                   dspark: bool) -> tuple[int, int]:
    """(decode, prefill) window slots a query row holds."""
    window = geometry.sliding_window
    decode = window
    if dspark and engine.name == "vllm" and speculative_tokens:
        decode = _cdiv(window + speculative_tokens, 64) * 64  # get_dspark_swa_index_width
    return decode, window + geometry.vision_tokens


def layer_calls(facts: ModelFacts, engine: str, tensor_parallel_size: int, *, speculative_tokens: int = 0,
                dspark: bool = False) -> list[Dsv4Call]:
    """One :class:`Dsv4Call` per layer kind of ``facts`` under ``engine`` at this TP size.

    :raises UnsupportedConfiguration: the TP size does not divide the heads.
    """
    geometry = facts.dsv4
    if geometry is None:
        raise UnsupportedConfiguration(format_error(f"{facts.name} ({facts.arch}) is not a DeepSeek-V4 model",
                                                    "DeepSeek-V4, V4-Pro, V4.1 and their drafts",
                                                    "plan a DSA model with mla-sm120 check (no layer kinds)"))
    rules = ENGINES[engine]
    heads = facts.heads_per_rank(tensor_parallel_size)
    decode_window, prefill_window = _window_widths(rules, geometry, speculative_tokens, dspark)
    calls = []
    for ratio, layers in geometry.layer_counts().items():
        extra_page = rules.compressed_page_tokens[geometry.version] // ratio if ratio else 0
        calls.append(Dsv4Call(
            kind=kind_name(ratio), compress_ratio=ratio, layers=layers,
            window=decode_window, prefill_window=prefill_window, window_page=rules.window_page[geometry.version],
            extra=_extra_width(rules, geometry, ratio, facts.index_topk), extra_page=extra_page,
            decode_heads=rules.padded(heads, DECODE), prefill_heads=rules.padded(heads, PREFILL)))
    return calls


@dataclass(frozen=True)
class Dsv4Plan:
    """A DeepSeek-V4 deployment decided per layer kind.

    :param facts: the model.
    :param engine: the engine key.
    :param device: the device planned for.
    :param tensor_parallel_size: ranks the heads are split over.
    :param decisions: layer kind -> the :class:`~mla_sm120_plugin.types.Decision` for its call.
    :param notes: what is worth a line beside the table (layer counts from a profile, probes).
    :param record: the cache record (:data:`~mla_sm120_plugin.kernels.dsv4.layout.RECORDS` key).
    """

    facts: ModelFacts
    engine: str
    device: DeviceInfo
    tensor_parallel_size: int
    decisions: Mapping[str, Decision]
    notes: tuple[str, ...] = field(default=())
    record: str = FP8_DSV4

    @property
    def kv_record(self) -> Dsv4Record:
        """The cache record every layer of the plan reads and writes."""
        return RECORDS[self.record]

    def log_line(self) -> str:
        """The one line an engine logs at launch: the model, the device and each kind's kernels."""
        kinds = "; ".join(
            f"{kind} x{d.context.dsv4.layers if d.context.dsv4 else '?'}: prefill={d.prefill} decode={d.decode}"
            for kind, d in self.decisions.items())
        return (f"mla_sm120: DeepSeek-V4 plan for {self.facts.name} ({self.facts.arch}) on {self.device.describe()}, "
                f"{ENGINES[self.engine].label} tp={self.tensor_parallel_size}, kv {self.record}: {kinds}")

    def kernels(self) -> dict[tuple[str, str], str]:
        """(layer kind, phase) -> the kernel that serves it."""
        return {(kind, phase): d.kernels[phase] for kind, d in self.decisions.items() for phase in PHASES}


def _kv_record(engine: Dsv4Engine, kv_cache_dtype: str | None, facts: ModelFacts, device: DeviceInfo,
               dspark: bool) -> str:
    spelled = "auto" if kv_cache_dtype is None else str(kv_cache_dtype)
    if spelled in engine.kv_spellings:
        return FP8_DSV4
    geometry = facts.dsv4
    assert geometry is not None
    if spelled in engine.nvfp4_spellings:
        why = None
        if geometry.version != "v4":
            why = (f"{engine.label}'s {spelled} for DeepSeek-V4.1 is SM100's record pair (an MXFP8 window record and "
                   "an NVFP4 compressed one), not FlashInfer's 384-byte record, which the plugin writes for V4 layers "
                   "only")
        elif dspark:
            why = (f"{engine.label}'s DSpark draft writes its window rows with its own fp8 insert, which the plugin's "
                   "NVFP4 writers do not replace")
        if why is None:
            return NVFP4_DSV4
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, kv_cache_dtype={spelled}: {why}",
            f"the {NVFP4_RECORD.token_bytes}-byte NVFP4 record for DeepSeek-V4 (V4-Flash, V4-Pro) with a causal "
            "or MTP draft; the 584-byte fp8 record everywhere",
            f"pass --kv-cache-dtype {engine.kv_spellings[-1]}"))
    if spelled in nvfp4_spellings_elsewhere(engine):
        why = engine.kv_refused.get(spelled, f"{engine.label} has no NVFP4 DeepSeek-V4 cache (the plugin writes the "
                                    f"{NVFP4_RECORD.token_bytes}-byte record in vLLM's layers only)")
    else:
        why = engine.kv_refused.get(spelled, f"{engine.label} has no DeepSeek-V4 cache of that name")
    raise UnsupportedConfiguration(format_error(
        f"model_arch={facts.arch}, sm={device.sm}, kv_cache_dtype={spelled}: {why}",
        f"the 584-byte fp8 DeepSeek-V4 record: --kv-cache-dtype {' / '.join(engine.kv_spellings)}"
        + (f"; the {NVFP4_RECORD.token_bytes}-byte NVFP4 record: --kv-cache-dtype {' / '.join(engine.nvfp4_spellings)}"
           if engine.nvfp4_spellings else ""),
        f"pass --kv-cache-dtype {engine.kv_spellings[-1]} (or leave it auto)"))


def nvfp4_spellings_elsewhere(engine: Dsv4Engine) -> tuple[str, ...]:
    """NVFP4 spellings another engine takes (so this one's refusal says NVFP4, not 'no such cache')."""
    return tuple(s for other in ENGINES.values() if other is not engine for s in other.nvfp4_spellings)


def _tp_refusal(facts: ModelFacts, tp: int, device: DeviceInfo) -> None:
    geometry = facts.dsv4
    assert geometry is not None  # layer_calls checked it
    if tp > geometry.o_groups:
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, sm={device.sm}, tensor_parallel_size={tp}: {facts.name} has "
            f"{geometry.o_groups} output-projection groups (o_groups), so a rank would hold none "
            "(the engines' o_groups // tp)",
            f"tensor_parallel_size <= {geometry.o_groups} (a divisor of {facts.num_heads} heads)",
            f"use --tensor-parallel-size {max(t for t in (1, 2, 4, 8, 16) if t <= geometry.o_groups)} "
            "(and data or pipeline parallelism for more GPUs)"))
    if facts.num_heads // tp > max(VLLM.decode_heads):
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, tensor_parallel_size={tp}: {facts.num_heads // tp} heads a rank",
            f"at most {max(VLLM.decode_heads)} heads a rank (the engines' and FlashInfer's SM120 limit)",
            f"use --tensor-parallel-size {_cdiv(facts.num_heads, max(VLLM.decode_heads))} or more"))


def plan(
    facts: ModelFacts,
    settings: config_mod.Settings,
    device: DeviceInfo,
    kv_cache_dtype: str | None,
    limits: EngineLimits,
    *,
    speculative_tokens: int = 0,
    dspark: bool = False,
    registry: Registry | None = None,
) -> Dsv4Plan:
    """Decide every (layer kind, phase) of a DeepSeek-V4 deployment.

    :param facts: the model (:func:`mla_sm120_plugin.modelinfo.resolve_model`; ``facts.dsv4`` set).
    :param settings: the plugin settings for this model (forced kernels, precision).
    :param device: the device planned for.
    :param kv_cache_dtype: the engine's ``--kv-cache-dtype`` as the user wrote it (None: auto).
    :param limits: the engine's TP size, call-size bounds and CUDA-graph setting.
    :param speculative_tokens: draft tokens a step (vLLM's DSpark widens decode window rows).
    :param dspark: the draft is DSpark (non-causal window rows).
    :param registry: the plugin registry; the process-wide one by default.
    :returns: the plan, one decision per layer kind.
    :raises UnsupportedConfiguration: the TP size, the KV dtype or the device cannot be served, or
        some (layer kind, phase) has no kernel: every such kind in one message.
    """
    reg = registry if registry is not None else get_registry()
    engine = ENGINES[limits.engine]
    calls = layer_calls(facts, limits.engine, limits.tensor_parallel_size, speculative_tokens=speculative_tokens,
                        dspark=dspark)
    refusal = device_refusal(device, limits.engine)
    if refusal is not None:
        given, fix = f"model_arch={facts.arch}, {refusal.reason}", refusal.fix
        if str(kv_cache_dtype) in engine.nvfp4_spellings + nvfp4_spellings_elsewhere(engine):
            given = f"model_arch={facts.arch}, kv_cache_dtype={kv_cache_dtype}, {refusal.reason}"
            fix += (f", with --kv-cache-dtype {engine.kv_spellings[-1]}: no engine has an NVFP4 DeepSeek-V4 cache "
                    "there (FlashInfer's 384-byte record is SM120/SM121 only)")
        raise UnsupportedConfiguration(format_error(given, refusal.supported, fix))
    _tp_refusal(facts, limits.tensor_parallel_size, device)
    record = _kv_record(engine, kv_cache_dtype, facts, device, dspark)
    base = build_context(facts, settings, device, None, limits)
    decisions: dict[str, Decision] = {}
    problems: list[str] = []
    for call in calls:
        ctx = dataclasses.replace(base, kv_cache_dtype=record, kv_cache_dtype_given=kv_cache_dtype,
                                  index_topk=facts.index_topk, dsv4=call)
        try:
            decisions[call.kind] = select_kernels(ctx, registry=reg)
        except UnsupportedConfiguration as error:
            problems.append(str(error).replace(f", layer kind {call.kind}", "", 1))
    if problems:
        raise UnsupportedConfiguration(_merged(problems, calls))
    notes = [note for d in decisions.values() for note in d.notes]
    assert facts.dsv4 is not None
    if not facts.dsv4.layers_known:
        notes.append(f"{facts.name}: a built-in profile lists each layer kind the model has; the layer counts are "
                     "not the model's (its config.json has its per-layer list: pass that for the counts)")
    notes.append(engine.opt_in)
    if record == NVFP4_DSV4:
        notes.append(f"{NVFP4_RECORD.token_bytes}-byte NVFP4 record: the plugin's layer class writes it (window rows "
                     "and the compressor's rows, its Triton writer) and sizes vLLM's cache specs at "
                     f"{NVFP4_RECORD.token_bytes} bytes an entry; FlashInfer's fused NVFP4 writers are not bound")
    return Dsv4Plan(facts=facts, engine=limits.engine, device=device, tensor_parallel_size=limits.tensor_parallel_size,
                    decisions=decisions, notes=tuple(dict.fromkeys(notes)), record=record)


def _merged(problems: list[str], calls: list[Dsv4Call]) -> str:
    """One message: a refusal every layer kind shares is said once, naming the kinds."""
    by_text: dict[str, list[str]] = {}
    for text, call in zip(problems, calls):
        by_text.setdefault(text, []).append(f"{call.kind} ({call.layers} layer{'s' if call.layers != 1 else ''})")
    return "\n".join(f"layer kinds {', '.join(kinds)}:\n{text}" for text, kinds in by_text.items())


def device_refusal(device: DeviceInfo, engine: str) -> Refusal | None:
    """Why the plugin does not plan DeepSeek-V4 on ``device`` (None: an SM12x GPU), with the
    engine's own path there as the fix."""
    from .hooks.policy import SERVED_DEVICE, SERVED_SM_FAMILIES

    if device.vendor == "nvidia" and device.sm_family in SERVED_SM_FAMILIES:
        return None
    rules = ENGINES[engine]
    own = rules.own_path.get(device.sm_family) if device.vendor == "nvidia" else None
    where = f"sm_{device.sm_major}{device.sm_minor}" if device.vendor == "nvidia" else device.sm
    return Refusal(f"device {where}: this plugin plans DeepSeek-V4 on SM12x only",
                   SERVED_DEVICE,
                   f"serve DeepSeek-V4 on {where} with {rules.label}'s own path" + (f" ({own})" if own else "")
                   + ", without the plugin's opt-in")


def bytes_per_token(geometry: Dsv4Geometry, record: Dsv4Record = FP8_RECORD) -> dict[str, float]:
    """Cache bytes one context token costs a layer of each kind (the window cache is bounded by the
    window; a compressed cache grows with the context)."""
    out: dict[str, float] = {}
    for ratio in geometry.layer_counts():
        if ratio:
            out[kind_name(ratio)] = record.token_bytes / ratio
    return out


def capacity(geometry: Dsv4Geometry, record: Dsv4Record) -> dict[str, Any]:
    """Context tokens one GiB of the model's compressed caches holds (every compressed layer, one
    rank) in ``record``, beside the 584-byte fp8 record: ``{"tokens_per_gib": {name: n}, "ratio": x}``."""
    def tokens(rec: Dsv4Record) -> int:
        per_token = sum(layers * rec.token_bytes / ratio for ratio, layers in geometry.layer_counts().items() if ratio)
        return int(GIB // per_token) if per_token else 0

    mine, fp8 = tokens(record), tokens(FP8_RECORD)
    return {"tokens_per_gib": {record.name: mine, FP8_RECORD.name: fp8},
            "ratio": round(mine / fp8, 2) if fp8 else 1.0}


def plan_to_dict(p: Dsv4Plan) -> dict[str, Any]:
    """A JSON-ready view (``mla-sm120 check --json``)."""
    geometry = p.facts.dsv4
    assert geometry is not None
    return {
        "servable": True,
        "family": "dsv4",
        "model_arch": p.facts.arch,
        "model_name": p.facts.name,
        "engine": p.engine,
        "device": {"sm": p.device.sm, "vendor": p.device.vendor, "name": p.device.name, "source": p.device.source},
        "tensor_parallel_size": p.tensor_parallel_size,
        "kv_record": {"name": p.record, "token_bytes": p.kv_record.token_bytes},
        "capacity": capacity(geometry, p.kv_record),
        "layers_known": geometry.layers_known,
        "layer_kinds": {
            kind: {"call": dataclasses.asdict(d.context.dsv4) if d.context.dsv4 else None,
                   "kernels": dict(d.kernels), "classes": dict(d.classes),
                   "decision": decision_to_dict(d)}
            for kind, d in p.decisions.items()
        },
        "compressed_bytes_per_token": bytes_per_token(geometry, p.kv_record),
        "notes": list(p.notes),
    }


def _record_text(record: Dsv4Record) -> str:
    if record.name == NVFP4_DSV4:
        return (f"the {record.token_bytes}-byte NVFP4 DeepSeek-V4 record (448 e2m1 + 64 bf16 rope + 28 e4m3 scales "
                "a 16-value group, page-major; FlashInfer's kv_cache_format='nvfp4')")
    return (f"the {record.token_bytes}-byte fp8 DeepSeek-V4 record (448 e4m3 + 64 bf16 rope + 7 UE8M0 scales, "
            "page-major)")


def _capacity_text(geometry: Dsv4Geometry, record: Dsv4Record) -> str:
    cap = capacity(geometry, record)
    counts = cap["tokens_per_gib"]
    if record.name == FP8_RECORD.name:
        return f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers)"
    return (f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers); "
            f"the {FP8_RECORD.token_bytes}-byte fp8 record: {counts[FP8_RECORD.name]:,} -> {cap['ratio']:.2f}x "
            "(the compressed caches alone: vLLM 0.33 gives every block a page of each cache, the window's and the "
            "indexer's and compressor's too, which the record does not shrink, so its block count grows less)")


def explain_plan(p: Dsv4Plan) -> str:
    """The plan as ``mla-sm120 check`` prints it: one row per (layer kind, phase)."""
    geometry = p.facts.dsv4
    assert geometry is not None
    engine = ENGINES[p.engine]
    heads = p.facts.num_heads // p.tensor_parallel_size
    lines = [
        f"DeepSeek-V4 plan: {p.facts.name} ({p.facts.arch}, {geometry.version}) on {p.device.describe()} "
        f"({p.device.source}), {engine.label}, tp={p.tensor_parallel_size}: {heads} heads and "
        f"{geometry.o_groups // p.tensor_parallel_size} output group(s) a GPU",
        f"kv cache: {_record_text(p.kv_record)}; compressed caches cost "
        + ", ".join(f"{k} {v:.3g} B" for k, v in bytes_per_token(geometry, p.kv_record).items())
        + " a context token a layer",
        _capacity_text(geometry, p.kv_record),
        "",
        f"{'layer kind':<11} {'layers':>6}  {'phase':<8} {'q heads':>7} {'window':>7} {'page':>5} "
        f"{'compressed':>10} {'page':>5}  kernel (class)",
    ]
    for kind, decision in p.decisions.items():
        call = decision.context.dsv4
        assert call is not None
        for phase in PHASES:
            extra = (f"{call.extra:>10} {call.extra_page:>5}" if call.extra else f"{'-':>10} {'-':>5}")
            lines.append(f"{kind:<11} {call.layers:>6}  {phase:<8} {call.heads_for(phase):>7} "
                         f"{call.window_for(phase):>7} {call.window_page:>5} {extra}  "
                         f"{decision.kernels[phase]} ({decision.classes.get(phase, '?')})")
    lines.append("")
    lines.extend(f"note: {note}" for note in p.notes)
    first = next(iter(p.decisions.values()))
    lines.append("")
    lines.append(f"first layer kind in full ({first.context.dsv4.kind if first.context.dsv4 else '?'}):")
    lines.append(explain(first))
    return "\n".join(lines)
