"""vLLM 0.33's nvfp4_ds_mla cache (352-byte rows) through the CUSTOM backend, on the CPU: the
selector's validate_configuration, the KV cache spec vLLM derives for the layer, and forward_mqa
with vLLM's own metadata builder on an NVFP4 cache against float64 attention over the rows as
tests/support/layout_oracle.py decodes them."""

from __future__ import annotations

import pytest
import torch
from support.layout_oracle import decode_cache
from support.model_configs import write_model
from support.oracle import sparse_attention
from support.vllm_engine import (build_metadata, common_metadata, kv_cache_spec, logical_to_rows, logical_topk, make_impl,
                                 make_vllm_config, selector_kwargs)

from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, decide
from mla_sm120_plugin.kernels.dsa import pack
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON

NV = "nvfp4_ds_mla"
HEADS, TOPK, PAGE, STRIDE_ROWS, NUM_BLOCKS = 5, 100, 64, 128, 12
Q_LENS = [1, 1, 5, 3]
SEQ_LENS = [70, 130, 5, 66]
BLOCK_TABLE = [[3, 7, 0], [1, 2, 9], [5, 0, 0], [4, 6, 0]]
SCALE = (192 + 64) ** -0.5
# Triton (interpreter, fp32 dots) and the reference against float64, bf16 output of unit-scale data:
# the output's bf16 rounding (2**-8 of |out| <= ~3) dominates.
OUT_ATOL = 2e-2


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_validate_configuration_accepts_nvfp4_on_sm12x(tmp_path, kind, cap):
    from vllm.config import set_current_vllm_config

    vc = make_vllm_config(write_model(tmp_path, kind, heads=HEADS), cache_dtype=NV, enforce_eager=True)
    with set_current_vllm_config(vc):
        assert MlaSm120Backend.validate_configuration(**selector_kwargs(NV, cap)) == []
    decision = decide(vc, NV, *cap)
    assert decision.context.kv_cache_dtype == NV
    assert set(decision.kernels.values()) <= {TRITON, TORCH}


def test_validate_configuration_refuses_nvfp4_on_sm90_naming_vllms_own_path(tmp_path):
    from vllm.config import set_current_vllm_config

    vc = make_vllm_config(write_model(tmp_path, "glm", heads=HEADS), cache_dtype=NV, enforce_eager=True)
    with set_current_vllm_config(vc), pytest.raises(UnsupportedConfiguration) as err:
        MlaSm120Backend.validate_configuration(**selector_kwargs(NV, (9, 0)))
    msg = str(err.value)
    for part in ("kv_cache_dtype=nvfp4_ds_mla", "sm_90", "supported:", "fix:", "FLASHMLA_SPARSE",
                 "nvfp4_ds_mla on SM100 only", "--kv-cache-dtype fp8_ds_mla"):
        assert part in msg, (part, msg)


def test_rope_less_model_is_refused_with_the_reason(tmp_path):
    from vllm.config import set_current_vllm_config

    vc = make_vllm_config(write_model(tmp_path, "glm53", heads=8), cache_dtype=NV, enforce_eager=True)
    with set_current_vllm_config(vc), pytest.raises(UnsupportedConfiguration) as err:
        MlaSm120Backend.validate_configuration(**selector_kwargs(NV, (12, 1), head_size=512))
    msg = str(err.value)
    assert "rope-less model (GLM-5.3-Flash) has no nvfp4 writer" in msg and "fix: pass --kv-cache-dtype fp8_ds_mla" in msg


def test_kv_cache_spec_is_352_bytes_a_token(tmp_path):
    """vLLM's MLAAttention.get_kv_cache_spec sizes the rows by the dtype's name; the backend's
    customize_spec keeps them: a 64-token block is 64 x 352 bytes, fp8_ds_mla's 64 x 656."""
    for kv, row in ((NV, 352), ("fp8_ds_mla", 656)):
        vc = make_vllm_config(write_model(tmp_path / kv, "glm", heads=HEADS), cache_dtype=kv, enforce_eager=True)
        spec = kv_cache_spec(vc, kv, TOPK)
        assert spec.state_content_bytes == row and spec.dtype == torch.uint8
        assert spec.real_page_size_bytes == spec.block_size * row, (kv, spec)


def test_forward_mqa_on_an_nvfp4_cache_matches_float64(tmp_path, cpu_vllm):
    gen = torch.Generator().manual_seed(17)
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS), cache_dtype=NV,
                          enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": TRITON, "prefill_kernel": TORCH}})
    impl = make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype=NV, scale=SCALE, load_device="cpu")
    assert impl.kv_layout == NV and impl.decision.decode == TRITON and impl.decision.prefill == TORCH
    md = build_metadata(vc, NV, TOPK, common_metadata(Q_LENS, SEQ_LENS, BLOCK_TABLE, page=PAGE,
                                                      stride_rows=STRIDE_ROWS))
    assert (md.num_decode_tokens, md.num_prefills) == (2, 2)

    # Tokens of per-token magnitudes, written as vLLM's writer writes them; pages 128 rows apart.
    latent = torch.randn(NUM_BLOCKS * STRIDE_ROWS, 576, generator=gen)
    latent *= torch.exp2(torch.randint(-3, 3, (latent.shape[0], 1), generator=gen).float())
    rows = pack.pack(latent, NV)
    backing = rows.view(NUM_BLOCKS, STRIDE_ROWS, 352)
    kv_cache = backing[:, :PAGE]  # [blocks, 64, 352], block stride 128 rows

    n = sum(Q_LENS)
    logical = logical_topk(gen, Q_LENS, SEQ_LENS, TOPK)
    impl.topk_indices_buffer[:n] = logical
    ql_nope = torch.randn(HEADS, n, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(n, HEADS, 64, generator=gen).to(torch.bfloat16)
    out, lse = impl.forward_mqa((ql_nope, q_pe), kv_cache, md, layer=None)

    assert lse is None and out.shape == (n, HEADS, 512) and out.dtype == torch.bfloat16
    keys = decode_cache(backing, NV)  # [blocks * 128, 576] float64, by the oracle
    q = torch.cat([ql_nope, q_pe], dim=-1).double()
    want, _ = sparse_attention(q, keys, logical_to_rows(logical, Q_LENS, BLOCK_TABLE, PAGE, STRIDE_ROWS), SCALE)
    err = (out.double() - want).abs().max().item()
    assert err <= OUT_ATOL * max(1.0, want.abs().max().item()), err
