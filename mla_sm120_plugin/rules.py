"""The rule book's shared pages: what the plugin serves at all, in words every model family uses.

The SM family (:func:`device_refusal`: one rule for every family, the family choosing only its words
and the engine its own path as the fix) and engine features (:func:`feature_refusals`). Each family's
own rules (the KV layout it reads, its model geometry) and the built-in ``mla_sm120_validate``
implementation that asks a context's family for them are in :mod:`mla_sm120_plugin.families`, so
``mla-sm120 check``, ``doctor`` and every engine adapter refuse the same contexts with the same text.
Kernel envelopes (:class:`~mla_sm120_plugin.types.KernelSpec`) then decide which kernel serves a
context that passed. Pure Python.
"""

from __future__ import annotations

from typing import Iterator

from .engines import Engine, for_context
from .types import DeviceInfo, Refusal, SelectionContext

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
    for feature in sorted(ctx.features - set(engine.dcp_features)):  # those only DCP refuses: _dcp_refusals
        yield Refusal(f"{feature} is on: {FEATURE_REASONS.get(feature, 'an engine feature this plugin does not know')}",
                      path, f"{engine.feature_flags.get(feature, f'turn {feature} off')}{fix_tail}")


def context_parallel_refusals(ctx: SelectionContext, unserved: str = "") -> Iterator[Refusal]:
    """Why ``ctx``'s decode context parallelism cannot be served (nothing at DCP 1): the engine's binding
    does not take DCP calls, or (``unserved``: why, in the family's words) the family's kernels cannot."""
    dcp = ctx.decode_context_parallel_size
    if dcp == 1:
        return
    engine = for_context(ctx)
    given = f"{engine.dcp_flag} {dcp}"
    if engine.dcp_refused:
        yield Refusal(f"{given} under {engine.versioned}: {engine.dcp_refused}",
                      f"{engine.dcp_flag} 1 with {engine.enable_flag}; decode context parallelism on SM12x is served "
                      "under vLLM (--attention-backend CUSTOM --decode-context-parallel-size N)",
                      f"set {engine.dcp_flag} 1 (each GPU keeps the whole cache), or serve with vLLM")
    elif unserved:
        yield Refusal(f"{given}: {unserved}", f"{engine.dcp_flag} 1 for this model",
                      f"set {engine.dcp_flag} 1 (each GPU keeps the whole cache)")
