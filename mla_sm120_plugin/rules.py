"""The rule book's shared pages: what the plugin serves at all, in words every model family uses.

The SM family (:func:`device_refusal`: one rule for every family, the family choosing only its words
and the engine its own path as the fix), engine features (:func:`feature_refusals`) and decode context
parallelism (:func:`dcp_refusals` and :func:`dcp_notes`: every DCP rule of the plan, from the engine's
:class:`~mla_sm120_plugin.engines.DcpFacts` and what the family declares). Each family's
own rules (the KV layout it reads, its model geometry) and the built-in ``mla_sm120_validate``
implementation that asks a context's family for them are in :mod:`mla_sm120_plugin.families`, so
``mla-sm120 check``, ``doctor`` and every engine adapter refuse the same contexts with the same text.
Kernel envelopes (:class:`~mla_sm120_plugin.types.KernelSpec`) then decide which kernel serves a
context that passed. Pure Python.
"""

from __future__ import annotations

from typing import Any, Iterator

from .engines import Engine, for_context
from .types import DcpService, DeviceInfo, Refusal, SelectionContext

# The plugin serves SM12x. On SM90/SM100 the engines' own sparse-MLA backends (FlashMLA and
# FlashInfer's datacenter kernels) are faster and maintained upstream, so the plugin refuses
# other families even where its Triton kernel could run.
SERVED_SM_FAMILIES = frozenset({12})

# Engine features that change how the cache is written or how top-k ids are read; no kernel here
# reads their layout. Each maps to why, for the message.
FEATURE_REASONS = {
    "hisparse": "HiSparse writes the cache through another path and remaps top-k through its own index group",
    "pcp": "prefill context parallelism shards prefill over ranks; the plugin's calls take no PCP metadata",
    "skip_softmax": "skip-softmax changes the attention output the kernels compute",
}

SERVED_DEVICE = "an NVIDIA SM120/SM121 GPU (the SM12x family: RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark)"


def device_refusal(device: DeviceInfo, engine: Engine, words: tuple[str, str, str], own_path: str,
                   kv_layout: str | None = None, sinks: bool = False) -> Refusal | None:
    """Why the plugin does not serve a family's models on ``device`` (None: an SM12x GPU), naming the
    engine's own path there as the fix (and where it reads ``kv_layout``, when the engine says; for a
    model with learned sinks, the path that applies them).

    :param engine: the engine's facts at the planned release.
    :param words: the family's words (:attr:`~mla_sm120_plugin.families.base.Family.device_words`): how
        its models' own path is called, what it serves, what the user switches off.
    :param own_path: the engine's own path for the family's models on this device.
    """
    if device.vendor == "nvidia" and device.sm_family in SERVED_SM_FAMILIES:
        return None
    backends, models, opt_in = words
    if device.vendor == "nvidia":
        label = device.label
        own = engine.native_sink_backends.get(device.sm_family) if sinks else None
        fix = (f"on {label} serve without {opt_in}: drop {engine.enable_flag}; {engine.label}'s own {backends} "
               f"serve {models} there ({own or own_path})")
        note = engine.native_layout_notes.get(kv_layout) if kv_layout is not None else None
        if note:
            fix += f" ({note})"
        return Refusal(f"device {label}: this plugin serves SM12x only", SERVED_DEVICE, fix)
    where = "a ROCm GPU" if device.vendor == "amd" else "no GPU (CPU)"
    return Refusal(
        f"device {where}: this plugin serves NVIDIA SM12x GPUs only",
        SERVED_DEVICE,
        "run on an SM12x GPU, or plan for one with --sm 12.0 (RTX 50xx / RTX PRO 6000) or --sm 12.1 (DGX Spark)",
    )


def feature_refusals(ctx: SelectionContext, path: str, fix_tail: str) -> Iterator[Refusal]:
    """One refusal a switched-on engine feature of ``ctx`` (``path``: what the kernels read instead)."""
    engine = for_context(ctx)
    for feature in sorted(ctx.features - set(engine.dcp.features)):  # those only DCP refuses: dcp_refusals
        yield Refusal(f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
                      path, f"{engine.feature_flags.get(feature, f'turn {feature} off')}{fix_tail}")


# The one rule for a learned sink under DCP (both engines; the home that applies it is
# mla_sm120_plugin.dispatch.dcp): a sink is one more term of its head's softmax denominator and the merge
# adds the ranks' terms, so exactly one rank may count it. The gathered heads of a call are in rank order,
# so a rank's own heads are a slice of them and its own [heads] sink parameter is theirs: no gather.
SINK_RULE = ("each head's learned sink is counted by the DCP rank whose heads they are (its own sink parameter; "
             "the gathered heads are in rank order): that rank's kernel applies it and folds it into the LSE it "
             "returns, the other ranks count none for that head, so the merged softmax counts each sink once")


def dcp_refusals(ctx: SelectionContext, family: Any) -> Iterator[Refusal]:
    """Every refusal of ``ctx``'s decode context parallelism (nothing at DCP 1), for every family: the DCP
    size against the TP size, what the family declares (:class:`~mla_sm120_plugin.types.DcpService`;
    declaring nothing is a refusal), then what the engine's DCP path needs of the cache, the indexer and
    the engine's features (:class:`~mla_sm120_plugin.engines.DcpFacts`)."""
    dcp = ctx.decode_context_parallel_size
    if dcp == 1:
        return
    engine = for_context(ctx)
    facts = engine.dcp
    given = f"{facts.flag} {dcp}"
    whole = f"set {facts.flag} 1 (each GPU keeps the whole cache)"
    tp = ctx.tensor_parallel_size
    if tp % dcp:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        yield Refusal(f"{given} with tensor_parallel_size={tp}: decode context parallelism shards the cache over "
                      "ranks of the tensor-parallel group",
                      f"a DCP size that divides the TP size ({', '.join(map(str, divisors))})",
                      f"pass {facts.flag} {max(d for d in divisors if d <= dcp)}, or raise the TP size to a "
                      f"multiple of {dcp}")
    service = getattr(family, "dcp", None)
    if not isinstance(service, DcpService):
        yield Refusal(f"{given} for a {family.label} model: its family declares nothing about decode context "
                      "parallelism", "a family that declares how its calls are shared by DCP ranks", whole)
        return
    if not service.served:
        yield Refusal(f"{given}: {service.why_not}", f"{facts.flag} 1 for this model", whole)
        return
    why = facts.layouts_refused.get(ctx.kv_cache_dtype)
    if why:
        yield Refusal(f"{given} with kv_cache_dtype {ctx.kv_cache_dtype_given or ctx.kv_cache_dtype}: {why}",
                      f"{engine.fp8_flag} or {engine.bf16_flag} under {given}",
                      f"pass {engine.fp8_flag} with {given}, or set {facts.flag} 1 to keep this cache")
    picks = ctx.index_picks if ctx.index_picks is not None else ctx.index_topk
    if facts.merge_picks and picks not in facts.merge_picks:
        yield Refusal(f"{given} for an indexer of top-k {picks}: {engine.label}'s DCP top-k merge ranks "
                      f"{'/'.join(map(str, facts.merge_picks))} picks a row",
                      f"an index_topk of {', '.join(map(str, facts.merge_picks))} under DCP", whole)
    for feature in sorted(ctx.features & set(facts.features)):
        words, fix = facts.features[feature]
        yield Refusal(f"{given} with {feature} on: {words}", f"{feature} off under {given}, or {facts.flag} 1",
                      f"{fix}, or {whole}")
    kpool, interleave = ctx.index_kpool, ctx.cp_kv_cache_interleave_size
    if interleave != 1 and not facts.interleave_flag:
        yield Refusal(f"--cp-kv-cache-interleave-size {interleave} under {engine.versioned}: it has no such setting "
                      "(it shards the cache one token at a time)", f"an interleave of 1 under {engine.label}",
                      "drop --cp-kv-cache-interleave-size")
    if kpool > 1 and facts.kpool_refused:
        yield Refusal(f"{given} for an indexer that pools {kpool} keys a pick: {facts.kpool_refused}",
                      f"{facts.flag} 1 for this model under {engine.versioned}", whole)
    elif kpool > 1 and interleave % kpool:
        yield Refusal(f"{given} with {facts.interleave_flag} {interleave} for an indexer that pools {kpool} keys "
                      f"a pick: a pooled key's {kpool} tokens must live on one rank ({engine.label} raises at model "
                      "build otherwise)",
                      f"{facts.interleave_flag} a multiple of {kpool} that divides the block size (64)",
                      f"pass {facts.interleave_flag} {kpool}")


def dcp_notes(ctx: SelectionContext) -> tuple[str, ...]:
    """What a plan under decode context parallelism says beside its table: the engine's top-k merge, and
    for a model with learned sinks the one rule (:data:`SINK_RULE`) and what the engine adds."""
    if ctx.decode_context_parallel_size == 1:
        return ()
    facts = for_context(ctx).dcp
    notes = (facts.merge_note,) if facts.merge_note else ()
    if ctx.sinks:
        notes += (f"learned sinks under decode context parallelism: {SINK_RULE}"
                  + (f"; {facts.sinks_note}" if facts.sinks_note else ""),)
    return notes
