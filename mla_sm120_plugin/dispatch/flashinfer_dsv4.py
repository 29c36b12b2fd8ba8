"""FlashInfer's SM120/SM121 DeepSeek-V4 kernels as the plugin sees them: their envelope and probe.

The engines call these themselves (vLLM's ``DeepseekV4FlashInferSM120Attention``, SGLang's
``flash_mla_with_kvcache_sm120``): ``flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4`` over
the 584-byte record, a window cache and a compressed cache in one call. The plugin plans them per
(layer kind, phase) from the facts packaged with it (:mod:`.flashinfer_table`, the ``dsv4``
family: FlashInfer 0.7.2 reads any page size and any top-k in its decode form), so
``mla-sm120 check`` refuses a shape before the weights load instead of at the first forward.

The public call's own rules (FlashInfer 0.7.2, ``mla/_core.py``): bf16 q of 8 / 16 / 32 / 64 / 128
heads; decode form for calls of at most ``max_num_tokens`` (64) tokens; above that the prefill
form, whose kernels exist for the table's prefill heads and need the window width to be a multiple
of its top-k tile (64). Pure Python at import.
"""

from __future__ import annotations

import importlib.util

from ..kernels.dsv4.layout import NVFP4_DSV4
from ..types import DECODE, DeviceInfo, SelectionContext
from . import flashinfer_table

FAMILY = "dsv4"
# The public call accepts these q head counts on SM120 ("Expected 8, 16, 32, 64, or 128 query heads").
API_HEADS = (8, 16, 32, 64, 128)

def _forms(ctx: SelectionContext, phase: str, max_tokens: int) -> tuple[str, ...]:
    """Which of FlashInfer's forms the calls of ``phase`` can take (decode: <= max_tokens tokens)."""
    tokens = ctx.max_tokens_for(phase)
    if phase == DECODE and tokens is not None and tokens <= max_tokens:
        return ("decode",)
    # Unbounded decode calls, and prefill calls of any length: FlashInfer picks the form per call.
    return ("decode", "prefill")


def envelope_reasons(ctx: SelectionContext, phase: str, table: flashinfer_table.EnvelopeTable | None = None) -> list[str]:
    """Why FlashInfer's DeepSeek-V4 kernels cannot serve ``phase`` of ``ctx.call`` (empty: they can).

    :param table: the envelope facts (the installed version's, else the newest packaged one).
    """
    call = ctx.call
    if call is None:
        return ["reads the DeepSeek-V4 two-cache record only"]
    if ctx.kv_cache_dtype == NVFP4_DSV4:
        return nvfp4_reasons(call.heads_for(phase), call.window_for(phase), call.window_page, call.extra,
                             call.extra_page, table)
    tab = table or flashinfer_table.table()
    decode = tab.decode.get(FAMILY)
    if decode is None:
        return [f"FlashInfer {tab.flashinfer_version}'s table has no {FAMILY} family"]
    heads = call.heads_for(phase)
    window = call.window_for(phase)
    reasons = []
    if heads not in API_HEADS:
        reasons.append(f"{heads} q heads: trtllm_batch_decode_sparse_mla_dsv4 takes {list(API_HEADS)} on SM12x")
    forms = _forms(ctx, phase, decode.max_num_tokens)
    if "decode" in forms:
        if heads > decode.max_num_heads:
            reasons.append(f"{heads} q heads > {decode.max_num_heads} (decode form)")
        if window < decode.min_topk or (call.extra and call.extra < decode.min_topk):
            reasons.append(f"index rows of {window} / {call.extra} slots, below {decode.min_topk}")
    if "prefill" in forms:
        why = ("decode calls may carry more than "
               f"{decode.max_num_tokens} tokens (FlashInfer then runs its prefill form)" if phase == DECODE
               else "prefill calls")
        if heads not in tab.prefill_heads:
            reasons.append(f"{why}: its prefill kernels exist for {sorted(tab.prefill_heads)} q heads, not {heads}")
        if window % tab.prefill_topk_tile:
            reasons.append(f"{why}: window rows of {window} slots, not a multiple of {tab.prefill_topk_tile} "
                           "(its prefill form's top-k tile)")
    return reasons


def nvfp4_reasons(heads: int, window: int, window_page: int, extra: int, extra_page: int,
                  table: flashinfer_table.EnvelopeTable | None = None) -> list[str]:
    """Why FlashInfer's NVFP4 DeepSeek-V4 kernels cannot serve a call (empty: they can).

    Their shapes are the table's ``decode_nvfp4`` family (index rows of exactly its compiled topks);
    its "sparse" route only (what the engines' call reaches): the cake route's shapes are not planned.

    :param table: the envelope facts (the installed version's, else the newest packaged one).
    """
    tab = table or flashinfer_table.table()
    config = tab.decode_nvfp4.get(FAMILY)
    if config is None:
        return [f"FlashInfer {tab.flashinfer_version}'s table has no NVFP4 {FAMILY} family"]
    counts = sorted(config.supported_num_heads())
    topks, pages = sorted(config.topks), sorted(config.extra_page_block_sizes)
    reasons = []
    if heads not in counts:
        reasons.append(f"{heads} q heads: its NVFP4 kernels take {counts}")
    if window_page != config.page_block_size:
        reasons.append(f"window pages of {window_page} entries: its NVFP4 kernels read {config.page_block_size}")
    if window not in config.topks:
        reasons.append(f"window rows of {window} slots: its NVFP4 kernels are built for {topks}")
    if extra and extra not in config.topks:
        reasons.append(f"compressed rows of {extra} slots: its NVFP4 kernels are built for {topks}")
    if extra and extra_page not in config.extra_page_block_sizes:
        reasons.append(f"compressed pages of {extra_page} entries: its NVFP4 kernels read {pages}")
    return reasons

def probe(device: DeviceInfo) -> tuple[str, ...]:
    """Why the kernels cannot run on this machine (the SM120 module's probe, then the DSv4 entry)."""
    from . import flashinfer

    reasons = tuple(flashinfer.probe())
    if reasons or importlib.util.find_spec("flashinfer") is None:
        return reasons
    try:
        from flashinfer.decode import trtllm_batch_decode_sparse_mla_dsv4  # noqa: F401
    except Exception as error:
        return (f"flashinfer has no trtllm_batch_decode_sparse_mla_dsv4 ({type(error).__name__}: {error}); "
                f"pip install 'flashinfer-python>={flashinfer.MIN_VERSION}'",)
    return ()
