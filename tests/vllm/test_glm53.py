"""GLM-5.3-Flash (rope-less sparse MLA) through vLLM's own objects (0.33 and 0.34) on the CPU.

The selector asks for head_size 512; ``forward_mqa`` gets ``(ql_nope [N, H, 512], q_pe [N, H, 0])``,
vLLM's fp8_ds_mla rows (0.33: 656 bytes whose last 128 are reserved zeros; 0.34: the packed 528, as
vLLM's own SM120 impl sizes them) or 512 bf16 values, and a
2176-wide index buffer of logical positions (the kpool indexer's picks with -1 holes, then the tail
columns), converted to slots by the impl. The expected values are float64 attention over the rows
as tests/support/layout_oracle.py decodes their bytes (tests/support/oracle.py).
"""

from __future__ import annotations


import pytest
import torch
from support.layout_oracle import decode_cache
from support.model_configs import write_model
from support.oracle import sparse_attention
from support.vllm_engine import (build_metadata, common_metadata, kv_cache_spec, logical_to_rows, make_impl,
                                 make_vllm_config, selector_kwargs)

from mla_sm120_plugin.engines import installed_release

from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, decide
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.kernels.accuracy import EXACT_COS_DIFF, EXACT_REL_RMS, measure
from mla_sm120_plugin.kernels.dsa import pack

HEADS, PAGE, STRIDE_ROWS, NUM_BLOCKS = 8, 64, 128, 12
WIDTH = 2176  # round_up(index_topk 2048 + kpool 4 - 1, 128): the indexer buffer's width
SCALE = 256**-0.5  # qk_nope 256, no rope, no YaRN mscale
Q_LENS = [1, 1, 3]  # two decodes, one short prefill
SEQ_LENS = [150, 70, 40]
BLOCK_TABLE = [[3, 7, 0], [1, 2, 0], [5, 0, 0]]
# vLLM's fp8_ds_mla row for a rope-less model, per release: 0.33 keeps 656 bytes (128 reserved), 0.34
# sizes it by the impl's get_fp8_ds_mla_row_bytes(), 528 in its own SM120 impl and the plugin's.
FP8_ROPELESS = {"0.33.0": ("fp8_ds_mla_nope", 656), "0.34.0": ("fp8_nope", 528)}[installed_release("vllm")]


def test_vllms_spec_sizes_the_rope_less_row_as_the_release_does(tmp_path):
    """vLLM's own MLAAttention.get_kv_cache_spec, asking the plugin's impl where 0.34 asks."""
    vc = make_vllm_config(write_model(tmp_path, "glm53", heads=HEADS), cache_dtype="fp8_ds_mla", enforce_eager=True)
    assert kv_cache_spec(vc, "fp8_ds_mla", WIDTH, head_size=512).state_content_bytes == FP8_ROPELESS[1]
    assert kv_cache_spec(vc, "fp8_ds_mla", WIDTH, head_size=576).state_content_bytes == 656


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
@pytest.mark.parametrize("kv, layout_name", [("fp8_ds_mla", FP8_ROPELESS[0]), ("auto", "bf16_nope"),
                                             ("bfloat16", "bf16_nope")])
def test_validate_configuration_accepts_the_rope_less_model(tmp_path, cap, kv, layout_name):
    from vllm.config import set_current_vllm_config

    vc = make_vllm_config(write_model(tmp_path, "glm53", heads=HEADS), cache_dtype=kv, enforce_eager=True)
    with set_current_vllm_config(vc):
        assert MlaSm120Backend.validate_configuration(**selector_kwargs(kv, cap, head_size=512)) == []
    ctx = decide(vc, kv, *cap).context
    assert (ctx.kv_cache_dtype, ctx.qk_rope_head_dim, ctx.index_topk, ctx.num_heads) == (layout_name, 0, WIDTH, HEADS)


def _logical_ids(gen: torch.Generator) -> torch.Tensor:
    """Per token, as the kpool indexer writes them: picked positions with -1 holes in [0, 2048),
    the request's last tokens in the tail columns, -1 elsewhere; a duplicate in one row."""
    rows = []
    for ql, sl in zip(Q_LENS, SEQ_LENS):
        for i in range(ql):
            visible = sl - ql + i + 1
            row = torch.full((WIDTH,), -1, dtype=torch.int32)
            picks = torch.randperm(visible, generator=gen)[: min(visible, 40)].int()
            row[torch.randperm(2048, generator=gen)[: picks.numel()]] = picks
            row[2048:2051] = torch.arange(visible - 3, visible, dtype=torch.int32)  # the tail: the last tokens
            rows.append(row)
    rows[0][5] = rows[0][2048]  # a duplicate counts twice
    return torch.stack(rows)


@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bfloat16"])
def test_forward_mqa_matches_float64_attention(tmp_path, cpu_vllm, kv):
    gen = torch.Generator().manual_seed(11)
    layout_name = FP8_ROPELESS[0] if kv == "fp8_ds_mla" else "bf16_nope"
    vc = make_vllm_config(write_model(tmp_path, "glm53", heads=HEADS), cache_dtype=kv, enforce_eager=True)
    impl = make_impl(vc, heads=HEADS, topk=WIDTH, kv_cache_dtype=kv, scale=SCALE, load_device="cpu", model="glm53")
    md = build_metadata(vc, kv, WIDTH, common_metadata(Q_LENS, SEQ_LENS, BLOCK_TABLE, page=PAGE,
                                                       stride_rows=STRIDE_ROWS), head_size=512)
    latent = torch.randn(NUM_BLOCKS * STRIDE_ROWS, 512, generator=gen)
    rows = pack.pack(latent, layout_name, "pow2")  # vLLM's writer stores pow2 scales for this model too
    backing = rows.view(NUM_BLOCKS, STRIDE_ROWS, rows.shape[-1])
    kv_cache = backing[:, :PAGE]  # [blocks, 64, C], blocks 128 rows apart
    n = sum(Q_LENS)
    logical = _logical_ids(gen)
    impl.topk_indices_buffer[:n] = logical
    ql_nope = torch.randn(n, HEADS, 512, generator=gen).to(torch.bfloat16)
    q_pe = torch.empty(n, HEADS, 0, dtype=torch.bfloat16)
    out, lse = impl.forward_mqa((ql_nope, q_pe), kv_cache, md, layer=None)
    assert lse is None and out.shape == (n, HEADS, 512)

    keys = decode_cache(rows, layout_name)  # [rows, 512] float64, the bytes' own values
    slots = logical_to_rows(logical, Q_LENS, BLOCK_TABLE, PAGE, STRIDE_ROWS)
    expected, _ = sparse_attention(ql_nope, keys, slots, SCALE)
    # Each kernel is held to its own declared bound, in cos_diff, relRMS and max error; every kernel
    # that serves here (the fp8-MMA one for fp8, the exact one for bf16) is exact class.
    got = measure(out, expected)
    specs = get_registry().kernels
    for name in set(impl.decision.kernels.values()):
        assert specs[name].precision == "exact", impl.decision.kernels
        assert not specs[name].accuracy.violations(got), f"{got.summary()} ({impl.decision.kernels})"
    assert got.cos_diff <= EXACT_COS_DIFF and got.rel_rms <= EXACT_REL_RMS, got
