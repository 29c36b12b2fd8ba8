"""The Triton kernel against the torch reference (on CPU through TRITON_INTERPRET=1, see conftest).

Tolerances. Under the interpreter every dot runs in fp32, so with fp32 q the two sides differ only
in summation order: out and lse within 1e-4 absolute on unit-scale inputs. A bfloat16 output may
additionally round to the neighbouring bfloat16 (one ulp, relative 2**-7). On a GPU the dots take
bfloat16 operands (probabilities rounded to 8 bits), so the GPU run allows 2e-2 / 1e-2.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mla_sm120_plugin.kernels import layout
from mla_sm120_plugin.kernels import triton as tk
from mla_sm120_plugin.kernels.reference import torch_sparse_mla

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU) or a CUDA GPU",
                allow_module_level=True)

OUT_ATOL_FP32 = 1e-4 if INTERPRETED else 2e-2
LSE_ATOL = 1e-4 if INTERPRETED else 1e-2
BF16_RTOL = 2.0**-7 if INTERPRETED else 2e-2

DECODE = "decode"  # forced split-K + combine
PREFILL = "prefill"  # forced single split


def _config(path: str, num_heads: int, topk: int) -> tk.LaunchConfig:
    """A launch config that takes ``path``: decode splits top-k into one 64-block per split."""
    block_h = min(max(1 << (num_heads - 1).bit_length(), 16), 32)
    blocks = -(-topk // 64)
    if path == DECODE:
        return tk.LaunchConfig(block_h, 64, num_splits=blocks, blocks_per_split=1)
    return tk.LaunchConfig(block_h, 64, num_splits=1, blocks_per_split=blocks)


def _run_both(case, path, **kwargs):
    on = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    args = dict(sm_scale=case.sm_scale, kv_layout=case.kv_layout, topk_length=None, sink=None,
                out=None, return_lse=True, lse_base="e")
    args.update(kwargs)
    cfg = _config(path, case.q.shape[1], case.indices.shape[1]) if path else None
    if path == DECODE:
        assert cfg.num_splits > 1, "the case must be wide enough to split"
    got = tk._run(on(case.q), on(case.kv_cache), on(case.indices), config=cfg,
                  **{k: on(v) for k, v in args.items()})
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, **args)
    return [g.cpu() for g in got], ref


def _assert_matches(got, ref):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=OUT_ATOL_FP32, rtol=0)
    else:
        torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL_FP32, rtol=BF16_RTOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows must agree"
    torch.testing.assert_close(lse, ref_lse, atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_random_inputs_both_layouts_both_paths(make_case, kv_layout, path):
    case = make_case(kv_layout=kv_layout, num_tokens=3, num_heads=16, topk=150, q_dtype=torch.float32)
    _assert_matches(*_run_both(case, path))


@pytest.mark.parametrize("num_heads", [1, 5, 16, 40])
def test_head_counts_pad_and_mask(make_case, num_heads):
    # 40 heads: two head blocks of 32, the second mostly padding.
    case = make_case(num_tokens=2, num_heads=num_heads, topk=64, q_dtype=torch.float32, seed=num_heads)
    _assert_matches(*_run_both(case, PREFILL))


@pytest.mark.parametrize("topk", [1, 37, 100])
def test_topk_not_a_multiple_of_the_block(make_case, topk):
    case = make_case(num_tokens=2, num_heads=5, topk=topk, invalid_fraction=0.1, seed=topk)
    _assert_matches(*_run_both(case, DECODE if topk > 64 else PREFILL))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_adversarial_slots(make_case, path):
    case = make_case(num_tokens=5, num_heads=5, topk=100, q_dtype=torch.float32)
    case.indices[0] = -1  # nothing valid
    case.indices[1] = case.num_slots + torch.arange(100, dtype=torch.int32)  # all out of range
    case.indices[2, :] = 7  # one slot a hundred times
    case.indices[3, ::3] = torch.iinfo(torch.int32).max  # far out of range, interleaved
    case.indices[4, 64:] = -1  # the second split is empty
    got, ref = _run_both(case, path)
    _assert_matches(got, ref)
    assert torch.all(got[0][:2] == 0) and torch.all(got[1][:2] == -math.inf)


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_invalid_slots_are_never_read(make_case, kv_layout):
    """Every slot not validly referenced holds NaN, slot 0 included (what invalid ids are
    redirected to), so a load that ignored its mask would show as NaN."""
    case = make_case(kv_layout=kv_layout, num_tokens=3, num_heads=5, topk=70, invalid_fraction=0.4)
    idx = case.indices.long()
    case.indices[idx == 0] = -1
    idx = case.indices.long()
    referenced = torch.zeros(case.num_slots, dtype=torch.bool)
    ok = (idx >= 0) & (idx < case.num_slots)
    referenced[idx[ok]] = True
    clean = case.kv_cache.clone()
    rows = case.kv_cache.view(-1, case.kv_cache.shape[-1])
    poison = rows[~referenced]
    if kv_layout == layout.FP8_DS_MLA:
        poison[:, : layout.KV_LORA_RANK] = 0x7F  # fp8 e4m3 NaN
        poison[:, layout.FP8_SCALE_OFFSET:] = 0xFF  # NaN scales and rope
    else:
        poison[:] = float("nan")
    rows[~referenced] = poison
    (out, lse), _ = _run_both(case, DECODE)
    case.kv_cache = clean
    _assert_matches((out, lse), torch_sparse_mla(case.q, clean, case.indices, sm_scale=case.sm_scale,
                                                 kv_layout=kv_layout, return_lse=True))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_topk_length(make_case, path):
    case = make_case(num_tokens=4, num_heads=5, topk=100, q_dtype=torch.float32)
    lengths = torch.tensor([100, 10, 0, 65], dtype=torch.int32)
    _assert_matches(*_run_both(case, path, topk_length=lengths))


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_page_strided_view(make_case, kv_layout):
    pad = 48 if kv_layout == layout.FP8_DS_MLA else 24  # 48 bytes either way: 16-byte aligned
    case = make_case(kv_layout=kv_layout, page_pad=pad, num_tokens=2, num_heads=5, topk=100,
                     q_dtype=torch.float32)
    assert case.kv_cache.stride(0) > case.kv_cache.shape[1] * case.kv_cache.shape[2]
    _assert_matches(*_run_both(case, DECODE))


def test_flat_cache(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=64, q_dtype=torch.float32)
    case.kv_cache = case.kv_cache.reshape(-1, layout.FP8_DS_MLA_TOKEN_BYTES)
    _assert_matches(*_run_both(case, PREFILL))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_sink_and_lse_base(make_case, path, lse_base):
    case = make_case(num_tokens=3, num_heads=5, topk=100, q_dtype=torch.float32)
    case.indices[2] = -1
    sink = torch.tensor([-2.0, 0.0, 1.0, 3.0, 50.0])
    _assert_matches(*_run_both(case, path, sink=sink, lse_base=lse_base))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_bf16_q_and_out_buffer(make_case, path):
    case = make_case(num_tokens=3, num_heads=5, topk=100, q_dtype=torch.bfloat16)
    out = torch.full((3, 5, layout.KV_LORA_RANK), 9.0, dtype=torch.bfloat16, device=DEVICE)
    got, ref = _run_both(case, path, out=out)
    _assert_matches(got, ref)
    assert torch.equal(out.cpu(), got[0])


def test_public_entry_default_config_and_empty_batch(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=100)
    out = tk.triton_sparse_mla(case.q.to(DEVICE), case.kv_cache.to(DEVICE), case.indices.to(DEVICE),
                               sm_scale=case.sm_scale, kv_layout=case.kv_layout)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                           kv_layout=case.kv_layout)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=OUT_ATOL_FP32, rtol=BF16_RTOL)
    empty = tk.triton_sparse_mla(case.q[:0].to(DEVICE), case.kv_cache.to(DEVICE), case.indices[:0].to(DEVICE),
                                 sm_scale=case.sm_scale, kv_layout=case.kv_layout)
    assert empty.shape == (0, 5, layout.KV_LORA_RANK)


def test_launch_config_splits_few_tokens_and_not_many():
    decode = tk._launch_config(num_tokens=1, num_heads=16, topk=2048, num_sms=170)
    prefill = tk._launch_config(num_tokens=4096, num_heads=128, topk=2048, num_sms=170)
    assert decode.num_splits > 1 and prefill.num_splits == 1
    for tokens, heads, topk in [(1, 1, 1), (1, 16, 2048), (3, 5, 100), (64, 64, 2048), (1, 128, 37)]:
        cfg = tk._launch_config(tokens, heads, topk, 170)
        blocks = -(-topk // cfg.block_k)
        # Every split has work, and together they cover every block exactly once.
        assert (cfg.num_splits - 1) * cfg.blocks_per_split < blocks <= cfg.num_splits * cfg.blocks_per_split
        assert cfg.block_h >= 16 and cfg.block_h & (cfg.block_h - 1) == 0
