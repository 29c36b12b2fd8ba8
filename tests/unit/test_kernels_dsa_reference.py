"""The kernels' ``topk_length`` contract, pinned from both sides (the docstring of
``mla_sm120_plugin/kernels/dsa/reference.py``): sparse attention written from the contract, in
float64, against the reference kernel at, above and far above top-k, and at 0.
"""

from __future__ import annotations

import math

import torch

from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla


# --- the kernels' topk_length contract --------------------------------------------------------------


def _attention_float64(q, keys, indices, sm_scale, lengths):
    """Sparse attention written from the contract in kernels/__init__.py, in float64, one row at a
    time: the first min(topk_length[t], topk) candidates, minus -1 and out-of-range slots."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, 512, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        used = [int(s) for s in indices[t, : max(0, min(int(lengths[t]), indices.shape[1]))]]
        used = [s for s in used if 0 <= s < keys.shape[0]]
        if not used:
            continue
        k = keys[used]  # [n, 576]
        scores = (q[t].double() @ k.T) * sm_scale  # [H, n]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ k[:, :512]
    return out, lse


def test_topk_length_above_topk_is_clamped_to_topk():
    """kernels/__init__.py: "only the first topk_length[t] candidates are used"; a length above top-k
    uses the whole row (clamped), never reads past it; 0 gives out = 0 and lse = -inf."""
    gen = torch.Generator().manual_seed(18)
    slots, topk, heads = 128, 12, 3
    keys = torch.randn(slots, 576, generator=gen).to(torch.bfloat16)  # the bf16 layout: exact values
    cache = keys.view(2, 64, 576)
    q = torch.randn(6, heads, 576, generator=gen)
    indices = torch.randint(0, slots, (6, topk), generator=gen, dtype=torch.int32)
    indices[1, 3] = -1
    indices[2, 0] = slots + 7  # out of range: masked
    lengths = torch.tensor([topk + 1, topk + 50, 2**31 - 1, topk, 5, 0], dtype=torch.int32)
    out, lse = torch_sparse_mla(q, cache, indices, sm_scale=0.05, kv_layout="bf16", topk_length=lengths,
                                return_lse=True)
    ref_out, ref_lse = _attention_float64(q, keys.double(), indices, 0.05, lengths)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5 * ref_out.abs().max().item(), rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not finite[5].any()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
