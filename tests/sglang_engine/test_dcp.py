"""Decode context parallelism through SGLang 0.5.23's own pieces: 2 and 4 gloo ranks, each keeping only the slots
it owns (``tests/support/sglang_dcp.py`` runs them on ``tests/support/dcp.py``'s skeleton: SGLang's launcher
passes, its DCP group, its q gather, its page-table localization inside the plugin's call, its LSE merges).

Each rank's partial (its kernel over the slots it owns, its own heads' sinks) is held to the exact class against
float64 over the same slots, its LSE to float64's; the merged output to float64 attention over the whole cache.
SGLang's merges weigh the bf16 partials in fp32 and round the merged result to bf16 once more: measured 0.23-0.27 %
relRMS (all-gather + reduce-scatter) and 0.35-0.37 % (all-to-all), cos_diff <= 7e-6, against 0.14-0.23 % for the
partials; so ``MERGED`` is the exact class widened by that rounding (a sink counted on every rank, the global slots
read from a rank's own cache, or an LSE in the wrong base fail every case they touch).

Cases: decode rows, target-verify rows (1 + gamma a request, ``--speculative-eagle-topk 1``), prefill rows
(causal), a padded row (no id), a row whose ids all sit on rank 0 (the others own none, their heads' sinks
counted by ranks that own nothing of it), a row rank 0 owns nothing of, fp8 (SGLang's
``quantize_k_cache``) and bf16 caches (SGLang's DCP writer), both merges (all-gather + reduce-scatter, SGLang's
default, and all-to-all), HY V4's finite sinks, each Triton kernel and the torch reference (FlashInfer's needs
an SM12x GPU).
"""

from __future__ import annotations

import pytest
import torch
from support.dcp import rank_result
from support.model_configs import write_model
from support.sglang_dcp import Case, run_ranks

from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON, TRITON_FAST
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, AccuracyBound, measure

MERGED = AccuracyBound(cos_diff=1e-5, rel_rms=4.5e-3, max_rel=2e-2)

CASES_2 = (
    Case("fp8 decode, triton, ag_rs"),
    Case("fp8 target-verify, fast, a2a", mode="TARGET_VERIFY", decode_kernel=TRITON_FAST, comm="a2a",
         q_lens=(3, 3, 3, 3)),
    Case("bf16 prefill, torch", kv="bfloat16", mode="EXTEND", prefill_kernel=TORCH, q_lens=(5, 1, 3, 2)),
    Case("hyv4 sinks, decode", model="hyv4", kv="auto"),
)
CASES_4 = (
    Case("hyv4 sinks, 4 ranks, target-verify, a2a", model="hyv4", kv="auto", mode="TARGET_VERIFY", comm="a2a",
         q_lens=(2, 2, 2, 2), decode_kernel=TRITON),
)


def _model_dirs(tmp, world: int, heads: int = 3) -> dict:
    """Tiny configs whose heads split to ``heads`` (odd) a rank at TP = ``world``."""
    return {"glm": write_model(tmp, "glm", index_topk=64, heads=heads * world),
            "hyv4": write_model(tmp, "hyv4", index_topk=64, heads=heads * world,
                                layer_types=["deepseek_sparse_attention"] * 2)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """world -> rank -> case name -> what the rank returned (one process group per world size)."""
    return {world: run_ranks(world, _model_dirs(tmp_path_factory.mktemp(f"dcp{world}"), world), list(cases))
            for world, cases in ((2, CASES_2), (4, CASES_4))}




CASES = [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4]


@pytest.mark.parametrize("world,case", CASES, ids=lambda c: getattr(c, "name", c))
def test_the_merged_output_is_attention_over_the_whole_cache(ranks, world, case):
    for rank in range(world):
        got = rank_result(ranks, world, rank, case)
        # SGLang's launcher resolved the DSA backends to the plugin's call site (not trtllm), planned at the
        # gathered heads; q reached the call gathered in rank order.
        assert got["routes"][:2] == ("flashinfer_sparse_mla", "flashinfer_sparse_mla")
        assert got["heads_planned"] == case.heads * world and got["gathered_q"]
        for merged in got["merged"]:  # layer 0, and layer 1 on SGLang's reused localized table
            acc = measure(torch.from_numpy(merged), torch.from_numpy(got["want"]))
            assert not MERGED.violations(acc), (rank, acc)
        assert got["layers_agree"]


@pytest.mark.parametrize("world,case", CASES, ids=lambda c: getattr(c, "name", c))
def test_each_rank_returns_its_share_and_lse_in_sglangs_base(ranks, world, case):
    for rank in range(world):
        got = rank_result(ranks, world, rank, case)
        acc = measure(torch.from_numpy(got["out"]), torch.from_numpy(got["part_out"]))
        assert not EXACT_CLASS_BOUND.violations(acc), (rank, acc)
        lse, want = torch.from_numpy(got["lse"]), torch.from_numpy(got["part_lse"])
        # A row this rank owns nothing of has LSE -inf (its own heads: the sink alone), as SGLang's merge expects.
        assert torch.equal(torch.isfinite(lse), torch.isfinite(want))
        finite = torch.isfinite(want)
        assert (lse[finite] - want[finite]).abs().max() < 1e-4
        assert got["base_e"] is False  # SGLang merges the dsa backend's LSE in base 2: converted above


def test_sglangs_dcp_writer_keeps_the_slots_the_localization_reads(ranks):
    # The bf16 caches come from SGLang's DCP writer; its placement (slot % world at slot // world) is the one the
    # fp8 cases slice by and the one SGLang's transform_index_page_table_dcp maps the call's slots to.
    bf16 = [c for c in CASES_2 if c.kv != "fp8_e4m3"]
    assert all(rank_result(ranks, 2, r, c)["placed"] for r in range(2) for c in bf16)
    assert all(rank_result(ranks, 4, r, c)["placed"] for r in range(4) for c in CASES_4)
