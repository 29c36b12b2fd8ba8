"""``sparse_mla_forward``: every malformed input is a KernelInputError naming the argument."""

from __future__ import annotations

import functools

import pytest
import torch

from support.cli import assert_three_parts
from support.kernel_checks import DEVICE, assert_kernel_close
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin import sparse_mla_forward
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS as KERNEL_NAMES
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla

T, H, TOPK = 3, 4, 20


@pytest.fixture
def make_case(make_case):
    """Validation and the reference path on the CPU; Triton calls pass device=DEVICE."""
    return functools.partial(make_case, device="cpu")


@pytest.fixture
def good(make_case):
    case = make_case(num_tokens=T, num_heads=H, topk=TOPK)
    return dict(q=case.q, kv_cache=case.kv_cache, indices=case.indices, sm_scale=case.sm_scale,
                kv_layout=case.kv_layout, kernel="torch_sparse_mla")


def _call(args):
    args = dict(args)
    return sparse_mla_forward(args.pop("q"), args.pop("kv_cache"), args.pop("indices"), **args)


BAD = {
    "q rank": ("q", lambda a: a["q"][0]),
    "q width": ("q", lambda a: a["q"][..., :512]),
    "q dtype": ("q", lambda a: a["q"].half()),
    "q heads": ("q", lambda a: a["q"][:, :1].expand(T, 129, layout.HEAD_DIM)),
    "q not a tensor": ("q", lambda a: a["q"].tolist()),
    "cache dtype": ("kv_cache", lambda a: a["kv_cache"].view(torch.int8)),
    "cache width": ("kv_cache", lambda a: a["kv_cache"][..., :640]),
    "cache rank": ("kv_cache", lambda a: a["kv_cache"][None]),
    "cache bf16 for fp8 layout": ("kv_cache", lambda a: torch.zeros(2, 64, layout.BF16_TOKEN_ELEMS, dtype=torch.bfloat16)),
    "cache rows not contiguous": ("kv_cache", lambda a: torch.zeros(3, 64, 2 * layout.FP8_DS_MLA_TOKEN_BYTES, dtype=torch.uint8)[..., ::2]),
    "layout": ("kv_layout", lambda a: "fp8"),
    "page size": ("page_size", lambda a: 32),
    "page size type": ("page_size", lambda a: 64.0),
    "indices dtype": ("indices", lambda a: a["indices"].long()),
    "indices rows": ("indices", lambda a: a["indices"][:2]),
    "indices rank": ("indices", lambda a: a["indices"][0]),
    "indices empty": ("indices", lambda a: a["indices"][:, :0]),
    "topk_length dtype": ("topk_length", lambda a: torch.ones(T, dtype=torch.int64)),
    "topk_length shape": ("topk_length", lambda a: torch.ones(T, 1, dtype=torch.int32)),
    "sm_scale tensor": ("sm_scale", lambda a: torch.tensor(0.1)),
    "sm_scale zero": ("sm_scale", lambda a: 0.0),
    "sm_scale nan": ("sm_scale", lambda a: float("nan")),
    "sm_scale inf": ("sm_scale", lambda a: float("inf")),
    "sm_scale bool": ("sm_scale", lambda a: True),
    "lse_base": ("lse_base", lambda a: "10"),
    "return_lse": ("return_lse", lambda a: 1),
    "out shape": ("out", lambda a: torch.empty(T, H, 576, dtype=a["q"].dtype)),
    "out dtype": ("out", lambda a: torch.empty(T, H, 512, dtype=torch.float32)),
    "sink dtype": ("sink", lambda a: torch.zeros(H, dtype=torch.bfloat16)),
    "sink shape": ("sink", lambda a: torch.zeros(H + 1)),
    "scale_format": ("scale_format", lambda a: "e8m0"),
    "kernel": ("kernel", lambda a: "flashmla"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_input_names_the_argument(good, what):
    argument, make = BAD[what]
    args = dict(good)
    args[argument] = make(args)
    with pytest.raises(KernelInputError) as err:
        _call(args)
    assert_three_parts(str(err.value), f"{argument}=")


def test_unknown_kernel_lists_every_registered_name(good):
    from mla_sm120_plugin.hooks.manager import get_registry

    with pytest.raises(KernelInputError) as err:
        _call({**good, "kernel": "nope"})
    for name in get_registry().kernels:
        assert name in str(err.value)
    assert set(KERNEL_NAMES) <= set(get_registry().kernels)


def test_flashinfer_needs_a_scale_format(good):
    with pytest.raises(KernelInputError, match="scale_format"):
        _call({**good, "kernel": "flashinfer_sparse_mla"})


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_good_input_through_the_reference(make_case, kv_layout):
    case = make_case(kv_layout=kv_layout, num_tokens=T, num_heads=H, topk=TOPK)
    lengths = torch.tensor([TOPK, 5, 0], dtype=torch.int32)
    sink = torch.linspace(-1, 1, H)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    got, lse = sparse_mla_forward(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                  kv_layout=kv_layout, kernel="torch_sparse_mla", topk_length=lengths,
                                  sink=sink, out=out, return_lse=True, lse_base="2")
    ref, ref_lse = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                                    kv_layout=kv_layout, topk_length=lengths, sink=sink,
                                    return_lse=True, lse_base="2")
    assert got is out
    assert torch.equal(got, ref) and torch.equal(lse, ref_lse)


def test_good_input_through_triton(make_case):
    case = make_case(num_tokens=T, num_heads=H, topk=TOPK, q_dtype=torch.float32, device=DEVICE)
    got = sparse_mla_forward(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                             kv_layout=case.kv_layout, kernel="triton_sparse_mla")
    ref = torch_sparse_mla(case.q, case.kv_cache, case.indices, sm_scale=case.sm_scale,
                           kv_layout=case.kv_layout)
    assert_kernel_close(got, ref)


def test_integer_sm_scale_is_accepted(good):
    out = _call({**good, "sm_scale": 1})
    assert out.shape == (T, H, layout.KV_LORA_RANK)


def test_auto_asks_the_selection_and_agrees_with_the_reference(good, monkeypatch):
    import os

    from support.kernel_checks import KERNEL_REL_TOL

    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON, TRITON_FAST
    from mla_sm120_plugin.selection import choose_kernel_for_shape, clear_probe_cache

    # CPU tensors: FlashInfer (NVIDIA only) is never a candidate; Triton runs here only under its
    # interpreter (the fp8-MMA kernel first for an fp8 cache), else the reference is all that is left.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    chosen = choose_kernel_for_shape(kv_layout=good["kv_layout"], num_heads=H, topk=TOPK,
                                     num_tokens=T, device_type="cpu")
    triton = TRITON_FAST if good["kv_layout"] == layout.FP8_DS_MLA else TRITON
    assert chosen == (triton if interpreted else TORCH)
    args = {**good, "q": good["q"].float(), "kernel": "auto"}
    out = _call(args)
    # "auto" ran the kernel the selection named: bit for bit what naming it explicitly gives.
    assert torch.equal(out, _call({**args, "kernel": chosen}))
    ref = torch_sparse_mla(args["q"], good["kv_cache"], good["indices"], sm_scale=good["sm_scale"],
                           kv_layout=good["kv_layout"])
    spec = get_registry().kernels[chosen]
    assert_kernel_close(out, ref, KERNEL_REL_TOL if spec.precision == "exact" else spec.tolerance)
    if interpreted:
        # Without the interpreter the Triton probe fails on this CPU: the same call picks the reference.
        monkeypatch.delenv("TRITON_INTERPRET")
        clear_probe_cache()
        assert choose_kernel_for_shape(kv_layout=good["kv_layout"], num_heads=H, topk=TOPK,
                                       num_tokens=T, device_type="cpu") == TORCH
