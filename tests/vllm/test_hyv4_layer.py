"""HY V4 (Hy4-preview) in vLLM with and without ``--attention-backend CUSTOM``, built on the CPU.

vLLM's own ``HYV4MLAAttention`` is built as ``HYV4DecoderLayer`` builds it (a real ``VllmConfig``
for a tiny hy_v4 config.json, vLLM's distributed state for one rank, the platform reading as SM
12.0): its ``_resolve_sink_backend`` keeps the selected backend only if it ``supports_sink()``, else
tries its FLASHMLA_SPARSE sink subclass (SM90 / SM100 only), else loads the sink and disables it.
With the opt-in the plugin's backend is kept and its impl holds the layer's own sink parameter;
without it the sink is disabled on SM12x. The forward goes through the impl's ``forward_mqa`` with
vLLM's metadata builder (tests/vllm/test_forward.py's batch), sinks loaded after construction as
vLLM's weight loader fills them, against float64 attention with the sink in the denominator.
"""

from __future__ import annotations


import pytest
import torch
from support.layout_oracle import decode_cache
from support.model_configs import write_model
from support.oracle import sparse_attention
from support.vllm_engine import (build_metadata, common_metadata, construction_context, logical_to_rows, logical_topk,
                                 make_impl, make_vllm_config, one_rank as vllm_one_rank, sm120_pick)

from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsa.pack import quantize_fp8_ds_mla

from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402

HEADS, TOPK, PAGE, STRIDE_ROWS, NUM_BLOCKS = 5, 100, 64, 128, 12
Q_LENS = [1, 1, 5, 3]  # decodes first, as vLLM reorders them
SEQ_LENS = [70, 130, 5, 66]
BLOCK_TABLE = [[3, 7, 0], [1, 2, 9], [5, 0, 0], [4, 6, 0]]
SCALE = (192 + 64) ** -0.5  # HY V4's softmax scale: qk_head_dim ** -0.5


def _model_dir(tmp_path, heads=HEADS, topk=TOPK) -> str:
    return write_model(tmp_path, "hyv4", index_topk=topk, heads=heads,
                       layer_types=["deepseek_sparse_attention"] * 2)


def _dense_expected(q, rows_f64, logical, scale, sinks) -> torch.Tensor:
    """Float64 attention per token over its candidates (tests/support/oracle.py), the sink one more logit
    in the denominator (docs/facts.md#sparse-mla-semantics); ``sinks`` None: none."""
    ids = logical_to_rows(logical, Q_LENS, BLOCK_TABLE, PAGE, STRIDE_ROWS)
    return sparse_attention(q, rows_f64, ids, scale, sink=sinks)[0]


@pytest.mark.parametrize("decode_kernel", [TRITON, TORCH])
def test_the_impl_applies_the_layers_sinks_in_both_phases(tmp_path, cpu_vllm, decode_kernel):
    """Decode rows on the Triton kernel (interpreter) or the reference, prefill rows on the reference;
    the sinks are vLLM's own parameter (make_attention_sink: -inf at construction), filled in place
    afterwards as its weight loader does: the impl must read the parameter, not a copy."""
    from vllm.model_executor.model_loader.weight_utils import make_attention_sink

    gen = torch.Generator().manual_seed(3)
    vc = make_vllm_config(_model_dir(tmp_path), cache_dtype="fp8_ds_mla", enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": decode_kernel, "prefill_kernel": TORCH}})
    with construction_context(vc, "cpu"):
        sinks = make_attention_sink(HEADS, torch.float32)
    impl = make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype="fp8_ds_mla", scale=SCALE, load_device="cpu",
                     sinks=sinks)
    assert impl.decision.context.sinks and impl._mla_sm120_sinks is sinks
    loaded = torch.randn(HEADS, generator=gen) + 4.0  # about the rows' LSE: a sink takes a real share
    loaded[1] = float("-inf")
    sinks.data.copy_(loaded)  # the checkpoint's values arrive after the impl exists

    latent = torch.randn(NUM_BLOCKS * STRIDE_ROWS, 576, generator=gen)
    rows = quantize_fp8_ds_mla(latent, "arbitrary")
    rows_f64 = decode_cache(rows, "fp8_ds_mla")  # the bytes' own values
    kv_cache = rows.view(NUM_BLOCKS, STRIDE_ROWS, 656)[:, :PAGE]
    n = sum(Q_LENS)
    logical = logical_topk(gen, Q_LENS, SEQ_LENS, TOPK)
    impl.topk_indices_buffer[:n] = logical
    md = build_metadata(vc, "fp8_ds_mla", TOPK, common_metadata(Q_LENS, SEQ_LENS, BLOCK_TABLE, page=PAGE,
                                                                stride_rows=STRIDE_ROWS))
    ql_nope = torch.randn(HEADS, n, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(n, HEADS, 64, generator=gen).to(torch.bfloat16)
    out, _ = impl.forward_mqa((ql_nope, q_pe), kv_cache, md, layer=None)

    q = torch.cat([ql_nope, q_pe], dim=-1).float()
    truth = _dense_expected(q, rows_f64, logical, SCALE, loaded)
    assert EXACT_CLASS_BOUND.violations(measure(out, truth)) == [], measure(out, truth)
    # What vLLM runs on SM12x without the opt-in: the same attention with the sink disabled.
    dropped = measure(_dense_expected(q, rows_f64, logical, SCALE, None), truth)
    assert dropped.rel_rms > 0.01, dropped


def test_the_impl_refuses_sinks_of_the_wrong_shape(tmp_path, cpu_vllm):
    from mla_sm120_plugin.errors import UnsupportedConfiguration

    vc = make_vllm_config(_model_dir(tmp_path), cache_dtype="fp8_ds_mla", enforce_eager=True)
    with pytest.raises(UnsupportedConfiguration, match=r"sinks=a tensor of shape \(4,\)"):
        make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype="fp8_ds_mla", scale=SCALE, load_device="cpu",
                  sinks=torch.zeros(4))


# ------------------------------------------------------------------ vLLM's own layer and resolver


@pytest.fixture(scope="module")
def hy_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("hyv4"), heads=32, topk=2048)


@pytest.fixture(scope="module")
def one_rank(hy_dir):
    """vLLM's distributed state for one rank (the layers' linear layers need a TP group); torn down after."""
    with vllm_one_rank(make_vllm_config(hy_dir)):
        yield


@pytest.fixture
def sm120(monkeypatch, one_rank):
    """The platform reads as SM 12.0 (on its class: vLLM's capability checks are classmethods) and
    picks attention backends as vLLM's CUDA platform does there, loading on the CPU; the plugin
    registered as vLLM registers it."""
    from mla_sm120_plugin.integration.vllm import register

    platform = type(current_platform)
    monkeypatch.setattr(platform, "device_type", "cpu")
    monkeypatch.setattr(platform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(12, 0)))
    monkeypatch.setattr(platform, "get_attn_backend_cls", classmethod(sm120_pick))
    register()


def _layer(hy_dir, custom: bool, prefix: str):
    """``HYV4MLAAttention`` as ``HYV4DecoderLayer.__init__`` builds it, inside the model's construction."""
    from vllm.models.hy_v4.nvidia.attention import HYV4MLAAttention

    vc = make_vllm_config(hy_dir, cache_dtype="fp8_ds_mla", enforce_eager=True,
                          attention_backend="CUSTOM" if custom else None)
    config = vc.model_config.hf_config
    with torch.device("cpu"):  # vLLM makes the indexer's buffer outside construction
        topk = torch.full((vc.scheduler_config.max_num_batched_tokens, 2048), -1, dtype=torch.int32)
    with construction_context(vc, "cpu"):
        return HYV4MLAAttention(
            vllm_config=vc, config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
            max_position_embeddings=config.max_position_embeddings, cache_config=vc.cache_config,
            quant_config=None, prefix=f"model.layers.{prefix}.self_attn", layer_idx=0, topk_indices_buffer=topk), vc


def test_with_the_opt_in_vllm_keeps_the_plugin_and_hands_it_the_layers_sink(hy_dir, sm120):
    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, MlaSm120Impl

    layer, vc = _layer(hy_dir, custom=True, prefix="0")
    impl = layer.mla_attn.impl
    assert isinstance(impl, MlaSm120Impl) and layer.mla_attn.attn_backend is MlaSm120Backend
    assert impl._mla_sm120_sinks is layer.learnable_sink_param  # the parameter the loader fills
    assert layer.learnable_sink_param.dtype == torch.float32 and impl.decision.context.sinks
    assert vc.attention_config.sparse_mla_force_mqa  # prefill on the sparse MQA path too (vLLM's rule)


def test_without_the_opt_in_vllm_disables_the_sink_on_sm120(hy_dir, sm120):
    layer, _ = _layer(hy_dir, custom=False, prefix="1")
    assert "sinks" not in vars(layer.mla_attn.impl) and getattr(layer.mla_attn.impl, "sinks", None) is None
    assert layer.learnable_sink_param.dtype == torch.bfloat16  # loaded, never applied (vLLM's own words)
