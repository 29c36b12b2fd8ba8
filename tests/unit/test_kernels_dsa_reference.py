"""The kernels' ``topk_length`` contract, pinned from both sides (the docstring of
``mla_sm120_plugin/kernels/dsa/reference.py``): the tests' float64 sparse attention
(tests/support/oracle.py, the first min(topk_length[t], topk) candidates less -1 and out-of-range slots)
against the reference kernel at, above and far above top-k, and at 0.
"""

from __future__ import annotations

import torch

from support.oracle import sparse_attention

from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla


# --- the kernels' topk_length contract --------------------------------------------------------------


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
    ref_out, ref_lse = sparse_attention(q, keys.double(), indices, 0.05, topk_length=lengths)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5 * ref_out.abs().max().item(), rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not finite[5].any()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
