"""DeepSeek-V4 layers in vLLM with and without ``--attention-backend CUSTOM``, built on the CPU.

vLLM's own objects throughout (docs/facts.md#vllm-start-up): a tiny ``DeepseekV4Config`` model directory, a real
``VllmConfig`` (``AttentionConfig(backend="CUSTOM")`` is what the flag lands as), vLLM's
distributed state for one rank (gloo), the platform reading as SM 12.0 on its class (the
capability checks are classmethods) with the load device the compressor allocates on, and each
layer built the way ``DeepseekV4DecoderLayer`` builds it: ``_select_dsv4_attn_cls(vllm_config)(...)``
inside ``set_current_vllm_config``, the model's default dtype and the load device. (The whole
decoder layer does not build here: vLLM's MoE selection has no CPU case.)

The forward goes through vLLM's ``forward_mqa`` under ``set_forward_context`` with vLLM's own
metadata classes (filled as its builders fill them: global slots, -1 padded, decode rows first)
on 584-byte page-major caches laid out as vLLM binds them (``[blocks, P, 584]``, pages padded to
multiples of 576 bytes), written by the packer (held to vLLM's writer byte for byte in
tests/kernels/test_dsv4_record.py), and is compared with the float64 oracle written from the bytes.
FlashInfer cannot run on this CPU, so the plan gives every (layer kind, phase) the plugin's Triton
kernel, run by Triton's interpreter; the C4A layer's index transform is a vLLM Triton kernel that
needs a CUDA driver here, so its forward is not run (its kernel routing is the window's and C128A's).
"""

from __future__ import annotations

import json

import pytest
import torch
from support.oracle import dsv4_sparse_attention

from mla_sm120_plugin.dispatch.catalog import TRITON_DSV4
from mla_sm120_plugin.engines import installed_release, lookup
from mla_sm120_plugin.integration.vllm.translate import plan_from_vllm
from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.integration.vllm import dsv4
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from support.vllm_engine import construction_context, dsv4_workspace, make_vllm_config, one_rank as vllm_one_rank  # noqa: E402

MAX_LEN = 4096  # make_vllm_config's max_model_len
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _model_dir(tmp_path) -> str:
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=1024, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=16,
        num_key_value_heads=1, head_dim=512, q_lora_rank=256, o_lora_rank=256, o_groups=2, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, max_position_embeddings=MAX_LEN, sliding_window=128,
        index_n_heads=4, index_head_dim=128, index_topk=64, num_nextn_predict_layers=0, layer_types=LAYER_TYPES,
        mlp_layer_types=["hash_moe", "moe", "moe"])
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    return str(tmp_path)


def _v41_model_dir(tmp_path) -> str:
    """V4.1 as vLLM reads it: its own DeepseekV41Config, text_config nested, ratios 0 / 1 / 2."""
    from transformers import DeepseekV4Config

    text = DeepseekV4Config(
        vocab_size=256, hidden_size=1024, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=16,
        num_key_value_heads=1, head_dim=512, q_lora_rank=256, o_lora_rank=256, o_groups=2, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, max_position_embeddings=MAX_LEN, sliding_window=128,
        index_n_heads=4, index_head_dim=128, index_topk=64, num_nextn_predict_layers=0,
        layer_types=["sliding_attention"] * 3, mlp_layer_types=["hash_moe", "moe", "moe"]).to_dict()
    for key in ("layer_types", "compress_rates", "architectures", "transformers_version", "_name_or_path",
                "id2label", "label2id", "dtype"):
        text.pop(key, None)
    text.update(compress_ratios=[0, 1, 2], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2],
                model_type="deepseek_v41")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "text_config": text, "vision_config": {}}))
    return str(tmp_path)


def _vllm_config(model_dir: str, *, custom: bool = True, additional_config: dict | None = None,
                 cache_dtype: str = "fp8") -> VllmConfig:
    # DeepSeek-V4's only kernel block size is 256; "fp8" is what --kv-cache-dtype fp8 gives
    return make_vllm_config(model_dir, cache_dtype=cache_dtype, block_size=256, enforce_eager=True, max_num_seqs=16,
                            max_num_batched_tokens=MAX_LEN, attention_backend="CUSTOM" if custom else None,
                            additional_config=additional_config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def one_rank(model_dir):
    """vLLM's distributed state for one rank (the layers' linear layers need a TP group); torn down after."""
    with vllm_one_rank(_vllm_config(model_dir)):
        yield


@pytest.fixture
def sm(monkeypatch, one_rank):
    """The platform reads as SM ``major.minor`` (on its class: vLLM's capability checks are classmethods),
    loading on the CPU; the plugin registered as vLLM registers it, its per-process state fresh."""
    from mla_sm120_plugin.integration.vllm import dsv4, register

    platform = type(current_platform)
    monkeypatch.setattr(platform, "device_type", "cpu")
    register()
    dsv4.reset_for_tests()

    def set_sm(major: int, minor: int) -> None:
        monkeypatch.setattr(platform, "get_device_capability",
                            classmethod(lambda cls, device_id=0: DeviceCapability(major, minor)))

    yield set_sm
    dsv4.reset_for_tests()


def _build(cfg: VllmConfig, version: str = "v4", layers: tuple[int, ...] = (0, 1, 2)) -> list:
    """Each layer as ``DeepseekV4DecoderLayer.__init__`` builds its attention (V4's or V4.1's module)."""
    import importlib

    model = importlib.import_module(f"vllm.models.deepseek_{version.replace('.', '')}.nvidia.model")
    with torch.device("cpu"):  # vLLM makes the indexer's buffer outside construction
        topk = torch.full((MAX_LEN, 64), -1, dtype=torch.int32)
    with construction_context(cfg, "cpu"):
        return [model._select_dsv4_attn_cls(cfg)(cfg, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk,
                                                 aux_stream_list=None) for i in layers]


@pytest.mark.self_check
def test_the_opt_in_gives_every_layer_the_plugins_class_and_without_it_vllms(model_dir, sm):
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import DeepseekV4FlashInferSM120Attention

    from mla_sm120_plugin.dispatch import selfcheck

    sm(12, 0)
    ours = _build(_vllm_config(model_dir))
    assert all(isinstance(layer, DeepseekV4FlashInferSM120Attention) for layer in ours)
    assert {type(layer).__name__ for layer in ours} == {"MlaSm120DeepseekV4FlashInferSM120Attention"}
    # FlashInfer cannot run on this CPU (the probe says so): the plugin's kernel, after its self-check
    assert [layer.mla_sm120_kernels for layer in ours] == [{"prefill": TRITON_DSV4, "decode": TRITON_DSV4}] * 3
    checked = {key.kernel: result.passed for key, result in selfcheck._results.items()}
    assert checked == {TRITON_DSV4: True}, checked  # run inside vLLM's construction, once for the layers
    theirs = _build(_vllm_config(model_dir, custom=False))
    assert {type(layer) for layer in theirs} == {DeepseekV4FlashInferSM120Attention}


def test_a_refusal_comes_while_the_model_is_built(model_dir, sm):
    sm(9, 0)
    with pytest.raises(UnsupportedConfiguration) as err:
        _build(_vllm_config(model_dir))
    assert "FLASHMLA_SPARSE_DSV4" in str(err.value) and "without the plugin's opt-in" in str(err.value)
    sm(12, 0)
    forced = {"mla_sm120": {"decode_kernel": "flashinfer_dsv4_sm120"}}
    with pytest.raises(UnsupportedConfiguration) as err:  # FlashInfer's kernels cannot run on this CPU
        _build(_vllm_config(model_dir, additional_config=forced))
    text = str(err.value)
    assert text.startswith("layer kinds window (1 layer), c4a (1 layer), c128a (1 layer):")
    assert "decode kernel flashinfer_dsv4_sm120 (decode_kernel from --additional-config mla_sm120) cannot run" in text
    assert "decode can run: triton_dsv4" in text


# --------------------------------------------------------------------------------- the forward

SEQ = [300, 40, 520]  # the requests' lengths after this step
MIXED = [1, 1, 5]  # two decode requests (one token each), then a prefill chunk of 5 tokens
DECODES = [1, 1, 1]  # decode only: vLLM's C128A prefill rows go through a vLLM Triton index kernel
                     # that needs a CUDA driver, even under Triton's interpreter


class Batch:
    """One step's tokens as vLLM's reordered batch holds them (decode requests first)."""

    def __init__(self, qlens: list[int]) -> None:
        self.qlens = qlens
        self.tokens = sum(qlens)
        self.decodes = sum(1 for q in qlens if q == 1)
        self.decode_tokens = self.decodes
        self.pos = torch.cat([torch.arange(s - q, s) for q, s in zip(qlens, SEQ)])
        self.req = torch.repeat_interleave(torch.arange(len(qlens)), torch.tensor(qlens)).int()
        self.qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)


def _block_table(block: int) -> torch.Tensor:
    """Each request's blocks two apart (other layers' pages between), as vLLM's table holds them."""
    table = torch.zeros(len(SEQ), MAX_LEN // block, dtype=torch.int32)
    nxt = 1
    for r, s in enumerate(SEQ):
        for j in range(-(-s // block)):
            table[r, j], nxt = nxt, nxt + 2
    return table


def _pool(spec, table: torch.Tensor, seed: int, record=layout.FP8_RECORD) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A pool as vLLM binds it ([blocks, P, 584] (or 384) over its spec's pages), filled by the packer."""
    entries = spec.block_size // getattr(spec, "tokens_per_state", 1)
    blocks = int(table.max()) + 1
    pages = pack.new_cache(blocks, entries, page_stride=spec.page_size_bytes, record=record)
    rows = torch.randn(blocks * entries, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    pack.write(pages, rows, torch.arange(blocks * entries), entries, record=record)
    size = record.token_bytes
    return pages.as_strided((blocks, entries, size), (spec.page_size_bytes, size, 1)), pages, entries


def _swa_metadata(b: Batch, block: int, window: int):
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    table = _block_table(block)
    idx = torch.full((b.tokens, 1, window), -1, dtype=torch.int32)
    lens = torch.zeros(b.tokens, dtype=torch.int32)
    for t in range(b.tokens):
        p, r = int(b.pos[t]), int(b.req[t])
        span = range(max(0, p - window + 1), p + 1)
        idx[t, 0, :len(span)] = torch.tensor([int(table[r, x // block]) * block + x % block for x in span])
        lens[t] = len(span)
    nd = b.decode_tokens
    md = DeepseekSparseSWAMetadata(
        block_table=table, slot_mapping=torch.zeros(b.tokens, dtype=torch.int64), block_size=block,
        seq_lens=torch.tensor(SEQ, dtype=torch.int32), query_start_loc=b.qsl, query_start_loc_cpu=b.qsl,
        is_valid_token=torch.ones(b.tokens, dtype=torch.bool), token_to_req_indices=b.req,
        decode_swa_indices=idx[:nd], decode_swa_lens=lens[:nd], decode_swa_width=window,
        prefill_swa_indices=idx[nd:], prefill_swa_lens=lens[nd:], num_decodes=b.decodes,
        num_prefills=len(b.qlens) - b.decodes, num_decode_tokens=nd, num_prefill_tokens=b.tokens - nd)
    return md, idx[:, 0], lens


def _c128a_metadata(b: Batch, block: int):
    """C128A's metadata as vLLM's builder fills it on SM120: decode rows the global slots of every
    compressed entry (a row of 128 at this length), prefill rows the request's local entries."""
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata

    table, per_block, nd = _block_table(block), block // 128, b.decode_tokens
    glob = torch.full((b.tokens, 128), -1, dtype=torch.int32)  # what the kernel reads
    local = torch.full((b.tokens, 128), -1, dtype=torch.int32)
    lens = torch.zeros(b.tokens, dtype=torch.int32)
    for t in range(b.tokens):
        n, r = (int(b.pos[t]) + 1) // 128, int(b.req[t])
        glob[t, :n] = torch.tensor([int(table[r, j // per_block]) * per_block + j % per_block for j in range(n)],
                                   dtype=torch.int32)
        local[t, :n], lens[t] = torch.arange(n), n
    md = DeepseekV4FlashMLAMetadata(
        num_reqs=len(b.qlens), max_query_len=max(b.qlens), max_seq_len=max(SEQ), num_actual_tokens=b.tokens,
        query_start_loc=b.qsl, slot_mapping=torch.zeros(b.tokens, dtype=torch.int64), block_table=table,
        req_id_per_token=b.req, block_size=block, topk_tokens=64,
        c128a_global_decode_topk_indices=glob[:nd].view(nd, 1, -1), c128a_decode_topk_lens=lens[:nd].clone(),
        c128a_prefill_topk_indices=local[nd:])
    return md, glob, lens


def test_v41_layers_get_the_plugins_class_with_their_own_kinds(tmp_path, sm):
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import DeepseekV4FlashInferSM120Attention

    sm(12, 1)
    cfg = _vllm_config(_v41_model_dir(tmp_path))
    layers = _build(cfg, "v4.1")
    assert all(isinstance(layer, DeepseekV4FlashInferSM120Attention) for layer in layers)
    assert [dsv4.layer_kind(layer) for layer in layers] == ["window", "c1a", "c2a"]
    assert layers[0].swa_cache_layer.block_size == 32  # V4.1's window pages on SM12x
    assert {layer._o_proj_block_size for layer in layers} <= {32, 128} and layers[0]._einsum_recipe is not None
    # The compressed pages the plan assumes are the kernel block vLLM's own V4.1 backend asks for on
    # SM12x: 128 in 0.33, 64 in 0.34 (vllm#59203); a page holds block / ratio entries.
    release = installed_release("vllm")
    (block,) = layers[1].get_attn_backend().get_supported_kernel_block_sizes()
    assert block == {"0.33.0": 128, "0.34.0": 64}[release]
    assert lookup("vllm", release).dsv4.compressed_page_tokens["v4.1"] == block
    planned = plan_from_vllm(cfg, cfg.cache_config.cache_dtype, (12, 1), hf_config=cfg.model_config.hf_config)
    assert {kind: d.context.call.extra_page for kind, d in planned.decisions.items()} == {
        "window": 0, "c1a": block, "c2a": block // 2}


@pytest.mark.parametrize("version, index, qlens", [("v4", 0, MIXED), ("v4", 2, DECODES), ("v4.1", 0, MIXED)],
                         ids=["window-mixed", "c128a-decode", "v41-window-mixed"])
def test_a_forward_through_the_plugins_layer_matches_float64(model_dir, tmp_path, sm, version, index, qlens):
    from vllm.forward_context import set_forward_context

    sm(12, 0)
    cfg = _vllm_config(model_dir if version == "v4" else _v41_model_dir(tmp_path))
    (layer,) = _build(cfg, version, (index,))  # one layer: one kind's self-check
    b = Batch(qlens)
    swa = layer.swa_cache_layer
    swa_md, swa_idx, swa_len = _swa_metadata(b, swa.block_size, layer.window_size)
    swa_view, swa_pages, swa_page = _pool(swa.get_kv_cache_spec(cfg), swa_md.block_table, 1)
    swa.kv_cache = swa_view
    parts = [(swa_pages, swa_idx, swa_len, swa_page)]
    metadata = {swa.prefix: swa_md}
    if layer.compress_ratio > 1:
        md, c_idx, c_len = _c128a_metadata(b, cfg.cache_config.block_size)
        layer.kv_cache, c_pages, c_page = _pool(layer.get_kv_cache_spec(cfg), md.block_table, 2)
        parts.append((c_pages, c_idx, c_len, c_page))
        metadata[layer.prefix] = md
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(layer.padded_heads, generator=gen))
        layer.attn_sink[::5] = float("-inf")
    q = (torch.randn(b.tokens, layer.n_local_heads, 512, generator=gen) / 4).to(torch.bfloat16)
    out = torch.full((b.tokens, layer.padded_heads, 512), float("nan"), dtype=torch.bfloat16)
    with set_forward_context(metadata, cfg, num_tokens=b.tokens):
        layer.forward_mqa(q, None, b.pos, out)
    want, _ = dsv4_sparse_attention(q, parts, layer.attn_sink.detach())
    got = measure(out, want)
    assert EXACT_CLASS_BOUND.violations(got) == [], got


# ------------------------------------------------- the 384-byte NVFP4 record (--kv-cache-dtype nvfp4_ds_mla)

NVFP4 = layout.NVFP4_RECORD


def test_nvfp4_sizes_both_pools_at_384_bytes_and_without_the_opt_in_vllm_refuses(model_dir, sm):
    sm(12, 0)
    cfg = _vllm_config(model_dir, cache_dtype="nvfp4_ds_mla")
    window, c4a, c128a = _build(cfg)
    assert {layer.mla_sm120_record for layer in (window, c4a, c128a)} == {layout.NVFP4_DSV4}
    specs = {"window": window.swa_cache_layer.get_kv_cache_spec(cfg), "c4a": c4a.get_kv_cache_spec(cfg),
             "c128a": c128a.get_kv_cache_spec(cfg)}
    assert {k: (s.state_content_bytes, s.num_states if hasattr(s, "num_states") else None, s.page_size_bytes)
            for k, s in specs.items()} == {"window": (384, 64, 64 * 384), "c4a": (384, 64, 64 * 384),
                                           "c128a": (384, 2, 2 * 384)}
    assert window.get_kv_cache_spec(cfg) is None  # a window-only layer has no compressed pool
    # the same pages hold the same entries: 584-byte pages are 37440 / 1728 bytes (padded to 576)
    assert [round(layout.FP8_RECORD.page_bytes(p) / s.page_size_bytes, 2)
            for p, s in ((64, specs["c4a"]), (2, specs["c128a"]))] == [1.52, 2.25]
    assert type(c4a.compressor).__name__ == "MlaSm120Nvfp4DeepseekCompressor" and window.compressor is None
    assert cfg.cache_config.cache_dtype == "nvfp4_ds_mla"  # not rewritten to fp8_ds_mla
    with pytest.raises(ValueError, match="only supports fp8 kv-cache"):
        _build(_vllm_config(model_dir, custom=False, cache_dtype="nvfp4_ds_mla"), layers=(0,))


def _own_slots(b: Batch, block: int) -> torch.Tensor:
    """Each token's own window-cache slot (what vLLM's slot mapping holds)."""
    table = _block_table(block)
    return torch.tensor([int(table[int(b.req[t]), int(b.pos[t]) // block]) * block + int(b.pos[t]) % block
                         for t in range(b.tokens)], dtype=torch.int64)


@pytest.mark.parametrize("index, qlens", [(0, MIXED), (2, DECODES)], ids=["window-mixed", "c128a-decode"])
def test_an_nvfp4_step_writes_the_record_and_its_forward_matches_float64(model_dir, sm, index, qlens):
    """vLLM's step on the plugin's layer: the q / KV insert (the plugin's writer in place of vLLM's fused
    fp8 op) stores this step's rows into the window pool, then forward_mqa reads both 384-byte pools."""
    from vllm.forward_context import set_forward_context

    from support.layout_oracle import dsv4_roped_bf16

    sm(12, 0)
    cfg = _vllm_config(model_dir, cache_dtype="nvfp4_ds_mla")
    (layer,) = _build(cfg, "v4", (index,))
    b = Batch(qlens)
    swa = layer.swa_cache_layer
    swa_md, swa_idx, swa_len = _swa_metadata(b, swa.block_size, layer.window_size)
    swa_md.slot_mapping = _own_slots(b, swa.block_size)
    swa.kv_cache, swa_pages, swa_page = _pool(swa.get_kv_cache_spec(cfg), swa_md.block_table, 1, NVFP4)
    parts = [(swa_pages, swa_idx, swa_len, swa_page)]
    metadata = {swa.prefix: swa_md}
    if layer.compress_ratio > 1:
        md, c_idx, c_len = _c128a_metadata(b, cfg.cache_config.block_size)
        layer.kv_cache, c_pages, c_page = _pool(layer.get_kv_cache_spec(cfg), md.block_table, 2, NVFP4)
        parts.append((c_pages, c_idx, c_len, c_page))
        metadata[layer.prefix] = md
    gen = torch.Generator().manual_seed(index + 10)
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(layer.padded_heads, generator=gen))
    q = (torch.randn(b.tokens, layer.n_local_heads, 512, generator=gen) * 3).to(torch.bfloat16)
    kv = torch.randn(b.tokens, 512, generator=gen).to(torch.bfloat16)
    out = torch.full((b.tokens, layer.padded_heads, 512), float("nan"), dtype=torch.bfloat16)
    with set_forward_context(metadata, cfg, num_tokens=b.tokens):
        q_in = layer._fused_qnorm_rope_kv_insert(q, kv, b.pos, metadata)
        layer.forward_mqa(q_in, kv, b.pos, out)
    cos_sin = layer.rotary_emb.cos_sin_cache
    for t, slot in enumerate(swa_md.slot_mapping.tolist()):  # this step's rows, as FlashInfer's record
        row = dsv4_roped_bf16(kv[t].float(), cos_sin[b.pos[t], :32], cos_sin[b.pos[t], 32:])
        assert torch.equal(pack.gather(swa_pages, torch.tensor([slot]), swa_page, NVFP4),
                           pack.gather(pack_one(row), torch.tensor([0]), 1, NVFP4)), t
    x = q.double() * torch.rsqrt(q.double().square().mean(-1, keepdim=True) + layer.eps)
    assert q_in.shape == (b.tokens, layer.padded_heads, 512) and bool((q_in[:, layer.n_local_heads:] == 0).all())
    assert torch.allclose(q_in[:, :layer.n_local_heads, :448].double(), x[..., :448], rtol=2 ** -7, atol=1e-6)
    want, _ = dsv4_sparse_attention(q_in, parts, layer.attn_sink.detach(), record="nvfp4")
    got = measure(out, want)
    assert EXACT_CLASS_BOUND.violations(got) == [], got


def pack_one(row: torch.Tensor) -> torch.Tensor:
    cache = pack.new_cache(1, 1, record=NVFP4)
    pack.write(cache, row[None], torch.tensor([0]), 1, record=NVFP4)
    return cache


def test_the_compressor_stores_the_nvfp4_record_through_vllms_override_point(model_dir, sm):
    """vLLM's compressor calls _compress_norm_rope_store after saving its states (its documented
    override point); the plugin's compressor class stores the compressed rows as the 384-byte record."""
    from vllm.models.deepseek_v4.compressor import CompressorMetadata

    from support.layout_oracle import dsv4_compressed_row, dsv4_nvfp4_entry, dsv4_roped_bf16, encode_dsv4_nvfp4_row

    sm(12, 0)
    cfg = _vllm_config(model_dir, cache_dtype="nvfp4_ds_mla")
    (layer,) = _build(cfg, "v4", (2,))  # C128A: one entry every 128 tokens, no overlap
    comp = layer.compressor
    b = Batch([1, 1, 1])
    b.pos = torch.tensor([255, 39, 511])  # tokens 0 and 2 close a 128-token block
    gen = torch.Generator().manual_seed(7)
    state_block, width = 8, 512
    state_table = (torch.randperm(300, generator=gen)[:3 * 80].view(3, 80) + 1).int()
    states = torch.randn(301, state_block, 2 * width, generator=gen)
    md, _, _ = _c128a_metadata(b, cfg.cache_config.block_size)
    md.slot_mapping = torch.tensor([3, 5, 8], dtype=torch.int64)  # compressed slots
    layer.kv_cache, c_pages, c_page = _pool(layer.get_kv_cache_spec(cfg), md.block_table, 3, NVFP4)
    before = c_pages.clone()
    state_md = CompressorMetadata(block_table=state_table, slot_mapping=torch.tensor([1, 2, 3]),
                                  block_size=state_block, token_to_req_indices=b.req)
    with torch.no_grad():
        comp.norm.weight.copy_(torch.randn(512, generator=gen) / 4 + 1)
    comp._compress_norm_rope_store(state_md, states, width, b.pos, layer.rotary_emb, {layer.prefix: md}, {})
    cos_sin = layer.rotary_emb.cos_sin_cache
    for t, slot in ((0, 3), (2, 8)):
        pos = int(b.pos[t])
        rows = [states[state_table[t, p // state_block], p % state_block] for p in range(pos - 127, pos + 1)]
        entry = dsv4_compressed_row([r[:512] for r in rows], [r[512:] for r in rows], comp.norm.weight.detach(),
                                    comp.rms_norm_eps)
        start = pos // 128 * 128
        row = dsv4_roped_bf16(entry, cos_sin[start, :32], cos_sin[start, 32:])
        assert dsv4_nvfp4_entry(c_pages, slot, c_page) == encode_dsv4_nvfp4_row(row.float().tolist()), t
    untouched = [s for s in range(c_pages.shape[0] * c_page) if s not in (3, 8)]
    assert all(dsv4_nvfp4_entry(c_pages, s, c_page) == dsv4_nvfp4_entry(before, s, c_page) for s in untouched[:40])


def _v4_flash_mix_dir(tmp_path) -> str:
    """The tiny model with V4-Flash's 43 layers: transformers' default pattern (2 C128A, then C4A /
    C128A alternating: 20 C4A, 23 C128A; every layer has its window cache)."""
    from transformers import DeepseekV4Config

    n = 43
    types = ["heavily_compressed_attention"] * 2 + [LAYER_TYPES[1] if i % 2 else LAYER_TYPES[2] for i in range(n - 2)]
    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=1024, moe_intermediate_size=128, num_hidden_layers=n, num_attention_heads=16,
        num_key_value_heads=1, head_dim=512, q_lora_rank=256, o_lora_rank=256, o_groups=2, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, max_position_embeddings=MAX_LEN, sliding_window=128,
        index_n_heads=4, index_head_dim=128, index_topk=64, num_nextn_predict_layers=0, layer_types=types,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (n - 3))
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    return str(tmp_path)


def test_vllms_block_accounting_gives_the_nvfp4_record_more_blocks(tmp_path, sm):
    """vLLM's engine-core planning (layout, groups, blocks) over every cache V4-Flash's 43 layers register
    (window, compressed, indexer K, compressor states), in the same 8 GiB: more blocks with the 384-byte
    record, but less than 1.52x (the indexer's and compressor's caches and the window pages' share of
    each block are not the record's). Prints the counts (-s)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    sm(12, 0)
    model = _v4_flash_mix_dir(tmp_path)
    blocks = {}
    for dtype in ("fp8", "nvfp4_ds_mla"):
        cfg = _vllm_config(model, cache_dtype=dtype)
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # what a GPU engine runs for DeepSeek-V4
        _build(cfg, layers=tuple(range(43)))
        specs = {name: spec for name, module in cfg.compilation_config.static_forward_context.items()
                 if hasattr(module, "get_kv_cache_spec") and (spec := module.get_kv_cache_spec(cfg)) is not None}
        # as vLLM's engine core plans them: the layout its backends share, the groups, the blocks
        backends = {cfg.compilation_config.static_forward_context[name].get_attn_backend() for name in specs}
        resolve_kv_cache_layout(cfg, [[lay.name for lay in get_supported_kv_cache_layouts(backends)]], specs.values())
        (config,) = get_kv_cache_configs(cfg, [specs], [8 << 30], get_global_kv_cache_groups(cfg, [specs]))
        blocks[dtype] = config.num_blocks
    ratio = blocks["nvfp4_ds_mla"] / blocks["fp8"]
    print(f"vLLM blocks in 8 GiB at V4-Flash's layer mix: {blocks}, {ratio:.3f}x")
    assert 1.0 < ratio < NVFP4_GAIN, blocks


NVFP4_GAIN = layout.FP8_RECORD.token_bytes / layout.NVFP4_RECORD.token_bytes  # 1.52: the record alone


def test_every_planned_split_fits_the_workspace_vllm_passes_the_call():
    """vLLM hands each DeepSeek-V4 call FlashInfer's workspace (made once a device, before capture);
    the most partials any planned call writes fit in it, so the routed call carves them from there
    and allocates none (tests/kernels/test_dsv4_split.py: the call on the engines' buffers)."""
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    from mla_sm120_plugin.kernels.dsv4 import plan

    assert plan.scratch_bound() <= flashinfer_sparse._FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE
    workspace = dsv4_workspace(torch.device("cpu"))
    assert workspace.dtype == torch.uint8 and workspace.is_contiguous()  # what triton_dsv4 carves from
