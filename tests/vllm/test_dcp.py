"""Decode context parallelism through vLLM's own pieces: 2 and 4 gloo ranks, each keeping only the tokens it
owns (``tests/support/vllm_dcp.py`` runs them on ``tests/support/dcp.py``'s skeleton: vLLM's parallel state,
MLADCPManager's head gather and LSE merge, the owner filter inside the impl's forward).

Each rank's partial (its kernels over the ids it owns) is held to the exact class against float64 over the
same ids, its LSE to float64's; the merged output to float64 attention over the whole cache. The merged bar
is the exact class widened by what vLLM's merge itself costs: it weighs bf16 partials and rounds the
weighted terms and their sum to bf16 (three bf16 roundings on top of the partial's one: measured 0.37-0.44 %
relRMS with float64-exact LSEs), so ``MERGED`` is cos_diff <= 2e-5, relRMS <= 0.6 % (a wrong LSE base, a
sink counted twice or a rank's heads mixed up are 5-100 %).

Cases: decode rows of 1 and of a 3-row request (1 + 2 draft tokens, causal ids), a padded row (no id), a
row whose ids all sit on the first rank (the others own none: HY V4's other heads' sinks are counted by a rank
that owns nothing of it), a row the first rank owns nothing of, interleave 1 and > 1, both merge backends
(all-to-all, and all-gather + reduce-scatter: vLLM's default), fp8_ds_mla, nvfp4_ds_mla, bf16, the
rope-less GLM-5.3-Flash cache, HY V4's finite sinks, and each kernel that runs on a CPU (FlashInfer's needs
an SM12x GPU: the device script runs it).
"""

from __future__ import annotations

import pytest
import torch
from support.dcp import own_sinks, rank_result
from support.model_configs import write_model
from support.vllm_dcp import Case, _problem, cache_rows64, expected, run_ranks

from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON, TRITON_FAST
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, AccuracyBound, measure

MERGED = AccuracyBound(cos_diff=2e-5, rel_rms=6e-3, max_rel=3e-2)

# Decode rows run each Triton kernel (the interpreter's cost is per 512-wide row: prefill rows go to the
# torch reference, whose own DCP rows are as covered); every layout and both merges at 2 ranks.
CASES_2 = (
    Case("fp8 triton/torch a2a", decode_kernel=TRITON, prefill_kernel=TORCH),
    Case("fp8 fast, interleave 4, ag_rs", decode_kernel=TRITON_FAST, prefill_kernel=TORCH, interleave=4,
         comm="ag_rs"),
    Case("nvfp4 triton", kv="nvfp4_ds_mla", decode_kernel=TRITON, prefill_kernel=TORCH),
    Case("bf16 torch, interleave 2", kv="bfloat16", decode_kernel=TORCH, prefill_kernel=TORCH, interleave=2),
    Case("hyv4 sinks", model="hyv4", sinks=True, comm="ag_rs"),
    Case("glm-5.3-flash, interleave 4", model="glm53", interleave=4, topk=2176, decode_kernel=TORCH,
         prefill_kernel=TORCH),
)
CASES_4 = (
    Case("hyv4 sinks, 4 ranks, interleave 2, ag_rs", model="hyv4", sinks=True, interleave=2, comm="ag_rs"),
)


def _model_dirs(tmp, world: int, heads: int = 3) -> dict:
    """Tiny configs whose heads split to ``heads`` (odd) a rank at TP = ``world``."""
    return {
        "glm": write_model(tmp, "glm", index_topk=512, heads=heads * world),
        "hyv4": write_model(tmp, "hyv4", index_topk=512, heads=heads * world,
                            layer_types=["deepseek_sparse_attention"] * 2),
        "glm53": write_model(tmp, "glm53", index_topk=2048, heads=heads * world),
    }


# The init self-check runs in the 4-rank group only: there it is HY V4's rank call (sinks, the LSE in
# vLLM's base, DCP 4) checked inside vLLM's construction; each 2-rank case would repeat a kernel check
# tests/dispatch/test_selfcheck_dcp.py makes, on every rank, in the interpreter (~2 min of this file's 3).
SELF_CHECK = {2: "off", 4: "on"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """world -> rank -> case name -> what the rank returned (one process group per world size)."""
    return {world: run_ranks(world, _model_dirs(tmp_path_factory.mktemp(f"dcp{world}"), world), list(cases),
                             self_check=SELF_CHECK[world])
            for world, cases in ((2, CASES_2), (4, CASES_4))}




@pytest.mark.parametrize("world,case", [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4], ids=lambda c: getattr(c, "name", c))
def test_the_merged_output_is_attention_over_the_whole_cache(ranks, world, case):
    from mla_sm120_plugin.context import kv_layout
    from mla_sm120_plugin.engines import installed_release, lookup

    refused = lookup("vllm", installed_release("vllm")).dcp.layouts_refused.get(kv_layout(case.kv))
    if refused:  # vLLM 0.34's config validator: the plan refuses what vLLM itself does
        got = ranks[world][0][case.name]
        assert isinstance(got, str) and "not supported with decode context parallelism" in got, got
        pytest.skip(refused)
    rows, q, logical, sinks = _problem(case, world)
    keys64 = cache_rows64(case, rows)
    for rank in range(world):
        got = rank_result(ranks, world, rank, case)
        mine = slice(rank * case.heads, (rank + 1) * case.heads)
        # The plan and the kernel see the DCP group's heads; the output keeps them until the merge.
        assert got["decision_heads"] == got["gathered_heads"] == case.heads * world
        assert got["out"].shape == (q.shape[0], case.heads * world, 512)
        assert got["decision"] == (case.prefill_kernel, case.decode_kernel)
        assert got["num_decode_tokens"] == 2  # the two 1-token requests
        # The rank's partial: its ids only, its own heads' sinks only (the one rule: every rank counts its
        # own heads' sinks, -inf for the others').
        part, part_lse = expected(case, keys64, q, logical, own_sinks(sinks, world, rank), got["scale"], rank, world)
        assert not EXACT_CLASS_BOUND.violations(measure(got["out"], part)), (rank, measure(got["out"], part))
        finite = torch.isfinite(part_lse)
        assert torch.equal(torch.isfinite(got["lse"]), finite), rank  # -inf exactly where the rank has nothing
        assert (got["lse"][finite].double() - part_lse[finite]).abs().max() < 1e-4, rank
        # Merged by vLLM: the rank's own heads, over every rank's tokens.
        whole, _ = expected(case, keys64, q, logical, sinks, got["scale"])
        assert got["merged"].shape == (q.shape[0], case.heads, 512)
        assert not MERGED.violations(measure(got["merged"], whole[:, mine])), (rank, measure(got["merged"], whole[:, mine]))
        assert torch.isfinite(got["merged"]).all()
        assert got["merged"][1].abs().max() == 0  # the padded row: nothing to attend to (no sink: 0 too)
    assert sum(rank_result(ranks, world, r, case)["owned_rows"] for r in range(world)) == sum(case.seq_lens)


def test_the_self_check_holds_the_lse_a_ranks_call_returns_inside_vllms_construction(ranks):
    """Each rank of the 4-rank HY V4 group checked its decode kernel as vLLM calls it under DCP: the LSE in
    vLLM's base (e), the DCP size 4, its own heads' sinks; passed, the LSE measured. The 2-rank group ran
    with the self-check off and checked nothing."""
    (case,) = CASES_4
    for rank in range(4):
        checked = rank_result(ranks, 4, rank, case)["self_checked"]
        assert (case.decode_kernel, "decode", "e", 4, True, True) in checked, (rank, checked)
        assert all(passed for *_, passed in checked), (rank, checked)
    served = [got for r in range(2) for got in ranks[2][r].values() if isinstance(got, dict)]  # not refused
    assert served and all(got["self_checked"] == [] for got in served)


def test_vllms_selector_keeps_the_plugins_backend_under_dcp(tmp_path, monkeypatch):
    """vLLM's selector under --attention-backend CUSTOM --decode-context-parallel-size 4 (use_dcp from its own
    config) keeps the plugin's backend, planned at the gathered heads; vLLM's own SM120 sparse backend says
    "DCP not supported" for the same selector config."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from support.vllm_engine import make_vllm_config, sm120_pick

    from mla_sm120_plugin.integration.vllm import register, translate
    from mla_sm120_plugin.integration.vllm.backend import BACKEND_NAME

    platform = type(current_platform)
    monkeypatch.setattr(platform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(12, 0)))
    monkeypatch.setattr(platform, "get_attn_backend_cls", classmethod(sm120_pick))
    register()
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=2048), tp=8, dcp=4, attention_backend="CUSTOM")
    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(vc):
        backend = selector.get_attn_backend(576, torch.bfloat16, "fp8_ds_mla", use_mla=True, use_sparse=True)
        selected = selector._cached_get_attn_backend.cache_info()
    selector._cached_get_attn_backend.cache_clear()
    assert backend.get_name() == BACKEND_NAME and selected.misses == 1
    planned = translate.plan_from_vllm(vc, "fp8_ds_mla", (12, 0)).decision.context
    assert (planned.num_heads, planned.heads_per_rank, planned.decode_context_parallel_size) == (32, 8, 4)
    own = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120.get_class()
    from support.vllm_engine import selector_kwargs

    with set_current_vllm_config(vc):
        reasons = own.validate_configuration(**{**selector_kwargs("fp8_ds_mla", (12, 0)), "use_dcp": True})
    assert "DCP not supported" in reasons


@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bfloat16"])
def test_vllms_kv_cache_planning_gives_n_times_the_tokens_at_dcp_n(tmp_path, kv):
    """vLLM's engine-core planning (global groups -> per-worker configs -> the scheduler's config -> the
    capacity it logs as "GPU KV cache size") over the plugin's layer specs, in the same memory a GPU:
    the blocks a GPU holds do not change with DCP, the tokens they serve grow N x (printed for the note)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_capacity
    from support.vllm_engine import kv_cache_spec, make_vllm_config

    from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend

    model = write_model(tmp_path, "glm", index_topk=2048)
    tokens, blocks = {}, {}
    for dcp in (1, 2, 4, 8):
        vc = make_vllm_config(model, cache_dtype=kv, tp=8, dcp=dcp)
        with set_current_vllm_config(vc):
            specs = {f"model.layers.{i}.self_attn.attn": kv_cache_spec(vc, kv, 2048) for i in range(2)}
            resolve_kv_cache_layout(vc, [[lay.name for lay in get_supported_kv_cache_layouts({MlaSm120Backend})]],
                                    specs.values())
            (config,) = get_kv_cache_configs(vc, [specs], [1 << 30], get_global_kv_cache_groups(vc, [specs]))
            tokens[dcp], _ = get_kv_cache_capacity(vc, generate_scheduler_kv_cache_config([config]))
            blocks[dcp] = config.num_blocks
    print(f"{kv}: tokens a GPU's 1 GiB serves, 2 layers: " + ", ".join(f"dcp {d}: {t:,}" for d, t in tokens.items()))
    assert len(set(blocks.values())) == 1
    for dcp in (2, 4, 8):
        assert tokens[dcp] == dcp * tokens[1], (dcp, tokens)
