"""The DeepSeek-V4 kernels on FlashInfer's SM120 call surface (the one both engines make), and their self-check.

The engines hand the kernel ``[pages, P, 1, 584]`` views whose pages may sit further apart than
``P x 584`` bytes, ``[T, 1, K]`` index rows and keyword arguments; :func:`triton_dsv4` must read
them as they are and match the float64 oracle written from the bytes (tests/kernels). The
self-check must pass the real kernel and fail one that is 1 % off on one token.
"""

from __future__ import annotations

import pytest
import torch

from mla_sm120_plugin.dispatch import dsv4, selfcheck
from mla_sm120_plugin.dispatch.binding import BoundKernel, bind
from mla_sm120_plugin.dispatch.catalog import FLASHINFER_DSV4, TRITON_DSV4
from mla_sm120_plugin.errors import KernelInputError, UnsupportedConfiguration
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND, measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack
from support.oracle import dsv4_sparse_attention

REC = layout.FP8_RECORD
CPU = torch.device("cpu")


def _engine_view(num_pages, page_size, gap, seed, layout_name="NHD", fp8=False):
    """A cache as an engine allocates it (pages ``gap`` bytes further apart than padded) and the
    view it hands FlashInfer; returns (view, 2-D pages for the oracle)."""
    gen = torch.Generator().manual_seed(seed)
    stride = REC.page_bytes(page_size) + gap
    pool = pack.new_cache(num_pages, page_size, page_stride=stride)
    rows = torch.randn(num_pages * page_size, 512, generator=gen).to(torch.bfloat16)
    pack.write(pool, rows, torch.arange(num_pages * page_size), page_size)
    shape = (num_pages, page_size, 1, REC.token_bytes) if layout_name == "NHD" else (num_pages, 1, page_size, REC.token_bytes)
    strides = (stride, REC.token_bytes, REC.token_bytes, 1)
    view = pool.as_strided(shape, strides)
    return (view.view(torch.float8_e4m3fn) if fp8 else view), pool


@pytest.mark.parametrize("layout_name, fp8, gap", [("NHD", False, 0), ("NHD", True, 1152), ("HND", False, 576)])
def test_triton_dsv4_reads_the_engines_views_as_the_oracle_does(layout_name, fp8, gap):
    gen = torch.Generator().manual_seed(3)
    swa, swa_pages = _engine_view(3, 64, gap, 1, layout_name, fp8)
    comp, comp_pages = _engine_view(40, 2, gap, 2, layout_name, fp8)
    tokens, heads = 3, 8
    q = (torch.randn(tokens, heads, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(0, 3 * 64, (tokens, 1, 20), generator=gen, dtype=torch.int32)
    swa_idx[0, 0, :2] = torch.tensor([-1, 3 * 64])
    comp_idx = torch.randint(0, 80, (tokens, 1, 12), generator=gen, dtype=torch.int32)
    swa_len = torch.tensor([20, 5, 0], dtype=torch.int32)
    comp_len = torch.tensor([12, 12, 0], dtype=torch.int32)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0, 0.0, 30.0, -3.0, 1.0])
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16)
    got = dsv4.triton_dsv4(query=q, swa_kv_cache=swa, workspace_buffer=None, sparse_indices=swa_idx,
                           compressed_kv_cache=comp, out=out, bmm1_scale=512**-0.5, sinks=sinks,
                           kv_layout=layout_name, swa_topk_lens=swa_len, extra_sparse_indices=comp_idx,
                           extra_sparse_topk_lens=comp_len)
    assert got is out
    want, _ = dsv4_sparse_attention(q, [(swa_pages, swa_idx[:, 0], swa_len, 64),
                                        (comp_pages, comp_idx[:, 0], comp_len, 2)], sinks)
    assert EXACT_CLASS_BOUND.violations(measure(out, want)) == []
    assert bool((out[2] == 0).all())  # no candidate: zeros


@pytest.mark.parametrize("bad, names", [
    (dict(kv_cache_format="nvfp4"), "swa_kv_cache"),  # a 584-byte cache given as the 384-byte record
    (dict(kv_cache_format="bf16"), "kv_cache_format"),
    (dict(sparse_indices_are_storage_offsets=True), "sparse_indices_are_storage_offsets"),
    (dict(bmm1_scale=torch.tensor(0.04)), "bmm1_scale"),
    (dict(kv_layout="NCHW"), "kv_layout"),
    (dict(compressed_kv_cache="drop"), "compressed_kv_cache / extra_sparse_indices"),
    (dict(swa_kv_cache="bf16"), "swa_kv_cache"),
])
def test_bad_calls_are_refused_naming_the_argument(bad, names):
    swa, _ = _engine_view(2, 64, 0, 0)
    comp, _ = _engine_view(4, 2, 0, 1)
    kwargs = dict(query=torch.zeros(1, 8, 512, dtype=torch.bfloat16), swa_kv_cache=swa,
                  sparse_indices=torch.zeros(1, 1, 4, dtype=torch.int32), bmm1_scale=0.04, kv_layout="NHD",
                  compressed_kv_cache=comp, extra_sparse_indices=torch.zeros(1, 1, 4, dtype=torch.int32))
    if bad.get("compressed_kv_cache") == "drop":
        kwargs.pop("compressed_kv_cache")
    elif bad.get("swa_kv_cache") == "bf16":
        kwargs["swa_kv_cache"] = torch.zeros(2, 64, 1, 512, dtype=torch.bfloat16)
    else:
        kwargs.update(bad)
    with pytest.raises(KernelInputError) as err:
        dsv4.triton_dsv4(**kwargs)
    assert str(err.value).startswith("given: " + names) or names in str(err.value).splitlines()[0]


@pytest.mark.parametrize("heads, window_page, extra_page", [(8, 64, 64), (16, 64, 2), (64, 32, 0)])
def test_the_self_check_passes_the_triton_kernel(heads, window_page, extra_page):
    result = selfcheck.check(bind(TRITON_DSV4), phase="both", kv_layout=layout.FP8_DSV4, num_heads=heads,
                             pages=(window_page, extra_page), device=CPU)
    assert result.passed, result.error


def _one_percent_off(**kwargs):
    out = bind(TRITON_DSV4).fn(**kwargs)
    out[1] *= 1.01
    return out


def test_the_self_check_fails_a_kernel_one_percent_off_on_one_token():
    result = selfcheck.check(selfcheck.engine_kernel(TRITON_DSV4, _one_percent_off), phase="both",
                             kv_layout=layout.FP8_DSV4, num_heads=8, pages=(64, 2), device=CPU)
    assert not result.passed and "relRMS" in result.error


def _plan(precision=None):
    from mla_sm120_plugin import plan as plan_mod
    from mla_sm120_plugin.config import load_config
    from mla_sm120_plugin.context import EngineLimits
    from mla_sm120_plugin.device import from_capability
    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.modelinfo import resolve_model

    reg = get_registry()
    facts = resolve_model("deepseek-v4-flash", registry=reg)
    settings = load_config({"precision": precision} if precision else None, kernel_names=reg.kernels)
    return plan_mod.plan(facts, settings.for_model(facts.name, facts.arch), from_capability(12, 0, source="planned"),
                          None, EngineLimits(tensor_parallel_size=8), registry=reg)


def test_verify_falls_back_to_the_triton_kernel_when_flashinfers_fails_here():
    """Planned FlashInfer (the device is planned, so no probe ran); its kernel cannot run on this CPU:
    the self-check falls back to the next kernel the decision allows, and says so."""
    decision = _plan().decisions["c4a"]
    assert decision.kernels["decode"] == FLASHINFER_DSV4 and TRITON_DSV4 in decision.alternates["decode"]

    def flashinfer_here(**kwargs):
        raise RuntimeError("FlashInfer's SM120 module needs a GPU")

    assert decision.context.call.pages_at_call == (64, 64)
    kernels, line = selfcheck.verify(decision, engine_fns={FLASHINFER_DSV4: flashinfer_here}, strict=False,
                                device=CPU)
    assert kernels == {"decode": TRITON_DSV4, "prefill": TRITON_DSV4}
    assert "flashinfer_dsv4_sm120 FAILED (RuntimeError: FlashInfer's SM120 module needs a GPU); falling back to " \
           "triton_dsv4 ok" in line


def test_verify_refuses_when_every_kernel_fails(monkeypatch):
    decision = _plan(precision="exact").decisions["window"]
    assert decision.kernels["decode"] == TRITON_DSV4
    monkeypatch.setattr("mla_sm120_plugin.dispatch.selfcheck.bind",
                        lambda name: BoundKernel(name, _one_percent_off, False, False, True))
    with pytest.raises(UnsupportedConfiguration) as err:
        selfcheck.verify(decision, device=CPU, strict=False)
    assert "DeepSeek-V4 window prefill kernel triton_dsv4 failed its self-check" in str(err.value)


def test_triton_dsv4_reads_the_nvfp4_record_when_told_the_format():
    """vLLM's call passes no kv_cache_format; the NVFP4 route adds FlashInfer's "nvfp4": the same call
    on [pages, P, 1, 384] views, against the oracle reading the 384-byte bytes."""
    rec = layout.NVFP4_RECORD
    gen = torch.Generator().manual_seed(5)
    views, pools = [], []
    for pages, page_size, seed in ((3, 64, 1), (40, 2, 2)):
        pool = pack.new_cache(pages, page_size, page_stride=rec.page_bytes(page_size) + 64, record=rec)
        rows = torch.randn(pages * page_size, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        pack.write(pool, rows, torch.arange(pages * page_size), page_size, record=rec)
        views.append(pool.as_strided((pages, page_size, 1, 384), (pool.stride(0), 384, 384, 1)))
        pools.append(pool)
    q = (torch.randn(2, 16, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(-1, 3 * 64 + 2, (2, 1, 30), generator=gen, dtype=torch.int32)
    comp_idx = torch.randint(0, 80, (2, 1, 9), generator=gen, dtype=torch.int32)
    sinks = torch.randn(16, generator=gen)
    got = dsv4.triton_dsv4(query=q, swa_kv_cache=views[0], sparse_indices=swa_idx, compressed_kv_cache=views[1],
                           bmm1_scale=512**-0.5, sinks=sinks, kv_layout="NHD", extra_sparse_indices=comp_idx,
                           kv_cache_format="nvfp4")
    want, _ = dsv4_sparse_attention(q, [(pools[0], swa_idx[:, 0], None, 64), (pools[1], comp_idx[:, 0], None, 2)],
                                    sinks, record="nvfp4")
    assert EXACT_CLASS_BOUND.violations(measure(got, want)) == []
    with pytest.raises(KernelInputError) as err:  # the same bytes read as the 584-byte record: refused
        dsv4.triton_dsv4(query=q, swa_kv_cache=views[0], sparse_indices=swa_idx, kv_layout="NHD")
    assert str(err.value).startswith("given: swa_kv_cache")


def test_the_self_check_runs_on_the_plans_record():
    result = selfcheck.check(bind(TRITON_DSV4), phase="both", kv_layout=layout.NVFP4_DSV4, num_heads=16,
                             pages=(64, 2), device=CPU)
    assert result.passed and result.key.kv_layout == layout.NVFP4_DSV4, result.error
    # another key: results are cached per (kernel, heads, pages, device, record)
    bad = selfcheck.check(selfcheck.engine_kernel(TRITON_DSV4, _one_percent_off), phase="both",
                          kv_layout=layout.NVFP4_DSV4, num_heads=32, pages=(64, 2), device=CPU)
    assert not bad.passed and "relRMS" in bad.error


def _small_call(window=10, extra=6, **overrides):
    """A two-cache call on the engines' views, and the oracle's answer for it."""
    gen = torch.Generator().manual_seed(11)
    swa, swa_pages = _engine_view(2, 64, 0, 1)
    comp, comp_pages = _engine_view(8, 2, 0, 2)
    q = (torch.randn(2, 8, 512, generator=gen) / 4).to(torch.bfloat16)
    swa_idx = torch.randint(0, 128, (2, 1, window), generator=gen, dtype=torch.int32)
    comp_idx = torch.randint(0, 16, (2, 1, extra), generator=gen, dtype=torch.int32)
    kwargs = dict(query=q, swa_kv_cache=swa, sparse_indices=swa_idx, compressed_kv_cache=comp,
                  extra_sparse_indices=comp_idx, bmm1_scale=512**-0.5, kv_layout="NHD")
    kwargs.update(overrides)
    want, _ = dsv4_sparse_attention(
        q, [(swa_pages, kwargs["sparse_indices"][:, 0].clamp(-1, 2**31 - 1), None, 64),
            (comp_pages, kwargs["extra_sparse_indices"][:, 0].clamp(-1, 2**31 - 1), None, 2)], None)
    return kwargs, want


def test_int64_ids_no_int32_holds_are_masked_not_wrapped():
    """2**32 + 18 narrowed to int32 keeps its low bits (slot 18); it is outside every cache and must
    count as an out-of-range id: the same output as the oracle masking it."""
    kwargs, _ = _small_call()
    wide = kwargs["sparse_indices"].to(torch.int64)
    wide[0, 0, :3] = torch.tensor([2**32 + 18, 2**40 + 5, -(2**33) + 7])
    comp_wide = kwargs["extra_sparse_indices"].to(torch.int64)
    comp_wide[1, 0, 0] = 2**32 + 1
    kwargs, want = _small_call(sparse_indices=wide, extra_sparse_indices=comp_wide)
    got = dsv4.triton_dsv4(**kwargs)
    assert EXACT_CLASS_BOUND.violations(measure(got, want)) == []
    # what narrowing alone would have read: slot 18 and friends, a different answer
    wrapped = wide.to(torch.int32)
    assert int(wrapped[0, 0, 0]) == 18
    wrong = dsv4.triton_dsv4(**dict(kwargs, sparse_indices=wrapped, extra_sparse_indices=comp_wide.to(torch.int32)))
    assert EXACT_CLASS_BOUND.violations(measure(wrong, want)) != []


def test_a_token_stride_other_than_the_records_is_refused():
    pool = pack.new_cache(2, 64, page_stride=2 * REC.page_bytes(64))
    padded = pool.as_strided((2, 32, 1, REC.token_bytes), (pool.stride(0), 2 * REC.token_bytes, REC.token_bytes, 1))
    kwargs, _ = _small_call(swa_kv_cache=padded)
    with pytest.raises(KernelInputError) as err:
        dsv4.triton_dsv4(**kwargs)
    assert str(err.value).startswith("given: swa_kv_cache: a token stride of 1168 bytes")
    assert "584 bytes a token" in str(err.value)


def test_flashinfers_ignored_keywords_are_taken_and_change_nothing():
    kwargs, want = _small_call()
    plain = dsv4.triton_dsv4(**kwargs)
    got = dsv4.triton_dsv4(**kwargs, cum_seq_lens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_q_len=1,
                           enable_pdl=True)
    assert torch.equal(got, plain)
    assert EXACT_CLASS_BOUND.violations(measure(got, want)) == []
    with pytest.raises(KernelInputError) as err:  # read by TRT-LLM, dropped by FlashInfer's SM120 route: refused
        dsv4.triton_dsv4(**kwargs, seq_lens=torch.tensor([5, 5], dtype=torch.int32))
    assert str(err.value).startswith("given: seq_lens: set")


def test_the_cake_backend_is_flashinfers_nvfp4_route_and_nothing_else():
    rec = layout.NVFP4_RECORD
    pool = pack.new_cache(2, 64, record=rec)
    rows = torch.randn(128, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    pack.write(pool, rows, torch.arange(128), 64, record=rec)
    view = pool.as_strided((2, 64, 1, rec.token_bytes), (pool.stride(0), rec.token_bytes, rec.token_bytes, 1))
    q = (torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(6)) / 4).to(torch.bfloat16)
    idx = torch.randint(-1, 130, (2, 1, 12), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    call = dict(query=q, swa_kv_cache=view, sparse_indices=idx, bmm1_scale=512**-0.5, kv_layout="NHD",
                kv_cache_format="nvfp4")
    got = dsv4.triton_dsv4(**call, backend="cake")
    assert torch.equal(got, dsv4.triton_dsv4(**call))
    want, _ = dsv4_sparse_attention(q, [(pool, idx[:, 0], None, 64)], None, record="nvfp4")
    assert EXACT_CLASS_BOUND.violations(measure(got, want)) == []
    with pytest.raises(KernelInputError) as err:  # FlashInfer's cake route refuses PDL with NVFP4
        dsv4.triton_dsv4(**call, backend="cake", enable_pdl=True)
    assert str(err.value).startswith("given: enable_pdl: True with backend='cake'")
    kwargs, _ = _small_call()
    with pytest.raises(KernelInputError) as err:  # cake reads the NVFP4 record only
        dsv4.triton_dsv4(**kwargs, backend="cake")
    assert str(err.value).startswith("given: backend: 'cake' with kv_cache_format='fp8'")


def test_mla_sm120_splits_forces_the_split_path(monkeypatch):
    """The setting runs the split kernel and the combine whatever the plan picks; the math is the same
    (the oracle's), and a value that is not a positive integer is refused naming the variable."""
    from mla_sm120_plugin import envs
    from mla_sm120_plugin.kernels.dsv4 import triton as dsv4_triton

    kwargs, want = _small_call(40, 30, sinks=torch.randn(8, generator=torch.Generator().manual_seed(2)))
    want, _ = dsv4_sparse_attention(
        kwargs["query"], [(_engine_view(2, 64, 0, 1)[1], kwargs["sparse_indices"][:, 0], None, 64),
                          (_engine_view(8, 2, 0, 2)[1], kwargs["extra_sparse_indices"][:, 0], None, 2)], kwargs["sinks"])
    grids = []
    real = dsv4_triton.launch_plan
    monkeypatch.setattr(dsv4_triton, "launch_plan", lambda *a, **k: grids.append(k["cfg"].num_splits) or real(*a, **k))
    monkeypatch.setenv(envs.SPLITS, "3")
    forced = dsv4.triton_dsv4(**kwargs)
    assert grids == [3]
    assert EXACT_CLASS_BOUND.violations(measure(forced, want)) == []
    assert torch.equal(forced, dsv4.triton_dsv4(**kwargs, num_splits=3))
    monkeypatch.setenv(envs.SPLITS, "three")
    with pytest.raises(KernelInputError) as err:
        dsv4.triton_dsv4(**kwargs)
    assert str(err.value).startswith(f"given: {envs.SPLITS}: 'three'")
