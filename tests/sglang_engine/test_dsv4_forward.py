"""DeepSeek-V4 attention through SGLang 0.5.23's SM120 entry (``flash_mla_with_kvcache_sm120``) on
the CPU, with and without the plugin.

The launcher plans with SGLang's own resolved settings (tests/sglang_engine/test_dsv4_launch.py);
a scheduler binds from the exported plan; the call is SGLang's own keyword call, on its 256-token
window pages and 256 / ratio compressed pages (page-major 584-byte records, pages padded to
multiples of 576 bytes). With the opt-in the plan's kernel runs (on this CPU FlashInfer cannot,
so the plugin's Triton kernel, under Triton's interpreter) and matches the float64 oracle written
from the bytes; without it SGLang's own path runs: its FlashInfer path fails on this machine, its
torch path matches the oracle too.
"""

from __future__ import annotations

import logging

import pytest
import torch
from support.oracle import dsv4_sparse_attention
from test_dsv4_launch import _launch, _model

from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack

import sglang.kernels.ops.attention.flash_mla_sm120 as sm120  # noqa: E402  (hooks applied by conftest)

REC = layout.FP8_RECORD
SGLANG_PAGE = 256


def _pool(num_pages, page_size, seed):
    """SGLang's pool ([pages, padded page bytes] uint8, torch.zeros) and the view its backend passes."""
    gen = torch.Generator().manual_seed(seed)
    pool = pack.new_cache(num_pages, page_size)
    rows = torch.randn(num_pages * page_size, 512, generator=gen).to(torch.bfloat16)
    pack.write(pool, rows, torch.arange(num_pages * page_size), page_size)
    view = pool[:, : page_size * REC.token_bytes].view(num_pages, page_size, 1, REC.token_bytes)
    return view.view(torch.float8_e4m3fn), pool


def _call(tokens, heads, extra_page, seed=0, out_of_range=True):
    gen = torch.Generator().manual_seed(seed)
    k_cache, swa_pool = _pool(2, SGLANG_PAGE, seed + 1)
    idx = torch.randint(0, 2 * SGLANG_PAGE, (tokens, 1, 64), generator=gen, dtype=torch.int32)
    idx[0, 0, :2] = -1
    lens = torch.randint(0, 65, (tokens,), generator=gen, dtype=torch.int32)
    lens[0] = 64
    sinks = torch.randn(heads, generator=gen)
    sinks[0] = float("-inf")
    kwargs = dict(q=(torch.randn(tokens, 1, heads, 512, generator=gen) / 4).to(torch.bfloat16), k_cache=k_cache,
                  head_dim_v=512, softmax_scale=512**-0.5, indices=idx, topk_length=lens, attn_sink=sinks,
                  extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    parts = [(swa_pool, idx[:, 0], lens, SGLANG_PAGE)]
    if extra_page:
        extra, extra_pool = _pool(4, extra_page, seed + 2)
        eidx = torch.randint(0, 4 * extra_page, (tokens, 1, 64), generator=gen, dtype=torch.int32)
        if out_of_range:  # masked by the plugin's kernel (SGLang's torch path indexes past its pool)
            eidx[1 % tokens, 0, 3] = 4 * extra_page + 5
        elens = torch.randint(0, 65, (tokens,), generator=gen, dtype=torch.int32)
        kwargs.update(extra_k_cache=extra, extra_indices_in_kvcache=eidx, extra_topk_length=elens)
        parts.append((extra_pool, eidx[:, 0], elens, extra_page))
    want, _ = dsv4_sparse_attention(kwargs["q"][:, 0], parts, sinks)
    return kwargs, want


@pytest.fixture
def planned(tmp_path, capability, caplog):
    """A V4 launch at TP4 on SM 12.0 (16 heads a rank; c4a pages of 64 entries, c128a of 2)."""
    capability(12, 0)
    caplog.set_level(logging.INFO, logger="mla_sm120_plugin")
    _launch(_model(tmp_path), tp_size=4)
    return caplog


@pytest.mark.self_check  # asserts the DeepSeek-V4 self-check's line in SGLang's call
@pytest.mark.parametrize("tokens, extra_page", [(3, 64), (2, 2), (2, 0), (65, 0)],
                         ids=["c4a-decode", "c128a-decode", "window-decode", "window-prefill-form"])
def test_the_plans_kernel_serves_sglangs_call_and_matches_float64(planned, tokens, extra_page):
    kwargs, want = _call(tokens, 16, extra_page)
    out, lse = sm120.flash_mla_with_kvcache_sm120(**kwargs)
    assert lse is None and out.shape == (tokens, 1, 16, 512) and out.dtype == torch.bfloat16
    assert EXACT_CLASS_BOUND.violations(measure(out[:, 0], want)) == []
    state = dsv4.bound_state()
    assert {kind: b.decision.context.call.extra_page for kind, b in state.kinds.items()} == {
        "c4a": 64, "c128a": 2, "window": 0}
    assert any("c4a self-check: " in r.getMessage() and "decode=triton_dsv4 ok" in r.getMessage()
               for r in planned.records)


def test_without_the_opt_in_sglangs_own_paths_run(planned, monkeypatch):
    monkeypatch.delenv("MLA_SM120_SGLANG")
    kwargs, want = _call(2, 16, 64, out_of_range=False)
    monkeypatch.setattr(sm120, "_sm120_default_backend", "flashinfer")
    with pytest.raises(Exception):  # SGLang's FlashInfer path needs a GPU: nothing of ours ran
        sm120.flash_mla_with_kvcache_sm120(**kwargs)
    monkeypatch.setattr(sm120, "_sm120_default_backend", "torch")
    out, _ = sm120.flash_mla_with_kvcache_sm120(**kwargs)
    got = measure(out[:, 0], want)
    assert got.rel_rms < 1e-2, got  # SGLang's torch path, against the same oracle


def test_an_unplanned_compressed_page_is_refused_naming_the_plan(planned):
    kwargs, _ = _call(2, 16, 32)
    with pytest.raises(Exception) as err:
        sm120.flash_mla_with_kvcache_sm120(**kwargs)
    assert "compressed cache of 32 entries a page" in str(err.value) and "c4a (64)" in str(err.value)


def test_a_split_call_carves_its_partials_from_the_scratch_set_aside_at_init(planned, monkeypatch):
    """Graph safety in SGLang: the backend's init sets aside the partials' bytes once (outside
    inference mode); a split call under inference mode then writes them there and allocates only
    its ``out`` (SGLang's call passes none, and its FlashInfer path returns a new one too). The call
    is small enough that its plan is one pass, so the split is forced (MLA_SM120_SPLITS)."""
    from support.kernel_checks import CountingAllocator

    from mla_sm120_plugin.kernels.dsv4 import plan

    dsv4.bound_state()  # the backend's init: bind and self-check (its cases allocate, before capture)
    scratch = dsv4.scratch_for(torch.device("cpu"))
    assert scratch.numel() == plan.scratch_bound() and not scratch.is_inference()
    assert dsv4.scratch_for(torch.device("cpu")) is scratch  # made once
    scratch.fill_(0xFF)
    monkeypatch.setenv("MLA_SM120_SPLITS", "3")
    kwargs, want = _call(3, 16, 64)
    with torch.inference_mode(), CountingAllocator() as counted:
        out, _ = sm120.flash_mla_with_kvcache_sm120(**kwargs)
    assert EXACT_CLASS_BOUND.violations(measure(out[:, 0], want)) == []
    assert [(shape, dtype) for _, shape, dtype in counted.allocations] == [((3, 16, 512), torch.bfloat16)]
    assert int((scratch != 0xFF).sum()) > 0  # the split partials were written into it
