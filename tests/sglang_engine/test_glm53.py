"""GLM-5.3-Flash (rope-less sparse MLA) through SGLang 0.5.23's own code on the CPU.

SGLang alone has no fp8 path for it on SM12x (trtllm, which does not run there; its kpool guard
allows fa3/tilelang/trtllm only). With the plugin, the launcher routes both phases to the call site
the plugin serves, SGLang's pool packs 528-byte rows, and the kernels read SGLang's 2051-wide
token-slot rows. Expected values: float64 attention (tests/support/oracle.py) over the rows as
tests/support/layout_oracle.py decodes the bytes SGLang's own writer produced.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from support.layout_oracle import decode_cache
from support.model_configs import write_model
from support.oracle import sparse_attention
from support.sglang_launch import resolve, server_args
from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate
from sglang.srt.arg_groups import overrides
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mla_sm120_plugin.context import context_from_json
from mla_sm120_plugin.integration import sglang as plugin
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON

HEADS, PAGES, WIDTH = 8, 4, 2051  # 256 slots; 2048 + kpool 4 - 1 ids a row


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_the_plugin_serves_it_where_sglang_alone_sends_it_to_trtllm(tmp_path, capability, monkeypatch, cap):
    capability(*cap)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "glm53mm", heads=HEADS)
    sa = server_args(model, kv_cache_dtype="fp8_e4m3")
    alone = overrides._dsa_split_backend_resolution.__wrapped__(
        overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa)))
    assert alone == {"dsa_prefill_backend": "trtllm", "dsa_decode_backend": "trtllm"}
    assert resolve(model, kv_cache_dtype="fp8_e4m3") == (dsa.ROUTE, dsa.ROUTE)
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert (ctx.model_arch, ctx.kv_cache_dtype, ctx.index_topk, ctx.qk_rope_head_dim, ctx.kv_scale_format) == (
        "Glm5NextForConditionalGeneration", "fp8_nope", WIDTH, 0, "arbitrary")


def test_without_the_opt_in_sglang_resolves_it_alone(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.delenv(names.ENABLE_ENV)
    model = write_model(tmp_path, "glm53mm", heads=HEADS)
    sa = server_args(model, kv_cache_dtype="fp8_e4m3")
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    assert overrides._dsa_split_backend_resolution(view) == overrides._dsa_split_backend_resolution.__wrapped__(view)


def test_sglangs_kpool_guard_lets_the_routed_call_site_through(monkeypatch):
    backend = types.SimpleNamespace(dsa_index_kpool=4, dsa_kv_cache_store_fp8=True)
    ids = torch.zeros(1, WIDTH, dtype=torch.int32)
    DeepseekSparseAttnBackend._check_kpool_tail_backend(backend, ids, dsa.ROUTE, "decode")  # no raise
    monkeypatch.delenv(names.ENABLE_ENV)
    with pytest.raises(NotImplementedError, match="index_kpool > 1"):
        DeepseekSparseAttnBackend._check_kpool_tail_backend(backend, ids, dsa.ROUTE, "decode")


def _slots(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's rows at the call: token slots, valid entries first (history picks, then the tail),
    -1 after; one out of range; a duplicate."""
    lengths = torch.randint(4, 60, (num_tokens,), generator=gen, dtype=torch.int32)
    ids = torch.full((num_tokens, WIDTH), -1, dtype=torch.int32)
    for t in range(num_tokens):
        ids[t, : lengths[t]] = torch.randperm(PAGES * 64, generator=gen)[: lengths[t]].int()
    ids[0, 1] = ids[0, 0]
    ids[1, 2] = PAGES * 64 + 9
    return ids, lengths


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("entry, mode", [("forward_decode", ForwardMode.DECODE), ("forward_extend", ForwardMode.EXTEND)])
def test_a_forward_through_sglangs_call_site_matches_float64(tmp_path, capability, monkeypatch, kv, entry, mode):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, f'{{"prefill_kernel": "{TORCH}", "decode_kernel": "{TRITON}"}}')
    resolve(write_model(tmp_path, "glm53mm", heads=HEADS), kv_cache_dtype=kv, disable_cuda_graph=True)
    gen = torch.Generator().manual_seed(5)
    latent = (torch.randn(PAGES * 64, 512, generator=gen) * 2).to(torch.bfloat16)
    if kv == "fp8_e4m3":
        nope, _ = quantize_k_cache_separate(latent, None)  # SGLang's own writer: 512 fp8 + 4 fp32 scales
        rows, layout_name = nope.reshape(PAGES * 64, -1).view(torch.uint8), "fp8_nope"
        cache = rows.view(torch.float8_e4m3fn).view(-1, 1, rows.shape[-1])
    else:
        rows, layout_name = latent, "bf16_nope"
        cache = latent.view(-1, 1, 512)
    assert rows.shape[-1] == (528 if kv == "fp8_e4m3" else 512)
    num_tokens = 5
    q = torch.randn(num_tokens, HEADS, 512, generator=gen).to(torch.bfloat16)
    ids, lengths = _slots(num_tokens, gen)
    backend = types.SimpleNamespace(workspace_buffer=torch.empty(0, dtype=torch.uint8), physical_page_size=64,
                                    kv_cache_dim=rows.shape[-1], qk_nope_head_dim=256, kv_lora_rank=512,
                                    qk_rope_head_dim=0)

    def sglang_forward(*_args, **_kwargs):
        return DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla(
            backend, q_all=q, kv_cache=cache, page_table_1=ids, seq_lens=lengths, sm_scale=256**-0.5,
            skip_softmax_threshold_scale_factor=None)

    out = getattr(dsa, f"around_{entry}")(sglang_forward, None, q, None, None, None,
                                             types.SimpleNamespace(forward_mode=mode))
    assert out.shape == (num_tokens, HEADS, 512)
    expected, _ = sparse_attention(q, decode_cache(rows, layout_name), ids, 256**-0.5, topk_length=lengths)
    err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-2, err
