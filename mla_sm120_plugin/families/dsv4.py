"""DeepSeek-V4, as a family: one call shape per layer kind, and the record both caches hold.

A DeepSeek-V4 layer is one of a few kinds (docs/facts.md, DeepSeek-V4): the sliding window alone
(the draft layers, V4's window-only layers), or the window plus a compressed cache (V4: C4A, the
indexer's top-k of 4-token entries, and C128A, every 128-token entry; V4.1: ratios 1 and 2). Each
kind makes its own attention call in each phase, with its own widths, page sizes and q heads,
shaped as the engine shapes it (:class:`~mla_sm120_plugin.engines.Dsv4Calls`: vLLM pads q heads to
8/16/32/64/128 and reads 64-entry window pages; SGLang passes 256-token pages, copies window pages
into 64-entry ones for FlashInfer and pads decode q to 64 heads unless FlashInfer lists the rank's
count). :meth:`Dsv4Family.shape` makes one :class:`Dsv4Call` and one context a kind, after refusing
what no kind can serve (the device, the TP size, the KV dtype); its report rows are a row per (layer
kind, phase), the record and the compressed caches' capacity. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..engines import Engine, for_context, lookup, others
from ..errors import ConfigError, UnsupportedConfiguration, format_error
from ..hfconfig import (ABSENT, MAX_HEAD_WIDTH, MAX_HEADS, MAX_INDEX_TOPK, MAX_LAYERS, MAX_WINDOW, bad_value, count,
                        get, int_list)
from ..kernels.dsv4.layout import FP8_DSV4, FP8_RECORD, NVFP4_DSV4, NVFP4_RECORD, RECORDS, Dsv4Record
from ..kernels.shared.host import cdiv
from ..rules import device_refusal, feature_refusals
from ..types import (DECODE, LAYER_COUNTS_UNKNOWN, PHASES, PREFILL, DcpService, Decision, DeviceInfo, ModelProfile,
                     Refusal, SelectionContext)
from .base import Shaped

# ModelFacts (modelinfo) reaches this module as an argument: read by attribute, not imported (the reader
# sits on this floor and imports the plugin manager, which loads the families). Its ``geometry`` is this
# family's own reading of the config (:class:`Dsv4Geometry`, :meth:`Dsv4Family.config_geometry`).

NAME = "dsv4"
GIB = 1 << 30
WINDOW = "window"


# DeepSeek-V4 (docs/facts.md#deepseek-v4). Layer types of transformers' DeepseekV4Config and the legacy per-layer
# compress_ratios they map from; V4.1 keeps a flat per-layer compress_ratios of 0 / 1 / 2.
DSV4_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DSV4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DSV4_RATIOS = (0, 4, 128)
DSV41_RATIOS = (0, 1, 2)
DSV41_ARCHS = ("DeepseekV41ForCausalLM", "DSparkV41DraftModel")
DSV41_MODEL_TYPE = "deepseek_v41"
# Every DeepSeek-V4 attention row: q = K = V = 512 values, 64 of them rope.
DSV4_HEAD_DIM = 512
DSV4_ROPE_DIM = 64


@dataclass(frozen=True)
class Dsv4Geometry:
    """What a DeepSeek-V4 model's attention calls depend on, read from its config.

    :param version: ``"v4"`` (V4-Flash, V4-Pro) or ``"v4.1"`` (V4.1-Flash).
    :param ratios: compress ratio of each attention layer, the draft (MTP) layers last: 0 window
        only; V4: 4 (C4A: the indexer's top-k of 4-token entries) or 128 (C128A: every 128-token
        entry); V4.1: 1 or 2.
    :param draft_layers: how many of ``ratios`` are draft (MTP) layers.
    :param sliding_window: tokens of a layer's window.
    :param o_groups: output-projection groups (each rank needs at least one).
    :param head_dim: q/K/V width (512).
    :param qk_rope_head_dim: the rope part of it (64).
    :param vision_tokens: how far the vision variant widens prefill window rows (0: none).
    :param max_model_len: the longest context (``max_position_embeddings``): bounds C128A's rows.
    :param layers_known: ``ratios`` are the model's layers (False: a built-in profile that lists
        each layer kind once, the model's own list being in its config.json only).
    """

    version: str
    ratios: tuple[int, ...]
    draft_layers: int
    sliding_window: int
    o_groups: int
    head_dim: int = DSV4_HEAD_DIM
    qk_rope_head_dim: int = DSV4_ROPE_DIM
    vision_tokens: int = 0
    max_model_len: int = 1 << 20
    layers_known: bool = True

    def layer_counts(self) -> dict[int, int]:
        """Compress ratio -> how many layers have it, in first-seen order."""
        counts: dict[int, int] = {}
        for ratio in self.ratios:
            counts[ratio] = counts.get(ratio, 0) + 1
        return counts


def _dsv4_ratios(cfg: Any, where: str, version: str, layers: int, draft: int) -> list[int]:
    """Each attention layer's compress ratio (drafts last), the way the engines read them."""
    if version == "v4.1":
        # V4.1: one flat list over every layer, the draft's included (vLLM's DeepseekV41Config).
        ratios = int_list(cfg, "compress_ratios", where, DSV41_RATIOS,
                           "set compress_ratios to the model's per-layer list (0 window, 1 or 2 compressed)")
        if ratios is None:
            raise ConfigError(format_error(f"{where}: a DeepSeek-V4.1 config without compress_ratios",
                                           "a per-layer compress_ratios list (0 / 1 / 2), the draft layers included",
                                           "point at the model's own config.json"))
        return ratios
    fix = "point at the model's own config.json, or correct layer_types / compress_rates in it"
    rates = get(cfg, "compress_rates")
    if rates is ABSENT:
        rates = dict(DSV4_DEFAULT_RATES)
    elif (not isinstance(rates, dict) or not set(rates) <= set(DSV4_DEFAULT_RATES)
          or not all(isinstance(v, int) and not isinstance(v, bool) and v in DSV4_RATIOS[1:] for v in rates.values())):
        raise bad_value(where, "compress_rates", rates,
                         f"a mapping of {sorted(DSV4_DEFAULT_RATES)} to {list(DSV4_RATIOS[1:])}", fix)
    types = get(cfg, "layer_types")
    if types is ABSENT:
        legacy = int_list(cfg, "compress_ratios", where, DSV4_RATIOS, fix)
        if legacy is not None:
            reverse = {ratio: name for name, ratio in DSV4_LAYER_TYPES.items()}
            types = [reverse[r] for r in legacy]
        else:  # transformers' default: two C128A layers, then C128A / C4A alternating
            types = (["heavily_compressed_attention"] * min(layers, 2)
                     + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(layers - 2, 0))])
    elif (not isinstance(types, (list, tuple)) or not 0 < len(types) <= MAX_LAYERS
          or not all(isinstance(t, str) and t in DSV4_LAYER_TYPES for t in types)):
        raise bad_value(where, "layer_types", types, f"a list of {list(DSV4_LAYER_TYPES)}", fix)
    if len(types) < layers:
        raise ConfigError(format_error(f"{where}: {len(types)} layer types for num_hidden_layers={layers}",
                                       "one layer type (or compress ratio) per hidden layer", fix))
    ratios = [0 if t == "sliding_attention" else rates.get(t, DSV4_DEFAULT_RATES[t]) for t in types[:layers]]
    return ratios + [0] * draft  # draft (MTP) layers attend their window only


def dsv4_geometry(cfg: Any, *, where: str, version: str) -> Dsv4Geometry:
    """A DeepSeek-V4 config's layer geometry (:class:`Dsv4Geometry`), type- and range-checked.

    V4 reads ``layer_types`` + ``compress_rates`` (or the legacy per-layer ``compress_ratios``,
    or transformers' default pattern), V4.1 its flat ``compress_ratios``; both read
    ``sliding_window``, ``o_groups``, ``head_dim`` (must be 512), ``qk_rope_head_dim`` (64) and
    the vision variant's ``vision_max_n_token``.

    :raises ConfigError: a key of the wrong type or range, or a layer list shorter than the layers.
    """
    layers = count(cfg, "num_hidden_layers", MAX_LAYERS, where, None, "")
    # Absent: transformers' default, one MTP layer.
    draft = 1 if get(cfg, "num_nextn_predict_layers") is ABSENT else count(
        cfg, "num_nextn_predict_layers", MAX_LAYERS, where, None, "", least=0)
    if layers == 0:
        raise ConfigError(format_error(f"{where}: a DeepSeek-V4 config without num_hidden_layers",
                                       "num_hidden_layers: the model's layer count", "point at the model's own config.json"))
    ratios = _dsv4_ratios(cfg, where, version, layers, draft)
    if version == "v4.1":
        draft = max(len(ratios) - layers, 0)
    head_dim = count(cfg, "head_dim", MAX_HEAD_WIDTH, where, None, "") or DSV4_HEAD_DIM
    rope = get(cfg, "qk_rope_head_dim")
    rope = DSV4_ROPE_DIM if rope is ABSENT else count(cfg, "qk_rope_head_dim", MAX_HEAD_WIDTH, where, None, "", 0)
    vision = 0
    if version == "v4" and (count(cfg, "vision_n_layers", MAX_LAYERS, where, None, "", 0) or 0) > 0:
        vision = count(cfg, "vision_max_n_token", MAX_WINDOW, where, None, "", 0)
    return Dsv4Geometry(
        version=version, ratios=tuple(ratios), draft_layers=draft,
        sliding_window=count(cfg, "sliding_window", MAX_WINDOW, where, None, "") or 128,
        o_groups=count(cfg, "o_groups", MAX_HEADS, where, None, "") or 8,
        head_dim=head_dim, qk_rope_head_dim=rope, vision_tokens=vision,
        max_model_len=count(cfg, "max_position_embeddings", MAX_INDEX_TOPK * 64, where, None, "") or (1 << 20),
        layers_known=get(cfg, LAYER_COUNTS_UNKNOWN) is ABSENT,
    )


def kind_name(ratio: int) -> str:
    """``"window"`` for a window-only layer, ``"c<ratio>a"`` for a compressed one."""
    return WINDOW if ratio == 0 else f"c{ratio}a"


@dataclass(frozen=True)
class Dsv4Call:
    """One DeepSeek-V4 layer kind's attention call as the engine makes it: a window cache and, for a
    compressed layer, a compressed cache, in one call (each with its own slots, lengths and pages).

    :param kind: ``"window"`` (the sliding window only) or ``"c<ratio>a"`` (the window and the
        compressed cache: ``c4a`` with the indexer's top-k, ``c128a`` with every entry; V4.1's
        ``c1a`` / ``c2a``).
    :param compress_ratio: tokens a compressed entry stands for (0: no compressed cache).
    :param layers: how many of the model's layers (drafts' included) are of this kind.
    :param window: window slots a decode query row holds (the window, or DSpark's wider one).
    :param prefill_window: window slots a prefill row holds (the vision variant's are wider).
    :param window_page: entries a window-cache page holds.
    :param extra: compressed slots a query row holds (0 without a compressed cache).
    :param extra_page: entries a compressed-cache page holds (0 without one).
    :param decode_heads: q heads a decode call carries (the engine pads the rank's heads).
    :param prefill_heads: q heads a prefill call carries.
    :param call_window_page: entries a window-cache page holds as the engine's call passes it (0: the
        same as ``window_page``, which is what FlashInfer's kernels see).
    """

    kind: str
    compress_ratio: int
    layers: int
    window: int
    prefill_window: int
    window_page: int
    extra: int
    extra_page: int
    decode_heads: int
    prefill_heads: int
    call_window_page: int = 0

    def heads_for(self, phase: str) -> int:
        return self.prefill_heads if phase == PREFILL else self.decode_heads

    def window_for(self, phase: str) -> int:
        return self.prefill_window if phase == PREFILL else self.window

    @property
    def pages_at_call(self) -> tuple[int, int]:
        """(window, compressed) entries a page holds as the engine's call passes the caches."""
        return self.call_window_page or self.window_page, self.extra_page

    def describe(self, phase: str) -> str:
        extra = f", compressed {self.extra} slots (pages of {self.extra_page})" if self.extra else ""
        return (f"{self.kind} {phase}: {self.heads_for(phase)} q heads, window {self.window_for(phase)} slots "
                f"(pages of {self.window_page}){extra}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _extra_width(engine: Engine, geometry: Any, ratio: int, index_topk: int) -> int:
    """Compressed slots a query row holds for a ``ratio`` layer."""
    if ratio == 0:
        return 0
    if geometry.version == "v4" and ratio == 128:
        entries = cdiv(geometry.max_model_len, ratio)  # C128A attends every entry
        rules = engine.dsv4
        wide = _pow2_at_least(entries) if rules.full_row_pow2 else entries
        return cdiv(wide, rules.full_row_align) * rules.full_row_align
    return index_topk


def _window_widths(engine: Engine, geometry: Any, speculative_tokens: int, dspark: bool) -> tuple[int, int]:
    """(decode, prefill) window slots a query row holds."""
    window = geometry.sliding_window
    decode = window
    if dspark and engine.dsv4.dspark_widens_window and speculative_tokens:
        decode = cdiv(window + speculative_tokens, 64) * 64  # get_dspark_swa_index_width
    return decode, window + geometry.vision_tokens


def layer_calls(facts: Any, engine: str, tensor_parallel_size: int, *, speculative_tokens: int = 0,
                dspark: bool = False, release: str | None = None) -> list[Dsv4Call]:
    """One :class:`Dsv4Call` per layer kind of ``facts`` under ``engine`` (at ``release``; None: its
    oldest supported) at this TP size.

    :raises UnsupportedConfiguration: not a DeepSeek-V4 model, or the TP size does not divide the heads.
    """
    geometry = facts.geometry
    if geometry is None:
        raise UnsupportedConfiguration(format_error(f"{facts.name} ({facts.arch}) is not a DeepSeek-V4 model",
                                                    "DeepSeek-V4, V4-Pro, V4.1 and their drafts",
                                                    "plan a DSA model with mla-sm120 check (no layer kinds)"))
    words = lookup(engine, release)
    rules = words.dsv4
    heads = facts.heads_per_rank(tensor_parallel_size)
    decode_window, prefill_window = _window_widths(words, geometry, speculative_tokens, dspark)
    calls = []
    for ratio, layers in geometry.layer_counts().items():
        extra_page = rules.compressed_page_tokens[geometry.version] // ratio if ratio else 0
        calls.append(Dsv4Call(
            kind=kind_name(ratio), compress_ratio=ratio, layers=layers,
            window=decode_window, prefill_window=prefill_window, window_page=rules.window_page[geometry.version],
            extra=_extra_width(words, geometry, ratio, facts.index_topk), extra_page=extra_page,
            decode_heads=rules.padded(heads, DECODE), prefill_heads=rules.padded(heads, PREFILL),
            call_window_page=rules.call_window_page[geometry.version]))
    return calls


def nvfp4_spellings_elsewhere(engine: Engine) -> tuple[str, ...]:
    """NVFP4 spellings another engine takes (so this one's refusal says NVFP4, not 'no such cache')."""
    return tuple(s for other in others(engine) for s in other.dsv4.nvfp4_spellings)


def kv_record(engine: Engine, kv_cache_dtype: str | None) -> str:
    """The record ``--kv-cache-dtype`` names in ``engine`` (None: auto); another spelling passes through
    (:func:`_check_record` refuses it)."""
    spelled = "auto" if kv_cache_dtype is None else str(kv_cache_dtype)
    if spelled in engine.dsv4.kv_spellings:
        return FP8_DSV4
    return NVFP4_DSV4 if spelled in engine.dsv4.nvfp4_spellings else spelled


def _check_record(engine: Engine, record: str, kv_cache_dtype: str | None, facts: Any, device: DeviceInfo,
                  dspark: bool) -> None:
    """That the plugin writes ``record`` (what ``--kv-cache-dtype`` named) for this model in ``engine``.

    :raises UnsupportedConfiguration: the engine refuses the spelling, or the plugin writes no such record here.
    """
    rules = engine.dsv4
    spelled = "auto" if kv_cache_dtype is None else str(kv_cache_dtype)
    if record == FP8_DSV4:
        return
    geometry = facts.geometry
    assert geometry is not None  # layer_calls refused anything else
    if record == NVFP4_DSV4:
        why = None
        if geometry.version != "v4":
            why = (f"{engine.label}'s {spelled} for DeepSeek-V4.1 is SM100's record pair (an MXFP8 window record and "
                   "an NVFP4 compressed one), not FlashInfer's 384-byte record, which the plugin writes for V4 layers "
                   "only")
        elif dspark:
            why = (f"{engine.label}'s DSpark draft writes its window rows with its own fp8 insert, which the plugin's "
                   "NVFP4 writers do not replace")
        if why is None:
            return
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, kv_cache_dtype={spelled}: {why}",
            f"the {NVFP4_RECORD.token_bytes}-byte NVFP4 record for DeepSeek-V4 (V4-Flash, V4-Pro) with a causal "
            "or MTP draft; the 584-byte fp8 record everywhere",
            f"pass --kv-cache-dtype {rules.kv_spellings[-1]}"))
    if spelled in nvfp4_spellings_elsewhere(engine):
        why = rules.kv_refused.get(spelled, f"{engine.label} has no NVFP4 DeepSeek-V4 cache (the plugin writes the "
                                   f"{NVFP4_RECORD.token_bytes}-byte record in vLLM's layers only)")
    else:
        why = rules.kv_refused.get(spelled, f"{engine.label} has no DeepSeek-V4 cache of that name")
    raise UnsupportedConfiguration(format_error(
        f"model_arch={facts.arch}, sm={device.sm}, kv_cache_dtype={spelled}: {why}",
        f"the 584-byte fp8 DeepSeek-V4 record: --kv-cache-dtype {' / '.join(rules.kv_spellings)}"
        + (f"; the {NVFP4_RECORD.token_bytes}-byte NVFP4 record: --kv-cache-dtype {' / '.join(rules.nvfp4_spellings)}"
           if rules.nvfp4_spellings else ""),
        f"pass --kv-cache-dtype {rules.kv_spellings[-1]} (or leave it auto)"))


def _tp_refusal(facts: Any, tp: int, device: DeviceInfo, engine: Engine) -> None:
    geometry = facts.geometry
    assert geometry is not None  # layer_calls checked it
    if tp > geometry.o_groups:
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, sm={device.sm}, tensor_parallel_size={tp}: {facts.name} has "
            f"{geometry.o_groups} output-projection groups (o_groups), so a rank would hold none "
            "(the engines' o_groups // tp)",
            f"tensor_parallel_size <= {geometry.o_groups} (a divisor of {facts.num_heads} heads)",
            f"use --tensor-parallel-size {max(t for t in (1, 2, 4, 8, 16) if t <= geometry.o_groups)} "
            "(and data or pipeline parallelism for more GPUs)"))
    most = max(engine.dsv4.decode_heads)
    if facts.num_heads // tp > most:
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, tensor_parallel_size={tp}: {facts.num_heads // tp} heads a rank",
            f"at most {most} heads a rank (the engines' and FlashInfer's SM120 limit)",
            f"use --tensor-parallel-size {cdiv(facts.num_heads, most)} or more"))


def _device_refusal(facts: Any, device: DeviceInfo, engine: Engine, kv_cache_dtype: str | None) -> None:
    nvfp4 = str(kv_cache_dtype) in engine.dsv4.nvfp4_spellings + nvfp4_spellings_elsewhere(engine)
    refusal = device_refusal(device, engine, FAMILY.device_words, FAMILY.own_path(engine, device.sm_family),
                             NVFP4_DSV4 if nvfp4 else None)
    if refusal is not None:
        # the KV dtype is named only where it is why the fix differs (the engine's launch and check
        # spell a default cache differently)
        given = f"model_arch={facts.arch}, " + (f"kv_cache_dtype={kv_cache_dtype}, " if nvfp4 else "") + refusal.reason
        raise UnsupportedConfiguration(format_error(given, refusal.supported, refusal.fix))


def _shape(base: SelectionContext, facts: Any, kv_cache_dtype: str | None, limits: Any, *,
           speculative_tokens: int, dspark: bool) -> Shaped:
    engine = limits.facts
    device = base.device
    calls = layer_calls(facts, limits.engine, limits.tensor_parallel_size, speculative_tokens=speculative_tokens,
                        dspark=dspark, release=limits.release)
    _device_refusal(facts, device, engine, kv_cache_dtype)
    _tp_refusal(facts, limits.tensor_parallel_size, device, engine)
    record = base.kv_cache_dtype  # the shared builder's, from this family's kv_layout
    _check_record(engine, record, kv_cache_dtype, facts, device, dspark)
    contexts = {call.kind: dataclasses.replace(base, call=call) for call in calls}
    notes = []
    if not facts.geometry.layers_known:
        notes.append(f"{facts.name}: a built-in profile lists each layer kind the model has; the layer counts are "
                     "not the model's (its config.json has its per-layer list: pass that for the counts)")
    notes.append(engine.dsv4.opt_in)
    if record == NVFP4_DSV4:
        notes.append(f"{NVFP4_RECORD.token_bytes}-byte NVFP4 record: the plugin's layer class writes it (window rows "
                     "and the compressor's rows, its Triton writer) and sizes vLLM's cache specs at "
                     f"{NVFP4_RECORD.token_bytes} bytes an entry; FlashInfer's fused NVFP4 writers are not bound")
    return Shaped(contexts=contexts, kv_cache=record, notes=tuple(notes))


# ------------------------------------------------------------------------------ the report's rows


def bytes_per_token(geometry: Any, record: Dsv4Record = FP8_RECORD) -> dict[str, float]:
    """Cache bytes one context token costs a DeepSeek-V4 layer of each compressed kind (the window
    cache is bounded by the window; a compressed cache grows with the context)."""
    return {kind_name(ratio): record.token_bytes / ratio for ratio in geometry.layer_counts() if ratio}


def model_capacity(geometry: Any, record: Dsv4Record) -> dict[str, Any]:
    """Context tokens one GiB of a DeepSeek-V4 model's compressed caches holds (every compressed layer,
    one rank) in ``record``, beside the 584-byte fp8 record, in the family's capacity shape."""
    def tokens(rec: Dsv4Record) -> int:
        per_token = sum(layers * rec.token_bytes / ratio for ratio, layers in geometry.layer_counts().items() if ratio)
        return int(GIB // per_token) if per_token else 0

    rows = {rec.name: {"token_bytes": rec.token_bytes, "tokens_per_gib": tokens(rec)}
            for rec in dict.fromkeys((record, FP8_RECORD))}
    mine, fp8 = rows[record.name]["tokens_per_gib"], rows[FP8_RECORD.name]["tokens_per_gib"]
    ratios = {} if record is FP8_RECORD else {FP8_RECORD.name: round(mine / fp8, 2) if fp8 else 1.0}
    return {"scope": "context tokens a GiB of one rank's compressed caches holds (every compressed layer)",
            "layouts": rows, "ratio_vs": ratios}


def _record_text(record: Dsv4Record) -> str:
    if record.name == NVFP4_DSV4:
        return (f"the {record.token_bytes}-byte NVFP4 DeepSeek-V4 record (448 e2m1 + 64 bf16 rope + 28 e4m3 scales "
                "a 16-value group, page-major; FlashInfer's kv_cache_format='nvfp4')")
    return (f"the {record.token_bytes}-byte fp8 DeepSeek-V4 record (448 e4m3 + 64 bf16 rope + 7 UE8M0 scales, "
            "page-major)")


def _capacity_text(plan: Any, record: Dsv4Record) -> str:
    cap = model_capacity(plan.facts.geometry, record)
    counts = {name: row["tokens_per_gib"] for name, row in cap["layouts"].items()}
    if record.name == FP8_RECORD.name:
        return f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers)"
    return (f"capacity: {counts[record.name]:,} context tokens a GiB of compressed cache (all compressed layers); "
            f"the {FP8_RECORD.token_bytes}-byte fp8 record: {counts[FP8_RECORD.name]:,} -> "
            f"{cap['ratio_vs'][FP8_RECORD.name]:.2f}x (the compressed caches alone: {plan.versioned} gives every block "
            "a page of each cache, the window's and the indexer's and compressor's too, which the record does not "
            "shrink, so its block count grows less)")


class Dsv4Family:
    """The DeepSeek-V4 family (:class:`~mla_sm120_plugin.families.base.Family`)."""

    name = NAME
    label = "DeepSeek-V4"
    has_call = True
    layouts = frozenset(RECORDS)
    selfcheck_case = "mla_sm120_plugin.dispatch.selfcheck_dsv4"
    device_words = ("DeepSeek-V4 backends", "DeepSeek-V4", "the plugin's opt-in")
    dcp = DcpService(served=False, why_not=(
        "DeepSeek-V4's window and compressed caches are read whole by each call (no engine shards them by token on "
        "any GPU yet); decode context parallelism is served for the DSA models"))

    def own_path(self, engine: Engine, sm_family: int | None) -> str:
        return engine.own_dsv4_path(sm_family)

    def shape(self, base: SelectionContext, facts: Any, kv_cache_dtype: str | None, limits: Any, *,
              speculative_tokens: int = 0, dspark: bool = False) -> Shaped:
        """One context per layer kind of a DeepSeek-V4 deployment.

        :param kv_cache_dtype: the engine's ``--kv-cache-dtype`` as the user wrote it (None: auto).
        :param speculative_tokens: draft tokens a step (vLLM's DSpark widens decode window rows).
        :param dspark: the draft is DSpark (non-causal window rows).
        :raises UnsupportedConfiguration: the device, the TP size or the KV dtype cannot be served.
        """
        return _shape(base, facts, kv_cache_dtype, limits, speculative_tokens=speculative_tokens, dspark=dspark)

    def config_geometry(self, cfg: Any, *, arch: str, where: str) -> Dsv4Geometry:
        """The layers' geometry from the model's own config keys (:func:`dsv4_geometry`; V4.1 by its
        architecture or its model_type, which SGLang keeps when it renames V4.1's architecture to V4's).

        :raises ConfigError: a key of the wrong type or range, or a layer list shorter than the layers.
        """
        v41 = arch in DSV41_ARCHS or get(cfg, "model_type") == DSV41_MODEL_TYPE
        return dsv4_geometry(cfg, where=where, version="v4.1" if v41 else "v4")

    def kv_layout(self, engine: Engine, value: str | None, device: DeviceInfo, facts: Any) -> str:
        """The record the engine's spelling names (:func:`kv_record`)."""
        return kv_record(engine, value)

    def check_kv_cache_dtype(self, engine: Engine) -> None:
        """Auto: the fp8 record in both engines."""
        return None

    def refusals(self, ctx: SelectionContext, profile: ModelProfile | None) -> Iterator[Refusal]:
        """The SM family and the record (the plan checked TP and the KV dtype's spelling; here a third
        party's context is held to the same)."""
        engine = for_context(ctx)
        device = device_refusal(ctx.device, engine, self.device_words, self.own_path(engine, ctx.device.sm_family),
                                ctx.kv_cache_dtype)
        if device is not None:
            yield device
        if ctx.kv_cache_dtype not in RECORDS:
            yield Refusal(
                f"kv layout {ctx.kv_cache_dtype}: DeepSeek-V4 layers read the {RECORDS[FP8_DSV4].token_bytes}-byte record",
                f"kv layouts {sorted(RECORDS)}",
                f"pass --kv-cache-dtype {engine.dsv4.kv_spellings[-1]} (or auto)",
            )
        yield from feature_refusals(ctx, "the standard DeepSeek-V4 cache path", "")

    def call_from_json(self, fields: Mapping[str, Any] | None) -> Dsv4Call | None:
        return None if fields is None else Dsv4Call(**fields)

    def token_bytes(self, layout: str) -> int | None:
        return RECORDS[layout].token_bytes if layout in RECORDS else None

    def capacity(self, ctx: SelectionContext) -> dict[str, Any]:
        """A layer kind lists its record alone (no other layout of the engines holds these layers)."""
        record = RECORDS.get(ctx.kv_cache_dtype)
        rows = {} if record is None else {record.name: {"token_bytes": record.token_bytes,
                                                        "tokens_per_gib": GIB // record.token_bytes}}
        return {"scope": "cache entries a GiB holds, per layer", "layouts": rows, "ratio_vs": {}}

    def scales(self, ctx: SelectionContext, decision: Decision) -> str:
        record = RECORDS.get(ctx.kv_cache_dtype)
        if record is None:
            return decision.scale_format
        kind = "e4m3" if record.nope_bits == 4 else "UE8M0 (pow2)"
        return f"{kind} per {record.scale_group} values, fixed by the record"

    def plan_capacity(self, plan: Any) -> dict[str, Any]:
        return model_capacity(plan.facts.geometry, RECORDS[plan.kv_cache])

    def plan_rows(self, plan: Any) -> list[str]:
        """The plan's header (model, device, release, heads and groups a GPU; the record; the compressed
        caches' capacity) and a row per (layer kind, phase)."""
        geometry = plan.facts.geometry
        record = RECORDS[plan.kv_cache]
        heads = plan.facts.num_heads // plan.tensor_parallel_size
        lines = [
            f"DeepSeek-V4 plan: {plan.facts.name} ({plan.facts.arch}, {geometry.version}) on {plan.device.describe()} "
            f"({plan.device.source}), {plan.versioned}, tp={plan.tensor_parallel_size}: {heads} heads and "
            f"{geometry.o_groups // plan.tensor_parallel_size} output group(s) a GPU",
            f"kv cache: {_record_text(record)}; compressed caches cost "
            + ", ".join(f"{k} {v:.3g} B" for k, v in bytes_per_token(geometry, record).items())
            + " a context token a layer",
            _capacity_text(plan, record),
            "",
            f"{'layer kind':<11} {'layers':>6}  {'phase':<8} {'q heads':>7} {'window':>7} {'page':>5} "
            f"{'compressed':>10} {'page':>5}  kernel (class)",
        ]
        for kind, decision in plan.decisions.items():
            call = decision.context.call
            for phase in PHASES:
                extra = (f"{call.extra:>10} {call.extra_page:>5}" if call.extra else f"{'-':>10} {'-':>5}")
                lines.append(f"{kind:<11} {call.layers:>6}  {phase:<8} {call.heads_for(phase):>7} "
                             f"{call.window_for(phase):>7} {call.window_page:>5} {extra}  "
                             f"{decision.kernels[phase]} ({decision.classes.get(phase, '?')})")
        return lines

    def details(self, plan: Any) -> dict[str, Any]:
        geometry = plan.facts.geometry
        return {"version": geometry.version, "layers_known": geometry.layers_known,
                "compressed_bytes_per_token": bytes_per_token(geometry, RECORDS[plan.kv_cache])}

    def layers(self, ctx: SelectionContext) -> int:
        return ctx.call.layers


FAMILY = Dsv4Family()
