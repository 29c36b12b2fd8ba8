"""The configuration table and the traffic model (kernels/dsa/plan.py): pure Python, no GPU.

What the issue asks the model to show, for both Triton kernels on every family: at T=64, 4-16
heads, top-k 2048 the modeled bytes stay within 1.25x of the minimum; at T=1, 8-16 heads, the
partials written and read back are no more bytes than the cache rows read.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from support.cli import clean_env

from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.kernels.dsa import plan

KERNELS = list(plan.KERNELS)
FAMILIES = list(plan.FAMILIES)


def _layout_read_by(kernel: str, kv_layout: str) -> None:
    """Skip a kernel/layout pair no call makes (the fast kernel never reads nvfp4 rows)."""
    if kernel == plan.FAST.name and layout.get(kv_layout).nvfp4:
        pytest.skip(f"{kernel} hands {kv_layout} to the exact kernel")


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [4, 8, 16])
def test_t64_stays_within_a_quarter_of_the_minimum(kernel, family, heads, kv_layout):
    _layout_read_by(kernel, kv_layout)
    report = plan.plan_report(kernel, 64, heads, 2048, family, kv_layout=kv_layout)
    if family == "sm120":
        # 64 programs < 170 SMs: the shape splits there (so the bound is not trivial), unless the
        # unsplit launch is already DRAM bound in the model (bf16 rows: splitting adds bytes, no time)
        fam = plan.FAMILIES[family]
        unsplit = plan.traffic(plan.KERNELS[kernel].config(1, 2048 // plan.KERNELS[kernel].block_k), 64, heads,
                               2048, kv_layout=kv_layout)
        chain_us = 2048 // plan.KERNELS[kernel].block_k * plan.LATENCY_US
        assert report["num_splits"] > 1 or fam.seconds(unsplit.total) * 1e6 >= chain_us, report
    assert report["traffic"]["ratio"] <= 1.25, report


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [8, 16])
def test_t1_partials_are_no_more_bytes_than_the_cache_rows(kernel, family, heads, kv_layout):
    _layout_read_by(kernel, kv_layout)
    report = plan.plan_report(kernel, 1, heads, 2048, family, kv_layout=kv_layout)
    assert report["num_splits"] > 1, report
    assert report["traffic"]["partials"] <= report["traffic"]["cache"], report


def test_the_model_counts_what_a_hand_count_gives():
    """T=1, 16 heads, top-k 2048 in 22 fp32 splits of 96 candidates, bf16 q and out."""
    cfg = plan.FAST.config(22, 3)
    t = plan.traffic(cfg, 1, 16, 2048)
    assert t.cache == 2048 * 656
    assert t.q == 22 * 16 * 576 * 2  # every split reloads q
    assert t.indices == 2048 * 4 + 22 * 32 * 4  # plus the step each split prefetches past its range
    assert t.partials == 22 * 16 * (512 * 4 + 4) * 2  # written, then read back by the combine
    assert t.output == 16 * 512 * 2
    assert t.minimum == 2048 * 656 + 16 * 576 * 2 + 2048 * 4 + 16 * 512 * 2
    # Several head blocks read the rows once each; one split moves no partials.
    assert plan.traffic(plan.EXACT.config(1, 64), 2, 40, 2048).cache == 2 * 3 * 2048 * 656
    assert plan.traffic(plan.EXACT.config(1, 64), 2, 40, 2048).partials == 0


def test_rope_less_rows_count_the_bytes_a_kernel_loads():
    """GLM-5.3-Flash at T=1, 16 heads, vLLM's 2176-wide rows: a rope-less fp8 row is 528 bytes read
    whether stored in 656 (the reserved tail is never loaded) or 528; q is 512 wide."""
    cfg = plan.FAST.config(22, 4)
    for kv_layout in ("fp8_ds_mla_nope", "fp8_nope"):
        t = plan.traffic(cfg, 1, 16, 2176, kv_layout=kv_layout)
        assert plan.row_bytes_read(kv_layout) == 528
        assert t.cache == 2176 * 528
        assert t.q == 22 * 16 * 512 * 2
        assert t.minimum == 2176 * 528 + 16 * 512 * 2 + 2176 * 4 + 16 * 512 * 2
    assert plan.traffic(cfg, 1, 16, 2176, kv_layout="bf16_nope").cache == 2176 * 512 * 2
    assert plan.row_bytes_read(layout.FP8_DS_MLA) == 656 and plan.row_bytes_read(layout.BF16) == 1152
    assert plan.plan_report(plan.FAST.name, 1, 16, 2176, kv_layout="fp8_nope")["kv_layout"] == "fp8_nope"


def test_the_model_is_the_launch_plans_own_arithmetic():
    """The model's partial bytes and programs are those of the launches a call really makes (built
    on CPU tensors, never launched)."""
    torch = pytest.importorskip("torch")
    from mla_sm120_plugin.kernels.dsa import pack
    from mla_sm120_plugin.kernels.dsa import triton_fast as tf

    tokens, heads, topk = 3, 20, 512
    cfg = plan.launch_config(plan.FAST.name, tokens, heads, topk)
    assert cfg.num_splits > 1
    q = torch.empty(tokens, heads, layout.HEAD_DIM, dtype=torch.bfloat16)
    launches = tf.launch_plan(q, pack.make_cache(2, layout.FP8_DS_MLA), torch.empty(tokens, topk, dtype=torch.int32),
                              sm_scale=0.1, kv_layout=layout.FP8_DS_MLA, topk_length=None, sink=None,
                              out=torch.empty(tokens, heads, layout.KV_LORA_RANK, dtype=torch.bfloat16), lse=None,
                              lse_base="e", cfg=cfg, interpret=False)
    main, combine = launches
    assert main.grid == (tokens, -(-heads // cfg.block_h), cfg.num_splits)
    partials, partial_lse = combine.args[0], combine.args[4]
    written = partials.numel() * partials.element_size() + partial_lse.numel() * partial_lse.element_size()
    assert plan.traffic(cfg, tokens, heads, topk).partials == 2 * written


def test_every_table_entry_splits_into_whole_nonempty_steps():
    for kernel in KERNELS:
        shape = plan.KERNELS[kernel]
        for family in FAMILIES:
            for kv_layout in layout.KV_LAYOUTS:
                table = plan.table(kernel, family, kv_layout)
                assert len(table) == len(plan.HEAD_BUCKETS) * len(plan.TOKEN_BUCKETS) * len(plan.TOPK_BUCKETS)
                for (heads, tokens, topk), (chunk, reason) in table.items():
                    assert chunk % shape.block_k == 0 and chunk > 0 and reason
                    assert -(-topk // chunk) <= plan.MAX_SPLITS


@pytest.mark.parametrize("kernel", KERNELS)
def test_any_shape_gets_splits_that_cover_top_k_exactly_once(kernel):
    for tokens in (1, 2, 3, 5, 64, 65, 300, 5000):
        for heads in (1, 4, 5, 16, 17, 64, 128):
            for topk in (1, 31, 37, 100, 640, 2048, 2176, 4096):
                cfg = plan.launch_config(kernel, tokens, heads, topk)
                blocks = -(-topk // cfg.block_k)
                assert (cfg.num_splits - 1) * cfg.blocks_per_split < blocks <= cfg.num_splits * cfg.blocks_per_split
                assert 1 <= cfg.num_splits <= plan.MAX_SPLITS


def test_smaller_rows_never_get_more_splits():
    """The byte budget follows the row: at T=1 the 352-byte nvfp4 rows split no more than the
    656-byte fp8 rows (more splits would move more partial bytes than the cache itself)."""
    for family in FAMILIES:
        for heads in (4, 8, 16, 64):
            fp8 = plan.launch_config(plan.EXACT.name, 1, heads, 2048, family, layout.FP8_DS_MLA)
            fp4 = plan.launch_config(plan.EXACT.name, 1, heads, 2048, family, layout.NVFP4_DS_MLA)
            assert 1 < fp4.num_splits <= fp8.num_splits, (family, heads, fp4, fp8)
    # On sm120 at 8 heads: half the splits (32 -> 16), the table being per layout.
    assert (plan.launch_config(plan.EXACT.name, 1, 8, 2048, "sm120", layout.NVFP4_DS_MLA).num_splits
            < plan.launch_config(plan.EXACT.name, 1, 8, 2048, "sm120", layout.FP8_DS_MLA).num_splits)


def test_few_tokens_split_and_many_do_not():
    for kernel in KERNELS:
        assert plan.launch_config(kernel, 1, 16, 2048).num_splits > 1
        assert plan.launch_config(kernel, 4096, 128, 2048).num_splits == 1
        assert plan.launch_config(kernel, 2048, 16, 2048).num_splits == 1


def test_the_table_is_deterministic_and_follows_its_rule():
    """No autotuning: the table a fresh process builds is the one this one has, and an entry is
    the rule's choice at its bucket's edge."""
    code = ("import json; from mla_sm120_plugin.kernels.dsa import plan as p; "
            "print(json.dumps({k: {str(key): v[0] for key, v in p.table(k, 'sm120').items()} for k in p.KERNELS}))")
    fresh = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=clean_env()).stdout)
    for kernel in KERNELS:
        here = {str(key): v[0] for key, v in plan.table(kernel, "sm120").items()}
        assert fresh[kernel] == here
    chunk, _ = plan.choose_chunk(plan.FAST, plan.FAMILIES["sm120"], 64, 16, 2048)
    assert plan.table(plan.FAST.name, "sm120")[(16, 64, 2048)][0] == chunk
    # A shape inside a bucket gets its edge's chunk: T=3 is in the T<=4 bucket.
    assert plan.launch_config(plan.FAST.name, 3, 16, 2048) == plan.launch_config(plan.FAST.name, 4, 16, 2048)


def test_families():
    assert plan.gpu_family(12, 0) == "sm120" and plan.gpu_family(12, 1) == "sm121" and plan.gpu_family(9, 0) == "sm90"
    assert plan.gpu_family(8, 9) == plan.DEFAULT_FAMILY
    # A smaller GPU fills its wave with fewer splits.
    assert (plan.launch_config(plan.FAST.name, 1, 16, 2048, "sm121").num_splits
            <= plan.launch_config(plan.FAST.name, 1, 16, 2048, "sm120").num_splits)


def test_the_module_prints_the_model_and_the_table():
    done = subprocess.run([sys.executable, "-m", "mla_sm120_plugin.kernels.dsa.plan", "sm120", "--table"],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("family sm120")
    assert sum(re.match(r"triton_sparse_mla_fast +\d", line) is not None for line in lines) == len(plan.MUST_SHOW)
    assert any(line.startswith("triton_sparse_mla_fast on sm120: splits") for line in lines)
    # The torch-free promise: the plan imports neither torch nor triton.
    code = ("import sys; import mla_sm120_plugin.kernels.dsa.plan; "
            "print('torch' in sys.modules, 'triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=clean_env())
    assert done.stdout.split() == ["False", "False"]
