"""Decode context parallelism under SGLang 0.5.23 (``--dcp-size N``): SGLang's pieces, translated for the home.

SGLang shards a DSA cache by slot (rank ``slot % N`` keeps token ``slot`` at its own ``slot // N``);
its indexer cache is replicated, so every rank picks the same top-k. Under DCP its model gathers the
DCP group's query heads (rank order), every DSA call (prefill, decode, target-verify) returns
``(out, lse)`` over the tokens this rank keeps, and ``cp_lse_ag_out_rs_mla`` / ``dcp_a2a_lse_reduce``
merge the ranks by their LSE and scatter the heads back. SGLang does this only through TRT-LLM's
kernels (SM100); with ``--mla-sm120`` the plugin's kernel for the phase serves it:

- :func:`rank_share` (from :func:`.dsa.around_call`): reads SGLang's DCP size and rank off its backend,
  turns the call's slots into this rank's with SGLang's own ``localize_dcp_page_table`` (owned first,
  -1 after, and their counts; cached across the layers that share a top-k, as SGLang's own path does),
  checks once that SGLang's merge reads the LSE base the plan proved (``is_mla_dcp_lse_base_on_e``),
  and hands the call to the one home, :func:`mla_sm120_plugin.dispatch.dcp.rank_share` (the sink rule,
  the LSE asked of the kernel in that base).
- :func:`around_model_overrides` (AROUND ``_invoke_provider``, the launcher): SGLang refuses HY V4
  under DCP for want of a single owner of its sinks; with the plugin enabled it runs SGLang's
  DeepSeek-family declarations as for ``--dcp-size 1`` plus its DSA DCP declarations (and their
  refusals: HiSparse, HiCache, PD disaggregation, ``--speculative-eagle-topk`` > 1) for the real size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from ...dispatch import dcp
from ...engines import lookup
from ...errors import UnsupportedConfiguration, format_error
from .names import enabled

PROVIDER = "sglang.srt.arg_groups.overrides._invoke_provider"
FAMILY_OVERRIDES = "sglang.srt.arg_groups.model_overrides.deepseek_v2._deepseek_family_overrides"
DCP_OVERRIDES = "sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides"
LOCALIZE = "sglang.srt.layers.attention.dsa.dsa_dcp.localize_dcp_page_table"
LSE_BASE = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla.is_mla_dcp_lse_base_on_e"
BACKEND_NAME = "dsa"  # the attention backend SGLang's DSA backend is registered as (its merge's LSE base)
SINK_ARCHS = ("HYV4ForCausalLM", "HYV4ForCausalLMNextN")  # SGLang refuses these under --dcp-size > 1


@dataclass(frozen=True)
class Site:
    """Where a DSA call comes from: SGLang's backend, the attention layer and the top-k ids of the
    forward (``forward_decode`` / ``forward_extend``'s arguments; None where not given)."""

    backend: Any = None
    layer: Any = None
    topk_indices: Any = None

    @property
    def size(self) -> int:
        """The DCP size SGLang's backend runs at (its ``dcp_size``, from ``get_parallel()``)."""
        return int(getattr(self.backend, "dcp_size", 1) or 1)


@functools.cache
def _resolve(name: str) -> Any:
    """SGLang's function of that dotted name (resolved once: it is on every DCP call's path)."""
    import pkgutil

    return pkgutil.resolve_name(name)


@functools.cache
def _merge_base_checked() -> None:
    """SGLang's merge reads the LSE base the plan proved (once a process).

    :raises UnsupportedConfiguration: it does not (an SGLang whose DSA merge changed base).
    """
    engine = lookup("sglang")
    on_e = bool(_resolve(LSE_BASE)(BACKEND_NAME))
    if on_e != engine.dcp.lse_base_on_e:
        raise UnsupportedConfiguration(format_error(
            f"SGLang's is_mla_dcp_lse_base_on_e({BACKEND_NAME!r}) = {on_e}: its DCP merge reads another LSE base",
            f"the base the plugin's plan and self-check use for {engine.versioned}: {engine.dcp.lse_base}",
            "run the SGLang release the plugin supports, or --dcp-size 1"))


def rank_share(call: Callable[..., Any], site: Site, q: Any, indices: Any, sink: Any) -> tuple[Any, Any]:
    """This rank's share of a DSA call under DCP, as SGLang's merge takes it.

    :param call: the bound kernel on this rank's cache, ``call(q, slots, topk_length, **contract)``.
    :param site: SGLang's backend (``dcp_size``, ``dcp_rank``, ``_dcp_page_table_cache``,
        ``forward_metadata``), the layer (``layer_id``) and the forward's top-k ids.
    :param q: [T, H x N, D] bfloat16, the DCP group's heads gathered in rank order.
    :param indices: [T, K] int32 global slots, -1 padded (SGLang's page table for the call).
    :param sink: [H] float32 sink logits of this rank's heads (HY V4), or None.
    :returns: (out [T, H x N, 512] bfloat16, lse [T, H x N] float32 in the base SGLang's merge reads;
        a row with no id this rank keeps: out 0, lse -inf, or the sink on its own heads).
    """
    _merge_base_checked()
    backend = site.backend
    rank = dcp.DcpRank.of(lookup("sglang"), site.size, backend.dcp_rank)
    local, counts = _resolve(LOCALIZE)(
        backend._dcp_page_table_cache, metadata=backend.forward_metadata, layer_id=site.layer.layer_id,
        topk_indices=site.topk_indices, page_table=indices, dcp_size=rank.size, dcp_rank=rank.rank)
    return dcp.rank_share(call, q, local, counts, rank=rank, sinks=sink)


def around_model_overrides(original_fn: Callable[..., dict], fn: Callable[..., dict], server_args: Any, hf_config: Any,
                           *args: Any, **kwargs: Any) -> dict:
    """AROUND ``_invoke_provider``: HY V4 under ``--dcp-size`` > 1 gets SGLang's declarations, not its refusal."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if not enabled() or fn is not _resolve(FAMILY_OVERRIDES) or arch not in SINK_ARCHS:
        return original_fn(fn, server_args, hf_config, *args, **kwargs)
    from sglang.srt.arg_groups.model_override_base import resolving_view

    from .translate import record_copy

    view = resolving_view(server_args)
    if int(getattr(view, "dcp_size", 1) or 1) <= 1:
        return original_fn(fn, server_args, hf_config, *args, **kwargs)
    # SGLang's DeepSeek-family provider reads --dcp-size only to refuse HY V4 and for its DSA DCP
    # declarations: run it on a copy of the record at --dcp-size 1 (the record untouched), then add
    # those declarations for the real size, refusals included.
    clone = record_copy(server_args)
    clone.dcp_size = 1
    declared = dict(original_fn(fn, clone, hf_config, *args, **kwargs))
    declared.update(_resolve(DCP_OVERRIDES)(view))
    return declared


HOOKS: dict[str, Callable[..., Any]] = {PROVIDER: around_model_overrides}  # the launcher's, AROUND
