"""Decode context parallelism in the plan (issue 43): ``check --decode-context-parallel-size N`` (``--dcp``).

Every kernel choice is sized by the heads a call sees (heads per rank x N: vLLM gathers the DCP group's
heads), the capacity says what each GPU keeps (1/N) and what that buys (N x the tokens a GiB), and what
vLLM refuses or the plugin cannot serve is refused with given / supported / fix: a size that does not
divide TP, DeepSeek-V4, nvfp4_ds_mla under vLLM 0.34 (its config validator), an indexer top-k vLLM's DCP
merge does not rank, GLM-5.3-Flash's pooled keys split over ranks, and a kernel that returns no LSE.

SGLang's ``--dcp-size N`` (issue 44) plans the same way, with SGLang's facts: its merge (no top-k merge: its
indexer cache is replicated) and its own DCP refusals in its words (HiCache, PD disaggregation,
``--speculative-eagle-topk`` > 1, a pooled indexer), served without DCP. A learned sink follows one rule in
both engines (issue 50): the rank whose heads they are counts it. Every DCP refusal is the policy's, in one
place, for every family; a family that declares nothing about DCP is refused there.
"""

from __future__ import annotations

import json

import pytest
from support.cli import assert_three_parts, decision_of
from support.decisions import _edge_ctx, _edge_registry

from mla_sm120_plugin import cli

GLM5 = ["check", "--model", "glm-5", "--tp", "8", "--kv-cache-dtype", "fp8_ds_mla"]


def _json(capsys, *args: str) -> dict:
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dcp", [2, 4, 8])
@pytest.mark.parametrize("release,sm,kv", [("0.33.0", "12.0", "fp8_ds_mla"), ("0.34.0", "12.1", "fp8_ds_mla"),
                                           ("0.33.0", "12.1", "nvfp4_ds_mla"), ("0.34.0", "12.0", "bfloat16")])
def test_the_plan_is_sized_by_the_gathered_heads_and_each_gpu_keeps_one_nth(capsys, dcp, release, sm, kv):
    report = _json(capsys, "check", "--model", "glm-5", "--sm", sm, "--tp", "8", "--kv-cache-dtype", kv,
                   "--engine-version", release, "--decode-context-parallel-size", str(dcp))
    decision = decision_of(report)
    assert report["decode_context_parallel_size"] == dcp and report["engine_release"] == release
    assert (decision["heads_per_rank"], decision["heads_per_call"]) == (8, 8 * dcp)  # GLM-5: 64 heads, TP 8
    assert set(decision["kernels"]) == {"prefill", "decode"}
    cap = report["capacity"]
    mine = cap["layouts"][decision["kv_cache_dtype"]]["tokens_per_gib"]
    assert cap["decode_context_parallel"] == {"size": dcp, "kept_per_gpu": f"1/{dcp}",
                                              "tokens_per_gib_per_gpu": mine * dcp, "ratio_vs_dcp_1": float(dcp)}


def test_the_text_names_the_kernels_at_the_gathered_heads_and_the_tokens_each_gpu_holds(capsys):
    assert cli.main([*GLM5, "--sm", "12.0", "--dcp", "8"]) == 0
    out = capsys.readouterr().out
    assert "shape      64 heads a call, gathered over decode context parallel 8 (8 per rank, tensor parallel 8)" in out
    assert ("dcp        8 ranks share the cache by token: each GPU keeps 1/8 of it, 13,094,408 tokens of context a "
            "GiB of each GPU per layer in fp8_ds_mla (8.00x dcp 1)") in out  # 1,636,801 x 8
    assert "decode   flashinfer_sparse_mla    SELECTED" in out and "prefill  flashinfer_sparse_mla    SELECTED" in out
    assert "CuteDSL" in out  # vLLM's top-k merge, named with what it runs on


def test_dcp_1_plans_as_before(capsys):
    plain, one = _json(capsys, *GLM5, "--sm", "12.0"), _json(capsys, *GLM5, "--sm", "12.0", "--dcp", "1")
    assert plain == one and "decode_context_parallel" not in plain["capacity"]
    assert decision_of(plain)["heads_per_call"] == decision_of(plain)["heads_per_rank"] == 8


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_hy_v4_names_the_one_sink_rule_in_both_engines(capsys, engine):
    assert cli.main(["check", "--engine", engine, "--model", "hy-v4", "--sm", "12.0", "--tp", "4", "--dcp", "2"]) == 0
    out = capsys.readouterr().out
    assert ("learned sinks under decode context parallelism: each head's learned sink is counted by the DCP rank "
            "whose heads they are") in out
    assert "the other ranks count none for that head, so the merged softmax counts each sink once" in out


def test_glm53_flash_needs_its_pools_on_one_rank(capsys):
    args = ["check", "--model", "glm-5.3-flash", "--sm", "12.0", "--tp", "4", "--dcp", "2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--cp-kv-cache-interleave-size 1 for an indexer that pools 4 keys a pick" in err
    assert "fix: pass --cp-kv-cache-interleave-size 4" in err
    assert cli.main([*args, "--cp-kv-cache-interleave-size", "4"]) == 0


@pytest.mark.parametrize("args,given", [
    (["--model", "glm-5", "--tp", "8", "--dcp", "3"], "--decode-context-parallel-size 3 with tensor_parallel_size=8"),
    (["--model", "deepseek-v4-flash", "--tp", "4", "--dcp", "2"],
     "--decode-context-parallel-size 2: DeepSeek-V4's window and compressed caches are read whole"),
    (["--model", "glm-5", "--tp", "8", "--dcp", "4", "--kv-cache-dtype", "nvfp4_ds_mla", "--engine-version", "0.34.0"],
     "vLLM 0.34.0 refuses it at config"),
])
def test_what_cannot_be_served_under_dcp_is_refused_in_three_parts(capsys, args, given):
    assert cli.main(["check", "--sm", "12.0", *args]) == 2
    err = capsys.readouterr().err.removeprefix("mla-sm120 check: UnsupportedConfiguration: ")
    assert given in err
    assert_three_parts(err[err.index("given: "):])  # a multi-kind plan first names the kinds


def test_an_indexer_top_k_vllms_merge_does_not_rank_is_refused(tmp_path, capsys):
    from support.model_configs import write_model

    model = write_model(tmp_path, "glm", index_topk=256, heads=64)
    assert cli.main(["check", "--model", model, "--sm", "12.0", "--tp", "8"]) == 0
    capsys.readouterr()
    assert cli.main(["check", "--model", model, "--sm", "12.0", "--tp", "8", "--dcp", "2"]) == 2
    assert "an indexer of top-k 256: vLLM's DCP top-k merge ranks 512/1024/2048 picks a row" in capsys.readouterr().err


def test_a_kernel_without_an_lse_serves_no_dcp_context():
    import dataclasses

    from mla_sm120_plugin.selection import select

    reg = _edge_registry()  # a third-party kernel of the highest priority; returns_lse left False
    ctx = _edge_ctx(heads=16)
    assert select(ctx, registry=reg).decode == "edge"
    dcp = select(dataclasses.replace(ctx, decode_context_parallel_size=2, tensor_parallel_size=2), registry=reg)
    assert dcp.decode != "edge"
    (why,) = {r for rej in dcp.rejections if rej.kernel == "edge" for r in rej.reasons}
    assert why.startswith("returns no LSE: decode context parallelism (dcp=2) merges the ranks' partial outputs")


def test_the_policy_refuses_a_dcp_size_that_does_not_divide_tp_for_every_family(capsys):
    for model in ("glm-5", "deepseek-v4-flash"):
        assert cli.main(["check", "--model", model, "--sm", "12.0", "--tp", "4", "--dcp", "8"]) == 2
        err = capsys.readouterr().err
        assert "supported: a DCP size that divides the TP size (1, 2, 4)" in err, (model, err)


def test_a_family_that_declares_nothing_about_dcp_is_refused_under_dcp():
    """Silence is a refusal: the one place the plan's DCP rules live asks the family, not a list of families."""
    import dataclasses

    from mla_sm120_plugin import families
    from mla_sm120_plugin.rules import dcp_refusals

    ctx = dataclasses.replace(_edge_ctx(heads=16), decode_context_parallel_size=2, tensor_parallel_size=2)

    class Silent:  # a family object with everything but a DCP declaration
        label = "Silent"

    (refusal,) = list(dcp_refusals(ctx, Silent()))
    assert "its family declares nothing about decode context parallelism" in refusal.reason
    assert refusal.fix == "set --decode-context-parallel-size 1 (each GPU keeps the whole cache)"
    assert list(dcp_refusals(ctx, families.get("dsa"))) == []
    (dsv4,) = list(dcp_refusals(ctx, families.get("dsv4")))
    assert "DeepSeek-V4's window and compressed caches are read whole" in dsv4.reason
    assert list(dcp_refusals(dataclasses.replace(ctx, decode_context_parallel_size=1), Silent())) == []


SGLANG_GLM5 = ["check", "--engine", "sglang", "--model", "glm-5", "--sm", "12.0", "--tp", "8", "--kv-cache-dtype",
               "fp8_e4m3"]


def test_sglang_plans_its_dcp_size_at_the_gathered_heads(capsys):
    report = _json(capsys, *SGLANG_GLM5, "--dcp-size", "4")
    decision = decision_of(report)
    assert (decision["heads_per_rank"], decision["heads_per_call"]) == (8, 32)
    assert set(decision["kernels"]) == {"prefill", "decode"}
    assert report["capacity"]["decode_context_parallel"]["ratio_vs_dcp_1"] == 4.0
    assert cli.main([*SGLANG_GLM5, "--dcp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "32 heads a call, gathered over decode context parallel 4 (8 per rank, tensor parallel 8)" in out
    assert "SGLang merges the ranks' partial outputs by their base-2 LSE" in out and "CuteDSL" not in out


def test_sglang_hy_v4_under_dcp_names_the_lifted_refusal(capsys):
    assert cli.main(["check", "--engine", "sglang", "--model", "hy-v4", "--sm", "12.0", "--tp", "4",
                     "--dcp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "SGLang alone refuses --dcp-size > 1 for HY V4 (no single owner of a sink); --mla-sm120 lifts it" in out


@pytest.mark.parametrize("extra,given,fix", [
    (["--engine-feature", "hicache"], "--dcp-size 4 with hicache on: SGLang 0.5.23 refuses it: 'DSA DCP does not "
     "support HiSparse or HiCache.'", "drop --enable-hierarchical-cache, or set --dcp-size 1"),
    (["--engine-feature", "pd_disaggregation"], "'DSA DCP does not support PD disaggregation.'",
     "serve without --disaggregation-mode"),
    (["--engine-feature", "eagle_topk"], "'DSA DCP requires --speculative-eagle-topk 1.'",
     "pass --speculative-eagle-topk 1"),
])
def test_sglangs_own_dcp_refusals_in_its_words_and_only_under_dcp(capsys, extra, given, fix):
    assert cli.main([*SGLANG_GLM5, "--dcp-size", "4", *extra]) == 2
    err = capsys.readouterr().err
    assert given in err and fix in err
    assert_three_parts(err[err.index("given: "):])
    assert cli.main([*SGLANG_GLM5, *extra]) == 0  # served without DCP


def test_sglang_refuses_a_pooled_indexer_under_dcp_whatever_the_interleave(capsys):
    args = ["check", "--engine", "sglang", "--model", "glm-5.3-flash", "--sm", "12.0", "--tp", "4", "--dcp-size", "2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "an indexer that pools 4 keys a pick: SGLang 0.5.23 refuses it" in err
    assert "fix: set --dcp-size 1" in err
    assert cli.main(args[:-2]) == 0


def test_an_engine_feature_the_engine_lacks_is_refused(capsys):
    assert cli.main([*SGLANG_GLM5, "--engine-feature", "pcp"]) == 2
    err = capsys.readouterr().err
    assert "given: --engine-feature pcp with --engine sglang" in err
    assert "SGLang's features: eagle_topk, hicache, hisparse, pd_disaggregation, skip_softmax" in err


def test_sglang_has_no_interleave_setting(capsys):
    assert cli.main([*SGLANG_GLM5, "--dcp-size", "4", "--cp-kv-cache-interleave-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--cp-kv-cache-interleave-size 4 under SGLang 0.5.23: it has no such setting" in err
    assert "fix: drop --cp-kv-cache-interleave-size" in err
