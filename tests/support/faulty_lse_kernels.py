"""Third-party kernels whose output is right and whose LSE is not: each the torch reference with one of the
LSE faults FlashInfer's own conventions invite (tests/dispatch/test_selfcheck_dcp.py registers them through
the plugin's ``mla_sm120_kernels`` hook, exactly as an installed plugin would).

- :func:`lse_in_base_2`: the LSE in base 2 whatever base is asked (FlashInfer's native base);
- :func:`sink_always_in_lse`: the sink counted in the LSE on every call, asked or not (FlashInfer's
  native habit);
- :func:`nan_for_an_empty_row`: NaN where a row has nothing valid (a sink taken back out of an LSE that
  rounded below it);
- :func:`ignores_topk_length`: every id of a row read, whatever ``topk_length`` says;
- :func:`honest`: the reference itself, the alternate the engine falls back to.

Each is served where no LSE is read and the call passes no lengths (vLLM without DCP), and caught at init
where one is (DCP).
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla


def honest(q, kv_cache, indices, **kwargs):
    return torch_sparse_mla(q, kv_cache, indices, **kwargs)


def lse_in_base_2(q, kv_cache, indices, *, lse_base="e", **kwargs):
    return torch_sparse_mla(q, kv_cache, indices, lse_base="2", **kwargs)


def sink_always_in_lse(q, kv_cache, indices, *, lse_with_sink=False, **kwargs):
    return torch_sparse_mla(q, kv_cache, indices, lse_with_sink=True, **kwargs)


def nan_for_an_empty_row(q, kv_cache, indices, *, return_lse=False, **kwargs):
    if not return_lse:
        return torch_sparse_mla(q, kv_cache, indices, **kwargs)
    out, lse = torch_sparse_mla(q, kv_cache, indices, return_lse=True, **kwargs)
    free = torch_sparse_mla(q, kv_cache, indices, return_lse=True,
                            **{**kwargs, "out": None, "lse_with_sink": False})[1]  # [T, H], -inf: nothing valid
    return out, torch.where(torch.isneginf(free), torch.full_like(lse, float("nan")), lse)


def ignores_topk_length(q, kv_cache, indices, *, topk_length=None, **kwargs):
    return torch_sparse_mla(q, kv_cache, indices, **kwargs)


FAULTY = ("lse_in_base_2", "sink_always_in_lse", "nan_for_an_empty_row", "ignores_topk_length")
