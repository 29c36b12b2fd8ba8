"""The impl's forward_mqa on the CPU, inside real vLLM objects.

vLLM's own metadata builder turns a real CommonAttentionMetadata (2 decode requests, 2 prefill
requests) into the metadata forward_mqa reads; decode rows run the Triton kernel (interpreter),
prefill rows the torch reference. The result is checked against float64 attention
(tests/support/oracle.py) over the rows the cache's bytes hold (tests/support/layout_oracle.py), on a
cache whose pages sit 128 rows apart (vLLM interleaves other layers' pages), with 5 heads and an index
top-k of 100 (not a multiple of 64).
"""

from __future__ import annotations

import pytest
import torch
from support.layout_oracle import decode_cache
from support.model_configs import write_model
from support.oracle import sparse_attention
from support.vllm_engine import (build_metadata, common_metadata, logical_to_rows, logical_topk, make_impl,
                                 make_vllm_config)

from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON
from mla_sm120_plugin.kernels.dsa.pack import pack_bf16, quantize_fp8_ds_mla

HEADS, TOPK, PAGE, STRIDE_ROWS, NUM_BLOCKS = 5, 100, 64, 128, 12
Q_LENS = [1, 1, 5, 3]  # decodes first, as vLLM reorders them
SEQ_LENS = [70, 130, 5, 66]
BLOCK_TABLE = [[3, 7, 0], [1, 2, 9], [5, 0, 0], [4, 6, 0]]
# Triton (interpreter, fp32 accumulate) and the reference against float64 on unit-scale data.
OUT_ATOL = 2e-2


def _dense_expected(q, cache_rows_f64, logical, scale) -> torch.Tensor:
    """docs/facts.md#sparse-mla-semantics per token, in float64 (tests/support/oracle.py), straight from
    block table and logical positions."""
    ids = logical_to_rows(logical, Q_LENS, BLOCK_TABLE, PAGE, STRIDE_ROWS)
    return sparse_attention(q, cache_rows_f64, ids, scale)[0]


@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "bfloat16"])
def test_forward_mqa_mixed_batch_matches_dense_math(tmp_path, cpu_vllm, kv_dtype):
    gen = torch.Generator().manual_seed(0)
    model = write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS)
    vc = make_vllm_config(model, cache_dtype=kv_dtype, enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": TRITON, "prefill_kernel": TORCH}})
    layout_width = 656 if kv_dtype == "fp8_ds_mla" else 576
    scale = (192 + 64) ** -0.5
    # Built as vLLM builds it (bf16 default dtype, the load device), on the CPU where it then runs.
    impl = make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype=kv_dtype, scale=scale, load_device="cpu")
    topk_buffer = impl.topk_indices_buffer
    md = build_metadata(vc, kv_dtype, TOPK, common_metadata(Q_LENS, SEQ_LENS, BLOCK_TABLE, page=PAGE,
                                                            stride_rows=STRIDE_ROWS))
    assert impl.decision.decode == TRITON and impl.decision.prefill == TORCH
    # Our builder counts only true decodes as decode rows: the 5- and 3-token prefills are prefill.
    assert (md.num_decode_tokens, md.num_prefills) == (2, 2)

    # The cache: pages 128 rows apart in one allocation, as vLLM lays out interleaved layers.
    latent = torch.randn(NUM_BLOCKS * STRIDE_ROWS, 576, generator=gen)
    if kv_dtype == "fp8_ds_mla":
        rows = quantize_fp8_ds_mla(latent, "arbitrary")
    else:
        rows = pack_bf16(latent)
    rows_f64 = decode_cache(rows, "fp8_ds_mla" if kv_dtype == "fp8_ds_mla" else "bf16")  # the bytes' own values
    backing = rows.view(NUM_BLOCKS, STRIDE_ROWS, layout_width)
    kv_cache = backing[:, :PAGE]  # [blocks, 64, C], block stride 128 rows
    assert kv_cache.stride(0) == STRIDE_ROWS * layout_width

    n = sum(Q_LENS)
    logical = logical_topk(gen, Q_LENS, SEQ_LENS, TOPK)
    topk_buffer[:n] = logical
    ql_nope = torch.randn(HEADS, n, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)  # strided, as vLLM
    q_pe = torch.randn(n, HEADS, 64, generator=gen).to(torch.bfloat16)
    out, lse = impl.forward_mqa((ql_nope, q_pe), kv_cache, md, layer=None)

    assert lse is None and out.shape == (n, HEADS, 512) and out.dtype == torch.bfloat16
    expected = _dense_expected(torch.cat([ql_nope, q_pe], dim=-1).float(), rows_f64, logical, scale)
    err = (out.double() - expected).abs().max().item()
    assert err <= OUT_ATOL, f"max abs error {err} > {OUT_ATOL}"
