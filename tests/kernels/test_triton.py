"""The Triton kernel against the torch reference, on the test device (support.kernel_checks.DEVICE).

On the CPU it runs under Triton's interpreter; on a GPU compiled. Tolerances are a fraction of
the reference's magnitude (support.kernel_checks.KERNEL_REL_TOL says why each side needs what it needs). The
compile gate (test_compile_gate.py) proves the same source compiles for the GPUs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.cli import clean_env
from support.kernel_checks import DEVICE, ON_GPU, assert_kernel_close
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin import sparse_mla_forward
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla
from mla_sm120_plugin.kernels.shared.host import page_divisor

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)",
                allow_module_level=True)

DECODE = "decode"  # forced split-K + combine
PREFILL = "prefill"  # forced single split
Q_DTYPES = [torch.bfloat16, torch.float32]


def _config(path: str, topk: int) -> tk.LaunchConfig:
    """The launch heuristic's block shape, forced onto ``path``: decode gives every block-step its
    own split (the most partials the combine can see), prefill one split."""
    blocks = -(-topk // tk.BLOCK_K)
    if path == DECODE:
        return tk.LaunchConfig(tk.BLOCK_H, tk.BLOCK_K, blocks, 1, tk.NUM_WARPS, tk.NUM_STAGES)
    return tk.LaunchConfig(tk.BLOCK_H, tk.BLOCK_K, 1, blocks, tk.NUM_WARPS, tk.NUM_STAGES)


def _run_both(case, path, **kwargs):
    args = dict(sm_scale=case.sm_scale, kv_layout=case.kv_layout, topk_length=None, sink=None,
                out=None, return_lse=True, lse_base="e")
    args.update(kwargs)
    cfg = _config(path, case.indices.shape[1]) if path else None
    if path == DECODE:
        assert cfg.num_splits > 1, "the case must be wide enough to split"
    got = tk._run(case.q, case.kv_cache, case.indices, config=cfg, **args)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, **{**args, "out": None})
    return got, ref


def _assert_matches(got, ref):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert_kernel_close(out, ref_out)
    assert_kernel_close(lse, ref_lse)


# Every layout with bf16 q (what the engines pass); fp32 q for the DSA layouts only: the q path is
# the same code for every layout (the rope-less ones differ in q's width, which bf16 q covers).
LAYOUTS_AND_Q = [(kv, q) for kv in layout.KV_LAYOUTS for q in Q_DTYPES
                 if q == torch.bfloat16 or layout.get(kv).rope]


@pytest.mark.parametrize("kv_layout, q_dtype", LAYOUTS_AND_Q, ids=[f"{kv}-{str(q)[6:]}" for kv, q in LAYOUTS_AND_Q])
@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_random_inputs_every_layout_both_paths(make_case, kv_layout, path, q_dtype):
    case = make_case(kv_layout=kv_layout, num_tokens=3, num_heads=16, topk=150, q_dtype=q_dtype)
    _assert_matches(*_run_both(case, path))


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("num_heads", [1, 5, 16, 40])
def test_head_counts_pad_and_mask(make_case, num_heads, q_dtype):
    # 40 heads: three head blocks of 16, the last one half padding.
    case = make_case(num_tokens=2, num_heads=num_heads, topk=64, q_dtype=q_dtype, seed=num_heads)
    _assert_matches(*_run_both(case, PREFILL))


@pytest.mark.parametrize("topk", [1, 37, 100])
def test_topk_not_a_multiple_of_the_block(make_case, topk):
    case = make_case(num_tokens=2, num_heads=5, topk=topk, invalid_fraction=0.1, seed=topk)
    _assert_matches(*_run_both(case, DECODE if topk > tk.BLOCK_K else PREFILL))


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_adversarial_slots(make_case, path, q_dtype):
    case = make_case(num_tokens=5, num_heads=5, topk=100, q_dtype=q_dtype)
    case.indices[0] = -1  # nothing valid
    case.indices[1] = case.num_slots + torch.arange(100, dtype=torch.int32, device=DEVICE)  # all out of range
    case.indices[2, :] = 7  # one slot a hundred times
    case.indices[3, ::3] = torch.iinfo(torch.int32).max  # far out of range, interleaved
    case.indices[4, 64:] = -1  # the later splits are empty
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
    referenced = torch.zeros(case.num_slots, dtype=torch.bool, device=DEVICE)
    ok = (idx >= 0) & (idx < case.num_slots)
    referenced[idx[ok]] = True
    clean = case.kv_cache.clone()
    rows = case.kv_cache.view(-1, case.kv_cache.shape[-1])
    poison = rows[~referenced]
    if layout.get(kv_layout).fp8:
        poison[:, : layout.KV_LORA_RANK] = 0x7F  # fp8 e4m3 NaN
        poison[:, layout.FP8_SCALE_OFFSET:] = 0xFF  # NaN scales, rope or reserved bytes
    elif layout.get(kv_layout).nvfp4:
        poison[:, layout.get(kv_layout).rope_offset:] = 0x7F  # e4m3 NaN rope and block scales
    else:
        poison[:] = float("nan")
    rows[~referenced] = poison
    got, _ = _run_both(case, DECODE)
    _assert_matches(got, torch_sparse_mla(case.q, clean, case.indices, sm_scale=case.sm_scale,
                                          kv_layout=kv_layout, return_lse=True))


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_topk_length(make_case, path, q_dtype):
    case = make_case(num_tokens=4, num_heads=5, topk=100, q_dtype=q_dtype)
    lengths = torch.tensor([100, 10, 0, 65], dtype=torch.int32, device=DEVICE)
    _assert_matches(*_run_both(case, path, topk_length=lengths))


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_page_strided_view(make_case, kv_layout):
    pad = 48 if layout.get(kv_layout).fp8 else 24  # 48 bytes either way: 16-byte aligned
    case = make_case(kv_layout=kv_layout, page_pad=pad, num_tokens=2, num_heads=5, topk=100)
    assert case.kv_cache.stride(0) > case.kv_cache.shape[1] * case.kv_cache.shape[2]
    _assert_matches(*_run_both(case, DECODE))


def test_flat_cache(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=64)
    case.kv_cache = case.kv_cache.reshape(-1, layout.FP8_DS_MLA_TOKEN_BYTES)
    _assert_matches(*_run_both(case, PREFILL))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_sink_and_lse_base(make_case, path, lse_base):
    case = make_case(num_tokens=3, num_heads=5, topk=100)
    case.indices[2] = -1
    sink = torch.tensor([-2.0, 0.0, 1.0, 3.0, 50.0], device=DEVICE)
    _assert_matches(*_run_both(case, path, sink=sink, lse_base=lse_base))


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_bf16_q_and_out_buffer(make_case, path):
    case = make_case(num_tokens=3, num_heads=5, topk=100, q_dtype=torch.bfloat16)
    out = torch.full((3, 5, layout.KV_LORA_RANK), 9.0, dtype=torch.bfloat16, device=DEVICE)
    got, ref = _run_both(case, path, out=out)
    _assert_matches(got, ref)
    assert got[0] is out


# Strided arguments the validator accepts: each must be read through its strides.
STRIDED = {
    "topk_length stride 0": lambda c: dict(topk_length=torch.tensor([40], dtype=torch.int32, device=DEVICE).expand(4)),
    "topk_length column": lambda c: dict(topk_length=torch.tensor([[100, 1], [10, 2], [0, 3], [65, 4]],
                                                                  dtype=torch.int32, device=DEVICE)[:, 0]),
    "sink stride 0": lambda c: dict(sink=torch.tensor([1.5], device=DEVICE).expand(5)),
    "sink column": lambda c: dict(sink=torch.linspace(-2, 2, 10, device=DEVICE).reshape(5, 2)[:, 1]),
    "out rows apart": lambda c: dict(out=torch.zeros(4, 5, 2 * layout.KV_LORA_RANK, dtype=c.q.dtype,
                                                     device=DEVICE)[..., : layout.KV_LORA_RANK]),
    "out heads first": lambda c: dict(out=torch.zeros(5, 4, layout.KV_LORA_RANK, dtype=c.q.dtype,
                                                      device=DEVICE).transpose(0, 1)),
}


@pytest.mark.parametrize("path", [DECODE, PREFILL])
@pytest.mark.parametrize("what", list(STRIDED))
def test_strided_arguments_are_honoured(make_case, what, path):
    case = make_case(num_tokens=4, num_heads=5, topk=100)
    extra = STRIDED[what](case)
    got, ref = _run_both(case, path, **extra)
    _assert_matches(got, ref)
    if "out" in extra:
        assert got[0] is extra["out"]


# Narrowed: the rope-less fp8 rows are guarded in test_nope.py (packed 528-byte rows, both kernels);
# fp8_ds_mla_nope runs the same compiled code over rows whose 128 reserved bytes lie inside the
# storage, where a guard page cannot see a read (test_nope's NaN-in-reserved-bytes test does).
GUARDED_LAYOUTS = [kv for kv in layout.KV_LAYOUTS if kv not in ("fp8_ds_mla_nope", "fp8_nope")]


@pytest.mark.skipif(ON_GPU, reason="guard pages protect host memory: the CPU (interpreter) run checks them")
@pytest.mark.parametrize("kv_layout", GUARDED_LAYOUTS)
def test_no_read_past_any_storage(kv_layout):
    """Every tensor (q, cache, indices, stride-0 topk_length and sink) placed against an unreadable
    page, in a child process, one split and four: a read past any storage kills it with SIGSEGV."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("guarded_call.py")), "exact", kv_layout,
                           "1,4"], capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, f"rc={done.returncode} (-11 is SIGSEGV): {done.stderr[-2000:]}"


def test_public_entry_default_config_and_empty_batch(make_case):
    case = make_case(num_tokens=2, num_heads=5, topk=100)
    out = tk.triton_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                               kv_layout=case.kv_layout)
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                           kv_layout=case.kv_layout)
    assert_kernel_close(out, ref)
    empty = tk.triton_sparse_mla(case.q[:0], case.kv_cache, case.indices[:0],
                                 sm_scale=case.sm_scale, kv_layout=case.kv_layout)
    assert empty.shape == (0, 5, layout.KV_LORA_RANK)


REFUSED = {
    "overlapping out": ("out", lambda c: dict(out=torch.empty(1, 5, layout.KV_LORA_RANK, dtype=c.q.dtype,
                                                                device=DEVICE).expand(4, 5, layout.KV_LORA_RANK))),
    "sm_scale overflows float32": ("sm_scale", lambda c: dict(sm_scale=1e300)),
    "sm_scale negative": ("sm_scale", lambda c: dict(sm_scale=-0.1)),
    "cache misaligned": ("kv_cache", lambda c: dict(kv_cache=torch.zeros(
        2 * layout.PAGE_SIZE * layout.FP8_DS_MLA_TOKEN_BYTES + 2, dtype=torch.uint8, device=DEVICE)[2:].view(
        2, layout.PAGE_SIZE, layout.FP8_DS_MLA_TOKEN_BYTES))),
    "cache row stride not a multiple of 4": ("kv_cache", lambda c: dict(kv_cache=torch.zeros(
        2 * layout.PAGE_SIZE, layout.FP8_DS_MLA_TOKEN_BYTES + 2, dtype=torch.uint8,
        device=DEVICE)[:, : layout.FP8_DS_MLA_TOKEN_BYTES])),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_inputs_the_kernel_cannot_serve_are_refused(make_case, what):
    argument, make = REFUSED[what]
    case = make_case(num_tokens=4, num_heads=5, topk=100)
    args = dict(sm_scale=case.sm_scale, kv_layout=case.kv_layout, kernel="triton_sparse_mla")
    args.update(make(case))
    kv_cache = args.pop("kv_cache", case.kv_cache)
    with pytest.raises(KernelInputError, match=f"^given: {argument}="):
        sparse_mla_forward(case.q, kv_cache, case.indices, **args)


def test_page_divisor_is_exact_division():
    """The kernels find a slot's page by a multiply-shift; it must equal slot // page_size for every
    slot in [0, 2**31) (checked at the slots where an error would show: around multiples)."""
    top = 2**31 - 1
    for page_size in list(range(1, 300)) + [641, 1000, 4096, 65_536, 100_003, 2**20 + 7, 2**30, top]:
        magic, shift = page_divisor(page_size)
        near = [k * page_size + d for k in (1, 2, 3, top // page_size - 1, top // page_size) for d in (-1, 0, 1)]
        for slot in [0, 1, page_size - 1, page_size, top, *near]:
            if 0 <= slot <= top:
                assert slot * magic < 2**63 and (slot * magic) >> shift == slot // page_size, (page_size, slot)


@pytest.mark.parametrize("page_size", [48, 1])
def test_page_sizes_not_a_power_of_two(make_case, page_size):
    case = make_case(page_pad=48, page_size=page_size, num_pages=150 // page_size + 1, num_tokens=2, num_heads=5,
                     topk=60)
    _assert_matches(*_run_both(case, DECODE))


@pytest.mark.parametrize("family", ["sm120", "sm121", "sm90"])
def test_launch_config_splits_few_tokens_and_not_many(family):
    decode = tk.launch_config(num_tokens=1, num_heads=16, topk=2048, family=family)
    prefill = tk.launch_config(num_tokens=4096, num_heads=128, topk=2048, family=family)
    assert decode.num_splits > 1 and prefill.num_splits == 1
    for tokens, heads, topk in [(1, 1, 1), (1, 16, 2048), (3, 5, 100), (64, 64, 2048), (1, 128, 37)]:
        cfg = tk.launch_config(tokens, heads, topk, family)
        blocks = -(-topk // cfg.block_k)
        # Every split has work, and together they cover every block exactly once.
        assert (cfg.num_splits - 1) * cfg.blocks_per_split < blocks <= cfg.num_splits * cfg.blocks_per_split
        assert cfg.num_splits <= tk.MAX_SPLITS
        # The compile gate covers every block shape the heuristic picks.
        shape = (cfg.block_h, cfg.block_k, cfg.num_warps, cfg.num_stages)
        assert shape in {(v.block_h, v.block_k, v.num_warps, v.num_stages) for v in tk.launch_variants()}
