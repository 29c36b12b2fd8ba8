"""DeepSeek-V4's part of the plan: one call shape per layer kind, and the record both caches hold.

A DeepSeek-V4 layer is one of a few kinds (docs/facts.md, DeepSeek-V4): the sliding window alone
(the draft layers, V4's window-only layers), or the window plus a compressed cache (V4: C4A, the
indexer's top-k of 4-token entries, and C128A, every 128-token entry; V4.1: ratios 1 and 2). Each
kind makes its own attention call in each phase, with its own widths, page sizes and q heads,
shaped as the engine shapes it (:class:`~mla_sm120_plugin.engines.Dsv4Calls`: vLLM pads q heads to
8/16/32/64/128 and reads 64-entry window pages; SGLang passes 256-token pages, copies window pages
into 64-entry ones for FlashInfer and pads decode q to 64 heads unless FlashInfer lists the rank's
count). :func:`shape` makes one :class:`~mla_sm120_plugin.types.Dsv4Call` and one context a kind,
after refusing what no kind can serve (the device, the TP size, the KV dtype). Pure Python.
"""

from __future__ import annotations

import dataclasses

from .. import config as config_mod
from ..context import EngineLimits, build_context
from ..engines import ENGINES, Engine, lookup
from ..errors import UnsupportedConfiguration, format_error
from ..kernels.dsv4.layout import FP8_DSV4, NVFP4_DSV4, NVFP4_RECORD
from ..kernels.shared.host import cdiv
from ..modelinfo import Dsv4Geometry, ModelFacts
from ..rules import device_refusal
from ..types import DECODE, DSV4_FAMILY, PREFILL, DeviceInfo, Dsv4Call
from . import Shaped

WINDOW = "window"


def kind_name(ratio: int) -> str:
    """``"window"`` for a window-only layer, ``"c<ratio>a"`` for a compressed one."""
    return WINDOW if ratio == 0 else f"c{ratio}a"


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _extra_width(engine: Engine, geometry: Dsv4Geometry, ratio: int, index_topk: int) -> int:
    """Compressed slots a query row holds for a ``ratio`` layer."""
    if ratio == 0:
        return 0
    if geometry.version == "v4" and ratio == 128:
        entries = cdiv(geometry.max_model_len, ratio)  # C128A attends every entry
        if engine.name == "vllm":  # a power of two >= max_seq_len // 128, a multiple of 128
            return max(_pow2_at_least(entries), 128)
        return cdiv(entries, 64) * 64  # SGLang pads index rows to multiples of 64
    return index_topk


def _window_widths(engine: Engine, geometry: Dsv4Geometry, speculative_tokens: int, dspark: bool) -> tuple[int, int]:
    """(decode, prefill) window slots a query row holds."""
    window = geometry.sliding_window
    decode = window
    if dspark and engine.name == "vllm" and speculative_tokens:
        decode = cdiv(window + speculative_tokens, 64) * 64  # get_dspark_swa_index_width
    return decode, window + geometry.vision_tokens


def layer_calls(facts: ModelFacts, engine: str, tensor_parallel_size: int, *, speculative_tokens: int = 0,
                dspark: bool = False, release: str | None = None) -> list[Dsv4Call]:
    """One :class:`Dsv4Call` per layer kind of ``facts`` under ``engine`` (at ``release``; None: its
    oldest supported) at this TP size.

    :raises UnsupportedConfiguration: not a DeepSeek-V4 model, or the TP size does not divide the heads.
    """
    geometry = facts.dsv4
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
    return tuple(s for other in ENGINES.values() if other is not engine for s in other.dsv4.nvfp4_spellings)


def _kv_record(engine: Engine, kv_cache_dtype: str | None, facts: ModelFacts, device: DeviceInfo, dspark: bool) -> str:
    """The record ``--kv-cache-dtype`` names for this model in ``engine``.

    :raises UnsupportedConfiguration: the engine refuses the spelling, or the plugin writes no such record here.
    """
    rules = engine.dsv4
    spelled = "auto" if kv_cache_dtype is None else str(kv_cache_dtype)
    if spelled in rules.kv_spellings:
        return FP8_DSV4
    geometry = facts.dsv4
    assert geometry is not None  # layer_calls refused anything else
    if spelled in rules.nvfp4_spellings:
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
    most = max(max(engine.dsv4.decode_heads) for engine in ENGINES.values())
    if facts.num_heads // tp > most:
        raise UnsupportedConfiguration(format_error(
            f"model_arch={facts.arch}, tensor_parallel_size={tp}: {facts.num_heads // tp} heads a rank",
            f"at most {most} heads a rank (the engines' and FlashInfer's SM120 limit)",
            f"use --tensor-parallel-size {cdiv(facts.num_heads, most)} or more"))


def _device_refusal(facts: ModelFacts, device: DeviceInfo, engine: Engine, kv_cache_dtype: str | None) -> None:
    nvfp4 = str(kv_cache_dtype) in engine.dsv4.nvfp4_spellings + nvfp4_spellings_elsewhere(engine)
    refusal = device_refusal(device, engine.name, DSV4_FAMILY, NVFP4_DSV4 if nvfp4 else None)
    if refusal is not None:
        # the KV dtype is named only where it is why the fix differs (the engine's launch and check
        # spell a default cache differently)
        given = f"model_arch={facts.arch}, " + (f"kv_cache_dtype={kv_cache_dtype}, " if nvfp4 else "") + refusal.reason
        raise UnsupportedConfiguration(format_error(given, refusal.supported, refusal.fix))


def shape(facts: ModelFacts, settings: config_mod.Settings, device: DeviceInfo, kv_cache_dtype: str | None,
          limits: EngineLimits, *, speculative_tokens: int = 0, dspark: bool = False) -> Shaped:
    """One context per layer kind of a DeepSeek-V4 deployment.

    :param kv_cache_dtype: the engine's ``--kv-cache-dtype`` as the user wrote it (None: auto).
    :param speculative_tokens: draft tokens a step (vLLM's DSpark widens decode window rows).
    :param dspark: the draft is DSpark (non-causal window rows).
    :raises UnsupportedConfiguration: the device, the TP size or the KV dtype cannot be served.
    """
    engine = limits.facts
    calls = layer_calls(facts, limits.engine, limits.tensor_parallel_size, speculative_tokens=speculative_tokens,
                        dspark=dspark, release=limits.release)
    _device_refusal(facts, device, engine, kv_cache_dtype)
    _tp_refusal(facts, limits.tensor_parallel_size, device)
    record = _kv_record(engine, kv_cache_dtype, facts, device, dspark)
    base = build_context(facts, settings, device, None, limits)
    contexts = {call.kind: dataclasses.replace(base, kv_cache_dtype=record, kv_cache_dtype_given=kv_cache_dtype,
                                               index_topk=facts.index_topk, dsv4=call) for call in calls}
    notes = []
    assert facts.dsv4 is not None
    if not facts.dsv4.layers_known:
        notes.append(f"{facts.name}: a built-in profile lists each layer kind the model has; the layer counts are "
                     "not the model's (its config.json has its per-layer list: pass that for the counts)")
    notes.append(engine.dsv4.opt_in)
    if record == NVFP4_DSV4:
        notes.append(f"{NVFP4_RECORD.token_bytes}-byte NVFP4 record: the plugin's layer class writes it (window rows "
                     "and the compressor's rows, its Triton writer) and sizes vLLM's cache specs at "
                     f"{NVFP4_RECORD.token_bytes} bytes an entry; FlashInfer's fused NVFP4 writers are not bound")
    return Shaped(contexts=contexts, record=record, notes=tuple(notes))


def check_kv_cache_dtype(engine: str) -> None:
    """What ``mla-sm120 check`` plans without ``--kv-cache-dtype``: auto (the fp8 record in both engines)."""
    return None
