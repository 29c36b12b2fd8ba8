"""The fast fp8 Triton kernel against the torch reference (within its declared tolerance) and
against a torch emulation of its own fp8 numerics (bit for bit up to fp32 summation order).

On the CPU it runs under Triton's interpreter, which executes the same ``tl.dot_scaled`` MMAs on
the exactly-representable e4m3 values the kernel rounds itself, so these tests check the real
numerics; on a GPU it runs compiled. The compile gate (test_compile_gate.py) proves the same
source compiles to fp8 MMAs with two CTAs per SM on sm_120a/121a. The rope-less fp8 layouts
(GLM-5.3-Flash) are in test_nope.py; the emulation here covers them too.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from support.cli import clean_env
from support.kernel_checks import DEVICE, ON_GPU, assert_kernel_close
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.kernels.dsa import triton_fast as tf
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)",
                allow_module_level=True)

DECODE = "decode"  # every block-step its own split: the most bf16 partials the combine can see
PREFILL = "prefill"  # one split: the final path
F32 = torch.float32


def _config(path: str | None, topk: int) -> plan.LaunchConfig | None:
    if path is None:
        return None
    blocks = -(-topk // plan.FAST.block_k)
    return plan.FAST.config(blocks, 1) if path == DECODE else plan.FAST.config(1, blocks)


def _run_both(case, path, **kwargs):
    args = dict(sm_scale=case.sm_scale, kv_layout=case.kv_layout, topk_length=None, sink=None, out=None,
                return_lse=True, lse_base="e")
    args.update(kwargs)
    cfg = _config(path, case.indices.shape[1])
    if path == DECODE:
        assert cfg.num_splits > 1, "the case must be wide enough to split"
    got = tf._run(case.q, case.kv_cache, case.indices, config=cfg, **args)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, **{**args, "out": None})
    return got, ref


def _assert_matches(got, ref, rel=tf.TOLERANCE):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert_kernel_close(out, ref_out, rel)
    assert_kernel_close(lse, ref_lse, rel)


# --- The rounding the kernel does itself ---------------------------------------------------------


@triton.jit
def _round_probe(x_ptr, out_ptr, exp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    tl.store(out_ptr + offs, tf._round_e4m3(x).to(tl.float8e4nv).to(tl.float32), mask=offs < n)
    tl.store(exp_ptr + offs, tf._pow2_ceil_exponent(tl.abs(x) + 1e-30), mask=offs < n)


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), and values 1 ulp (fp32)
    either side of each midpoint."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()  # sorted, -448 .. 448
    mids = (values[1:] + values[:-1]) / 2
    return torch.cat([values, mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                      torch.nextafter(mids, torch.full_like(mids, -math.inf))])


def test_round_e4m3_is_round_to_nearest_even_bit_for_bit():
    """The kernel's own rounding equals torch's fp32 -> e4m3 cast (round to nearest even, saturating
    at 448) on every tie, its neighbours, subnormals and out-of-range values; and its power-of-two
    ceiling is the exponent ``2 ** ceil(log2 x)`` has."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.randint(-14, 10, (4000,), generator=gen).float())
    x = torch.cat([_e4m3_grid(), torch.randn(4000, generator=gen) * spread,
                   torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 1e6, -1e6, 2.0**-10, 2.0**-9, 3 * 2.0**-11])])
    n = x.numel()
    block = triton.next_power_of_2(n)
    got = torch.empty(n, device=DEVICE)
    exps = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _round_probe[(1,)](x.to(DEVICE), got, exps, n, BLOCK=block)
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert torch.equal(got.cpu(), want), (x[got.cpu() != want][:8], got.cpu()[got.cpu() != want][:8])
    mag = x.abs() + 1e-30
    want_exp = torch.ceil(torch.log2(mag.double())).to(torch.int32) + 127
    exact_pow2 = torch.frexp(mag)[0] == 0.5
    want_exp = torch.where(exact_pow2, torch.frexp(mag)[1] - 1 + 127, want_exp)
    assert torch.equal(exps.cpu(), want_exp)


# --- A torch emulation of the kernel's numerics ---------------------------------------------------


def _pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    return (biased.to(torch.int32) << 23).view(F32)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(F32)


def emulate_fast(q, kv_cache, indices, sm_scale, block_k=plan.FAST.block_k, kv_layout=layout.FP8_DS_MLA):
    """The fast kernel's single-split numerics in torch (module docstring of triton_fast): q per
    (head, tile) and p per (head, step) split into e4m3 hi + lo pairs under power-of-two scales
    (p's residual scaled by 2**4 before its rounding), the key scale on the fp32 tile scores, the
    value scale folded into p, an online softmax in steps of block_k; the rope dot (bf16 operands) where
    the layout has a rope."""
    lay = layout.get(kv_layout)
    q, kv_cache, indices = q.cpu(), kv_cache.cpu(), indices.cpu()
    num_tokens, num_heads, _ = q.shape
    rows_all = pack.flat_view(kv_cache)
    inv448 = torch.tensor(1.0 / layout.FP8_E4M3_MAX, dtype=F32)
    tile = lambda i: slice(i * layout.FP8_TILE, (i + 1) * layout.FP8_TILE)  # noqa: E731
    out = torch.zeros(num_tokens, num_heads, layout.KV_LORA_RANK)
    lse = torch.zeros(num_tokens, num_heads)
    for t in range(num_tokens):
        qf = q[t].float()  # [H, 576]
        q_deq = []
        for i in range(layout.FP8_NUM_TILES):
            qt = qf[:, tile(i)]
            e = _pow2_ceil_exponent(torch.clamp(qt.abs().amax(1) * inv448, min=2.0**-126)).clamp(min=1)
            hi = _e4m3(qt * _pow2(254 - e)[:, None]) * _pow2(e)[:, None]  # [H, 128]
            rest = qt - hi
            e_lo = _pow2_ceil_exponent(torch.clamp(rest.abs().amax(1) * inv448, min=2.0**-126)).clamp(min=1)
            q_deq.append(hi + _e4m3(rest * _pow2(254 - e_lo)[:, None]) * _pow2(e_lo)[:, None])
        m = torch.full((num_heads,), -math.inf)
        l_sum = torch.zeros(num_heads)
        acc = torch.zeros(num_heads, layout.KV_LORA_RANK)
        for start in range(0, indices.shape[1], block_k):
            slot = indices[t, start:start + block_k].long()  # [K]
            valid = (slot >= 0) & (slot < rows_all.shape[0])
            rows = rows_all[torch.where(valid, slot, 0)]
            k8 = rows[:, :layout.KV_LORA_RANK].view(torch.float8_e4m3fn).to(F32).masked_fill(~valid[:, None], 0)
            sc = rows[:, layout.FP8_SCALE_OFFSET:layout.FP8_ROPE_OFFSET].contiguous().view(F32)
            sc = sc.masked_fill(~valid[:, None], 0)  # [K, 4]
            s = torch.zeros(num_heads, slot.shape[0])  # [H, K]
            if lay.rope:
                rope = rows[:, lay.rope_offset:lay.used].contiguous().view(torch.bfloat16).to(F32)
                # bf16 operands, as the kernel's rope dot has (a GPU's cast; the interpreter rounds)
                s = qf[:, lay.latent:].bfloat16().float() @ rope.masked_fill(~valid[:, None], 0).T
            for i in range(layout.FP8_NUM_TILES):
                s = s + (q_deq[i] @ k8[:, tile(i)].T) * sc[:, i][None, :]
            s = torch.where(valid[None, :], s * torch.tensor(sm_scale * math.log2(math.e), dtype=F32), -math.inf)
            m_step = s.amax(1)
            m_new = torch.maximum(m, m_step)
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp2(m - m_safe)
            p = torch.exp2(s - m_safe[:, None])
            p_exp = _pow2_ceil_exponent(torch.clamp(torch.exp2(m_step - m_safe) * (sc.amax() * inv448), min=2.0**-126))
            p_exp = p_exp.clamp(min=1 + 4)
            l_sum = l_sum * alpha + p.sum(1)
            m = m_new
            for i in range(layout.FP8_NUM_TILES):
                x = (p * sc[:, i][None, :]) * _pow2(254 - p_exp)[:, None]
                hi = _e4m3(x)
                lo = _e4m3((x - hi) * 16.0)
                p8 = hi * _pow2(p_exp)[:, None] + lo * _pow2(p_exp - 4)[:, None]
                acc[:, tile(i)] = acc[:, tile(i)] * alpha[:, None] + p8 @ k8[:, tile(i)]
        has = l_sum > 0
        out[t] = torch.where(has[:, None], acc / torch.where(has, l_sum, 1.0)[:, None], 0.0)
        lse[t] = torch.where(has, m + torch.log2(torch.where(has, l_sum, 1.0)), -math.inf) * math.log(2.0)
    return out, lse


@pytest.mark.skipif(ON_GPU, reason="a GPU's exp2 and MMA summation order differ from torch's; the interpreter "
                    "runs the kernel's numerics exactly (the reference tests below bound the GPU)")
@pytest.mark.parametrize("kv_layout, scale_format", [(layout.FP8_DS_MLA, layout.SCALE_ARBITRARY),
                                                      (layout.FP8_DS_MLA, layout.SCALE_POW2),
                                                      ("fp8_nope", layout.SCALE_POW2)])
def test_interpreter_runs_exactly_the_documented_fp8_numerics(make_case, kv_layout, scale_format):
    case = make_case(kv_layout=kv_layout, num_tokens=3, num_heads=16, topk=150, q_dtype=torch.float32,
                     scale_format=scale_format)
    case.indices[2, 40:] = -1  # a token whose later steps are empty
    got = _run_both(case, PREFILL)[0]
    want = emulate_fast(case.q, case.kv_cache, case.indices, case.sm_scale, kv_layout=kv_layout)
    assert_kernel_close(got[0], want[0], 1e-5)
    assert_kernel_close(got[1], want[1], 1e-5)


# --- Against the reference, within the declared tolerance ----------------------------------------


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_random_inputs_both_scale_formats_both_paths(make_case, path, scale_format):
    case = make_case(num_tokens=3, num_heads=16, topk=150, scale_format=scale_format, seed=3)
    _assert_matches(*_run_both(case, path))


@pytest.mark.parametrize("num_heads", [1, 5, 40])
def test_head_counts_pad_and_mask(make_case, num_heads):
    case = make_case(num_tokens=2, num_heads=num_heads, topk=64, q_dtype=torch.float32, seed=num_heads)
    _assert_matches(*_run_both(case, PREFILL))


@pytest.mark.parametrize("topk", [1, 37, 100])
def test_topk_not_a_multiple_of_the_block(make_case, topk):
    case = make_case(num_tokens=2, num_heads=5, topk=topk, invalid_fraction=0.1, seed=topk)
    _assert_matches(*_run_both(case, DECODE if topk > plan.FAST.block_k else PREFILL))


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_topk_2048_with_the_table_config(make_case, scale_format):
    """The serving shape (one token, 16 heads, top-k 2048) through the configuration table, fp32
    partials and all."""
    case = make_case(num_pages=40, num_tokens=1, num_heads=16, topk=2048, scale_format=scale_format,
                     invalid_fraction=0.05, seed=7)
    cfg = plan.launch_config(plan.FAST.name, 1, 16, 2048)
    assert cfg.num_splits > 1 and cfg.partial_dtype == "fp32"
    _assert_matches(*_run_both(case, None))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_adversarial_slots(make_case, path):
    case = make_case(num_tokens=5, num_heads=5, topk=100)
    case.indices[0] = -1  # nothing valid
    case.indices[1] = case.num_slots + torch.arange(100, dtype=torch.int32, device=DEVICE)  # all out of range
    case.indices[2, :] = 7  # one slot a hundred times
    case.indices[3, ::3] = torch.iinfo(torch.int32).max  # far out of range, interleaved
    case.indices[4, 64:] = -1  # the later splits are empty
    got, ref = _run_both(case, path)
    _assert_matches(got, ref)
    assert torch.all(got[0][:2] == 0) and torch.all(got[1][:2] == -math.inf)


def test_invalid_slots_are_never_read(make_case):
    """Every slot not validly referenced holds NaN bytes (slot 0 included, what invalid ids are
    redirected to): a load that ignored its mask would show as NaN."""
    case = make_case(num_tokens=3, num_heads=5, topk=70, invalid_fraction=0.4)
    case.indices[case.indices.long() == 0] = -1
    idx = case.indices.long()
    referenced = torch.zeros(case.num_slots, dtype=torch.bool, device=DEVICE)
    referenced[idx[(idx >= 0) & (idx < case.num_slots)]] = True
    clean = case.kv_cache.clone()
    rows = case.kv_cache.view(-1, case.kv_cache.shape[-1])
    poison = rows[~referenced]
    poison[:, : layout.KV_LORA_RANK] = 0x7F  # e4m3 NaN
    poison[:, layout.FP8_SCALE_OFFSET:] = 0xFF  # NaN scales and rope
    rows[~referenced] = poison
    got, _ = _run_both(case, DECODE)
    _assert_matches(got, torch_sparse_mla(case.q, clean, case.indices, sm_scale=case.sm_scale,
                                          kv_layout=case.kv_layout, return_lse=True))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_topk_length(make_case, path):
    case = make_case(num_tokens=4, num_heads=5, topk=100)
    lengths = torch.tensor([100, 10, 0, 65], dtype=torch.int32, device=DEVICE)
    _assert_matches(*_run_both(case, path, topk_length=lengths))


def test_page_strided_view(make_case):
    case = make_case(page_pad=48, num_tokens=2, num_heads=5, topk=100, scale_format=layout.SCALE_POW2)
    assert case.kv_cache.stride(0) > case.kv_cache.shape[1] * case.kv_cache.shape[2]
    _assert_matches(*_run_both(case, DECODE))


def test_page_strided_view_with_a_page_size_not_a_power_of_two(make_case):
    case = make_case(page_pad=48, page_size=48, num_pages=4, num_tokens=2, num_heads=5, topk=60)
    _assert_matches(*_run_both(case, DECODE))


def test_flat_cache(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=64)
    case.kv_cache = case.kv_cache.reshape(-1, layout.FP8_DS_MLA_TOKEN_BYTES)
    _assert_matches(*_run_both(case, DECODE))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_sink_and_lse_base(make_case, path, lse_base):
    case = make_case(num_tokens=3, num_heads=5, topk=100)
    case.indices[2] = -1
    sink = torch.tensor([-2.0, 0.0, 1.0, 3.0, 50.0], device=DEVICE)
    _assert_matches(*_run_both(case, path, sink=sink, lse_base=lse_base))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_out_buffer_with_strides(make_case, path):
    case = make_case(num_tokens=4, num_heads=5, topk=100)
    out = torch.full((5, 4, layout.KV_LORA_RANK), 9.0, dtype=case.q.dtype, device=DEVICE).transpose(0, 1)
    lengths = torch.tensor([40], dtype=torch.int32, device=DEVICE).expand(4)  # stride 0
    sink = torch.linspace(-2, 2, 10, device=DEVICE).reshape(5, 2)[:, 1]  # stride 2
    got, ref = _run_both(case, path, out=out, topk_length=lengths, sink=sink)
    _assert_matches(got, ref)
    assert got[0] is out


def test_bf16_cache_goes_to_the_exact_kernel(make_case):
    case = make_case(kv_layout=layout.BF16, num_tokens=2, num_heads=5, topk=64)
    got, ref = _run_both(case, PREFILL)
    _assert_matches(got, ref, rel=2e-2)


def test_public_entry_default_config_and_empty_batch(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=100)
    out = tf.triton_sparse_mla_fast(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                    kv_layout=case.kv_layout)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale, kv_layout=case.kv_layout)
    assert_kernel_close(out, ref, tf.TOLERANCE)
    empty = tf.triton_sparse_mla_fast(case.q[:0], case.kv_cache, case.indices[:0], sm_scale=case.sm_scale,
                                      kv_layout=case.kv_layout)
    assert empty.shape == (0, 5, layout.KV_LORA_RANK)


def test_the_tolerance_is_tighter_than_a_wrong_scale(make_case):
    """What the tolerance must still catch: reading every tile with tile 0's scale (the tiles' gains
    differ 2x-8x), or ignoring the scales."""
    case = make_case(num_tokens=2, num_heads=16, topk=100)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale, kv_layout=case.kv_layout)
    rows = pack.flat_view(case.kv_cache)
    for wrong in ("tile 0's scale everywhere", "unit scales"):
        bad = rows.clone()
        scales = bad[:, layout.FP8_SCALE_OFFSET:layout.FP8_ROPE_OFFSET].contiguous().view(F32)
        scales[:] = scales[:, :1] if wrong.startswith("tile") else 1.0
        bad[:, layout.FP8_SCALE_OFFSET:layout.FP8_ROPE_OFFSET] = scales.view(torch.uint8)
        got = torch_sparse_mla(case.q, bad.view_as(case.kv_cache), case.indices, sm_scale=case.sm_scale,
                               kv_layout=case.kv_layout)
        with pytest.raises(AssertionError):
            assert_kernel_close(got, ref, tf.TOLERANCE)


@pytest.mark.skipif(ON_GPU, reason="guard pages protect host memory: the CPU (interpreter) run checks them")
def test_no_read_past_any_storage():
    """Every tensor (q, cache, indices, stride-0 topk_length and sink) placed against an unreadable
    page, in a child process (tests/kernels/guarded_call.py), one split and four: a read past any
    storage kills it with SIGSEGV. The packed 528-byte rope-less rows: test_nope.py."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("guarded_call.py")), "fast", layout.FP8_DS_MLA,
                           "1,4"], capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, f"rc={done.returncode} (-11 is SIGSEGV): {done.stderr[-2000:]}"
