"""HY V4 (Hy4-preview) through SGLang 0.5.23 with ``--mla-sm120``: the sink reaches the plugin's kernel.

SGLang resolves a model with ``learnable_sink`` to a bfloat16 cache (``_dsa_kv_cache_dtype_default``,
before any plugin sees it) and would serve its sinks only with flashmla_sparse (SM90a / SM100f): its
``forward_decode`` / ``forward_extend`` refuse an ``attn_sink`` for any other DSA impl. With the
opt-in the launcher plans with the sinks, the hooked entry points take the ``attn_sink`` keyword
SGLang's ``forward_mla`` passes them, and SGLang's own call site (``_forward_flashinfer_sparse_mla``,
called unbound as in tests/sglang_engine/test_forward.py) reaches the plugin's kernel with it; the
output matches float64 attention with the sink in the denominator.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from support.model_configs import write_model
from support.oracle import sparse_attention
from sglang.srt.arg_groups import overrides
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.integration.sglang import dsa, names, translate
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsa import layout

HEADS, TOPK, PAGES = 16, 64, 4


def _launch(tmp_path, capability, monkeypatch, kv: str = "auto") -> ServerArgs:
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, f'{{"prefill_kernel": "{TORCH}", "decode_kernel": "{TRITON}"}}')
    sa = ServerArgs(model_path=write_model(tmp_path, "hyv4", index_topk=TOPK, heads=HEADS,
                                           layer_types=["deepseek_sparse_attention"] * 2),
                    skip_tokenizer_init=True, kv_cache_dtype=kv, disable_cuda_graph=True)
    overrides.run_post_process_pass(sa, overrides._dsa_kv_cache_dtype_default)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)
    return sa


def _call(entry, mode, q, cache, slots, lengths, sm_scale, sink):
    backend = types.SimpleNamespace(  # the attributes SGLang's call site reads from its backend
        workspace_buffer=torch.empty(0, dtype=torch.uint8), physical_page_size=layout.PAGE_SIZE,
        kv_cache_dim=layout.HEAD_DIM, qk_nope_head_dim=192, kv_lora_rank=layout.KV_LORA_RANK,
        qk_rope_head_dim=layout.ROPE_DIM)
    seen: dict = {}

    def sglang_forward(*_args, **kwargs):  # the body below SGLang's sink guard, past the hook
        seen.update(kwargs)
        return DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla(
            backend, q_all=q, kv_cache=cache, page_table_1=slots, seq_lens=lengths, sm_scale=sm_scale,
            skip_softmax_threshold_scale_factor=None)

    batch = types.SimpleNamespace(forward_mode=mode)
    out = getattr(dsa, f"around_{entry}")(sglang_forward, None, q, None, None, None, batch, attn_sink=sink)
    assert "attn_sink" not in seen  # SGLang's guard never sees it (it would refuse flashinfer_sparse_mla)
    return out


@pytest.mark.parametrize("entry, mode", [("forward_decode", ForwardMode.DECODE),
                                         ("forward_extend", ForwardMode.EXTEND)])
def test_the_sink_reaches_the_plugins_kernel_in_both_phases(tmp_path, capability, monkeypatch, entry, mode):
    _launch(tmp_path, capability, monkeypatch)
    ctx = translate.imported("decision", "resolving the DSA backends")["dsa"]
    # auto resolved by SGLang's own rule for learnable sinks (a bfloat16 cache), then planned with them
    assert ctx.sinks and ctx.kv_cache_dtype == layout.BF16
    gen = torch.Generator().manual_seed(11)
    cache = (torch.randn(PAGES * layout.PAGE_SIZE, 1, layout.HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    num_tokens = 4
    q = torch.randn(num_tokens, HEADS, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(PAGES * layout.PAGE_SIZE, generator=gen)[:TOPK]
                         for _ in range(num_tokens)]).to(torch.int32)
    lengths = torch.full((num_tokens,), TOPK, dtype=torch.int32)
    sm_scale = 1 / math.sqrt(192 + 64)  # HY V4's: qk_head_dim ** -0.5
    sink = torch.randn(HEADS, generator=gen) + math.log(TOPK)  # near the LSE: a real share of the weight
    sink[3] = float("-inf")
    out = _call(entry, mode, q, cache, slots, lengths, sm_scale, sink)
    keys = cache.view(-1, layout.HEAD_DIM).double()
    truth, _ = sparse_attention(q, keys, slots, sm_scale, topk_length=lengths, sink=sink)
    assert EXACT_CLASS_BOUND.violations(measure(out, truth)) == [], measure(out, truth)
    without, _ = sparse_attention(q, keys, slots, sm_scale, topk_length=lengths)  # the sink dropped
    assert measure(without, truth).rel_rms > 0.01


def test_a_call_without_the_sink_for_a_sink_model_is_refused(tmp_path, capability, monkeypatch):
    _launch(tmp_path, capability, monkeypatch)
    q = torch.zeros(1, HEADS, layout.HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(PAGES * layout.PAGE_SIZE, 1, layout.HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.zeros(1, TOPK, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="without attention sinks for a model planned with them"):
        _call("forward_decode", ForwardMode.DECODE, q, cache, slots, None, 0.1, None)
