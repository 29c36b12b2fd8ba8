"""Accuracy in FlashMLA's metrics: every kernel against float64 attention over the dequantized rows.

The truth is float64 attention (tests/support/oracle.py) over the rows tests/support/layout_oracle.py
reads (an independent byte reader), so only a kernel's own arithmetic counts. Each kernel is held to
the bound its spec declares (``KernelSpec.accuracy``: cos_diff, relRMS, max error; exact class is cos_diff
<= 5e-6 and relRMS <= 0.3 %), in the anchors' regimes (docs/facts.md#accuracy-metrics-and-regimes; mla_sm120_plugin.tools.accuracy_cases:
flat, peaked, outlier channels, few candidates), and on the inputs a kernel could get wrong without a wrong number showing elsewhere: slots no
index selects poisoned with NaN bytes, rows with zero candidates, and a ``topk_length`` above
top-k (SGLang hands per-row lengths; 2**31 - 1 included), which each kernel must clamp itself.

Under the interpreter the Triton kernels run their GPU numerics (fp8 rounding to nearest even, bf16
dot operands), so these numbers are the GPU's up to summation order and exp2's approximation.
"""

from __future__ import annotations

import pytest
import torch

from support import layout_oracle
from support.kernel_checks import DEVICE
from support.oracle import sparse_attention
from mla_sm120_plugin.dispatch import catalog
from mla_sm120_plugin.kernels.accuracy import EXACT_COS_DIFF, EXACT_REL_RMS, measure
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa import triton_fast as tf
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla
from mla_sm120_plugin.tools.accuracy_cases import REGIMES, regime_case

TOKENS, HEADS, TOPK, PAGES = 2, 16, 96, 4
KERNELS = {
    "exact": (tk.triton_sparse_mla, catalog.TRITON_SPEC),
    "fast": (tf.triton_sparse_mla_fast, catalog.TRITON_FAST_SPEC),
}


def _case(regime: str, kv_layout: str, *, heads: int = HEADS, topk: int = TOPK, seed: int = 0):
    """q (bf16, [T, H, D]), a paged cache written by the packer, indices ([T, topk] int32) and the
    softmax scale for one regime (mla_sm120_plugin.tools.accuracy_cases)."""
    case = regime_case(regime, kv_layout, tokens=TOKENS, heads=heads, topk=topk, pages=PAGES, seed=seed)
    return case.q, case.kv_cache, case.indices, case.sm_scale


def _truth(q, cache, indices, sm_scale, kv_layout, topk_length=None):
    keys = layout_oracle.decode_cache(cache, kv_layout)
    return sparse_attention(q, keys, indices, sm_scale, topk_length=topk_length)[0]


def _within(got, want, bound, what):
    acc = measure(got, want)
    over = bound.violations(acc)
    assert not over, f"{what}: {acc.summary()}; over the bound: {over}"
    return acc


def _on_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("kv_layout", layout.FP8_LAYOUTS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_triton_kernels_are_exact_class_on_every_fp8_layout(kernel, kv_layout, regime):
    fn, spec = KERNELS[kernel]
    assert spec.precision == "exact" and spec.accuracy.exact_class
    q, cache, indices, sm_scale = _case(regime, kv_layout)
    want = _truth(q, cache, indices, sm_scale, kv_layout)
    got = fn(*_on_device(q, cache, indices), sm_scale=sm_scale, kv_layout=kv_layout)
    acc = _within(got, want, spec.accuracy, f"{kernel} {kv_layout} {regime}")
    assert acc.cos_diff <= EXACT_COS_DIFF and acc.rel_rms <= EXACT_REL_RMS


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_split_partials_keep_exact_class(kernel):
    """The split path (partials, their LSEs and the combine; bf16 partials in the fast kernel)."""
    fn, spec = KERNELS[kernel]
    run, shape = (tk._run, tk.plan.EXACT) if kernel == "exact" else (tf._run, tk.plan.FAST)
    q, cache, indices, sm_scale = _case("peaked", layout.FP8_DS_MLA, topk=256, seed=1)
    want = _truth(q, cache, indices, sm_scale, layout.FP8_DS_MLA)
    blocks = -(-indices.shape[1] // shape.block_k)
    cfg = shape.config(4, -(-blocks // 4))
    got = run(*_on_device(q, cache, indices), sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA, topk_length=None,
              sink=None, out=None, return_lse=False, lse_base="e", config=cfg)
    _within(got, want, spec.accuracy, f"{kernel} split 4")


@pytest.mark.parametrize("kv_layout", [layout.NVFP4_DS_MLA, layout.BF16, layout.BF16_NOPE])
def test_the_exact_kernel_on_the_other_layouts(kv_layout):
    """nvfp4_ds_mla and the bf16 layouts, which only the exact kernel reads, in the same metrics."""
    q, cache, indices, sm_scale = _case("peaked", kv_layout, heads=5)
    want = _truth(q, cache, indices, sm_scale, kv_layout)
    got = tk.triton_sparse_mla(*_on_device(q, cache, indices), sm_scale=sm_scale, kv_layout=kv_layout)
    _within(got, want, catalog.TRITON_SPEC.accuracy, f"exact {kv_layout}")


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_the_reference_is_within_its_own_bound(kv_layout):
    q, cache, indices, sm_scale = _case("flat", kv_layout, heads=3)
    want = _truth(q, cache, indices, sm_scale, kv_layout)
    got = torch_sparse_mla(q, cache, indices, sm_scale=sm_scale, kv_layout=kv_layout)
    _within(got, want, catalog.TORCH_SPEC.accuracy, f"reference {kv_layout}")


def _poison_unused(cache: torch.Tensor, indices: torch.Tensor) -> None:
    """Every slot no index names gets NaN bytes: 0x7f (e4m3 NaN) in its latent and 0xff in its
    scales and rope (NaN as fp32 and bf16). A kernel that multiplies a masked row by 0 returns NaN."""
    flat = cache.view(-1, cache.shape[-1])
    used = torch.zeros(flat.shape[0], dtype=torch.bool)
    ids = indices[(indices >= 0) & (indices < flat.shape[0])].long()
    used[ids] = True
    flat[~used, :layout.KV_LORA_RANK] = 0x7F
    flat[~used, layout.KV_LORA_RANK:] = 0xFF


@pytest.mark.parametrize("kv_layout", [layout.FP8_DS_MLA, layout.FP8_NOPE])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_nan_poisoned_unused_slots_zero_rows_and_lengths_past_topk(kernel, kv_layout):
    """One call: token 0's ``topk_length`` is 2**31 - 1 (clamped to top-k), token 1's is 0 (its
    output is zeros, its LSE -inf); every slot no candidate names is NaN bytes."""
    fn, spec = KERNELS[kernel]
    q, cache, indices, sm_scale = _case("outlier", kv_layout, heads=5, seed=2)
    _poison_unused(cache, indices)
    lengths = torch.tensor([2**31 - 1, 0], dtype=torch.int32)
    want = _truth(q, cache, indices, sm_scale, kv_layout, lengths)
    got, lse = fn(*_on_device(q, cache, indices), sm_scale=sm_scale, kv_layout=kv_layout,
                  topk_length=lengths.to(DEVICE), return_lse=True)
    assert torch.isfinite(got).all() and torch.equal(got[1].cpu(), torch.zeros_like(got[1].cpu()))
    assert torch.isinf(lse[1]).all() and torch.isfinite(lse[0]).all()
    _within(got, want, spec.accuracy, f"{kernel} {kv_layout} poisoned")


@pytest.mark.parametrize("length", [TOPK + 1, 3 * TOPK, 2**31 - 1])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_length_above_topk_reads_topk_candidates_and_no_more(kernel, length):
    """The in-kernel clamp: the indices tensor is a view of the first ``TOPK`` columns of a wider
    buffer whose extra columns name valid slots; a kernel that trusts ``topk_length`` past top-k
    reads them and disagrees with the truth, which stops at top-k."""
    fn, spec = KERNELS[kernel]
    q, cache, indices, sm_scale = _case("peaked", layout.FP8_DS_MLA, heads=5, seed=3)
    wide = torch.cat([indices, torch.randint(0, PAGES * layout.PAGE_SIZE, (TOKENS, TOPK), dtype=torch.int32,
                                             generator=torch.Generator().manual_seed(9))], dim=1).to(DEVICE)
    view = wide[:, :TOPK]
    lengths = torch.full((TOKENS,), length, dtype=torch.int32)
    want = _truth(q, cache, indices, sm_scale, layout.FP8_DS_MLA)  # top-k candidates, all of them
    got = fn(*_on_device(q, cache), view, sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA,
             topk_length=lengths.to(DEVICE))
    _within(got, want, spec.accuracy, f"{kernel} topk_length {length}")


# --- What a GPU does that the interpreter hides (docs/facts.md#accuracy-metrics-and-regimes) ------------------------------


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_an_int64_length_and_a_float64_sink_are_converted_before_launch(kernel, monkeypatch):
    """A GPU compiles whatever dtype it is handed (an int64 length read as int32 halves; the
    interpreter reads it right, so the launches themselves are looked at); the launch path converts
    them, a length past int32 included (it is past any top-k)."""
    fn, _ = KERNELS[kernel]
    module = tk if kernel == "exact" else tf
    launched = []
    plan_launches = module.launch_plan

    def recording(*args, **kwargs):
        launches = plan_launches(*args, **kwargs)
        launched.extend(launches)
        return launches

    monkeypatch.setattr(module, "launch_plan", recording)
    q, cache, indices, sm_scale = _case("peaked", layout.FP8_DS_MLA, heads=5, seed=4)
    q, cache, indices = _on_device(q, cache, indices)
    sink = torch.linspace(-1.0, 2.0, 5, device=DEVICE)
    lengths = torch.tensor([40, TOPK], dtype=torch.int32, device=DEVICE)
    want = fn(q, cache, indices, sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA, topk_length=lengths, sink=sink)
    wide = torch.tensor([40, 2**40], dtype=torch.int64, device=DEVICE)
    launched.clear()
    got = fn(q, cache, indices, sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA, topk_length=wide,
             sink=sink.double())
    assert torch.equal(got, want)
    dtypes = {a.dtype for launch in launched for a in launch.args if isinstance(a, torch.Tensor)}
    assert launched and not dtypes & {torch.int64, torch.float64}, dtypes


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_cache_not_on_a_4_byte_boundary_is_refused(kernel):
    from mla_sm120_plugin.errors import KernelInputError

    fn, _ = KERNELS[kernel]
    q, cache, indices, sm_scale = _case("flat", layout.FP8_DS_MLA, heads=5)
    buffer = torch.zeros(cache.numel() + 8, dtype=torch.uint8)
    for shift, refused in ((1, True), (2, True), (4, False)):
        view = buffer[shift:shift + cache.numel()].view(cache.shape)
        view.copy_(cache)
        args = [*_on_device(q), view.to(DEVICE) if DEVICE == "cpu" else view, *_on_device(indices)]
        if DEVICE != "cpu":
            pytest.skip("a CUDA copy of the view starts aligned; the CPU run checks the refusal")
        if refused:
            with pytest.raises(KernelInputError) as err:
                fn(*args, sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA)
            message = str(err.value)
            assert f"data_ptr) = {view.data_ptr()}, not a multiple of 4" in message
            assert "supported: rows that start on 4-byte boundaries" in message and "fix: " in message
        else:
            fn(*args, sm_scale=sm_scale, kv_layout=layout.FP8_DS_MLA)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scale_codes_probe(q_ptr, p_bound_ptr, q_codes_ptr, p_codes_ptr):
    heads = tl.arange(0, 16)
    cols = tl.arange(0, 128)
    _, q_e8, _, lo_e8 = tf._split_q(q_ptr, 0, heads, heads < 16, 128, cols, 16)
    tl.store(q_codes_ptr + heads[:, None] * 8 + tl.arange(0, 4)[None, :], q_e8)
    tl.store(q_codes_ptr + heads[:, None] * 8 + 4 + tl.arange(0, 4)[None, :], lo_e8)
    sc = tl.full([32], 1.0, tl.float32)
    p_exp = tf._p_exponent(tl.load(p_bound_ptr + heads), sc, sc, sc, sc)
    tl.store(p_codes_ptr + heads * 2, p_exp.to(tl.uint8))
    tl.store(p_codes_ptr + heads * 2 + 1, (p_exp - tf._P_LO_SHIFT).to(tl.uint8))


def test_no_e8m0_scale_code_is_zero():
    """The interpreter decodes an e8m0 byte 0 as 0, a GPU as 2**-127: the kernel never makes one,
    for q rows of zeros, of subnormal-small values or exact in hi (lo all zero), nor for p."""
    q = torch.zeros(16, 128)
    q[1] = 1e-38
    q[2] = 2.0**-130
    q[3] = torch.linspace(-3, 3, 128).bfloat16().float()
    q[4, 0] = 1.0  # hi holds it exactly: lo is zero
    q_codes = torch.empty(16, 8, dtype=torch.uint8, device=DEVICE)
    p_codes = torch.empty(16, 2, dtype=torch.uint8, device=DEVICE)
    p_bound = torch.tensor([0.0, 1e-38, 1e-30, 1.0] * 4, device=DEVICE)
    _scale_codes_probe[(1,)](q.to(torch.bfloat16).to(DEVICE), p_bound, q_codes, p_codes)
    assert int(q_codes.min()) >= 1 and int(p_codes.min()) >= 1, (q_codes, p_codes)
    assert torch.equal(p_codes[:, 1].int(), p_codes[:, 0].int() - tf._P_LO_SHIFT.value), p_codes  # no wrap-around
