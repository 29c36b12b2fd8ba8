"""The DeepSeek-V4 family's self-check case: a window cache and a compressed cache in one call.

The case (:func:`build`) is the engines' call on FlashInfer's SM120 surface
(:func:`~mla_sm120_plugin.dispatch.dsv4.triton_dsv4`'s arguments) in miniature, in the key's record
and the page sizes the engine's call passes: token 0 a full window row (with -1 and out-of-range
ids) plus compressed slots, token 1 short rows, token 2 nothing valid (zeros), token 3 a window-only
row; finite, -inf and +30 sinks; scale groups of different magnitude, so a wrong per-group scale
shows. The plugin's Triton kernel runs it twice: on its launch plan and on a forced split. One case serves both phases (``phase="both"``, at the phase's q heads). The truth
(:func:`truth`) is the torch reference on a float64 q over the dequantized rows. The runner is
:mod:`.selfcheck`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.dsv4 import layout, pack
from ..kernels.dsv4.reference import dsv4_attention_reference
from ..types import PHASES, Decision
from .catalog import TRITON_DSV4
from .dsv4 import RECORD_OF_FORMAT, pages_of

REC = layout.FP8_RECORD
# What vLLM gives FlashInfer's DeepSeek-V4 kernels a device (_FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE);
# the self-check gives FlashInfer the same.
FLASHINFER_WORKSPACE_BYTES = 128 << 20
CHECK_TOKENS = 4  # a full row, a short one, an empty one, a window-only one
BOTH = "both"  # one case for both phases
ORDER = PHASES  # the phases in the order they are checked and logged: the plan table's
# `doctor --self-check`'s pages: vLLM's window pages and C128A's 2-entry compressed pages.
SWEEP_PAGES = (64, 2)
# The forced split of the Triton kernel's second run: 3 ranges of the case's 48 + 40 candidates cut
# inside the window row and across the window / compressed boundary.
CHECK_SPLITS = 3


def build(key: Any, device: torch.device) -> dict[str, Any]:
    """The check's call on FlashInfer's surface, built on the CPU with explicit dtypes, then moved."""
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)
    window, extra_width = 48, 40
    record = layout.RECORDS[key.kv_layout]

    def cache(page_size: int, entries: int) -> tuple[torch.Tensor, int]:
        pages = max(2, -(-entries // page_size))
        rows = torch.randn(pages * page_size, REC.head_dim, generator=gen, dtype=torch.float32, device=cpu)
        rows[:, : layout.NOPE_DIM] *= torch.tensor([0.25, 1.0, 4.0, 16.0, 0.5, 2.0, 8.0]).repeat_interleave(
            layout.SCALE_GROUP)
        buf = pack.new_cache(pages, page_size, device=cpu, record=record)
        pack.write(buf, rows, torch.arange(pages * page_size, dtype=torch.int64), page_size, record=record)
        view = buf.as_strided((pages, page_size, 1, record.token_bytes), (buf.stride(0), record.token_bytes,
                                                                           record.token_bytes, 1))
        return view, pages * page_size

    def ids(capacity: int, width: int) -> torch.Tensor:
        out = torch.randint(0, capacity, (CHECK_TOKENS, 1, width), generator=gen, dtype=torch.int32, device=cpu)
        out[0, 0, :3] = torch.tensor([-1, capacity, 2**31 - 1], dtype=torch.int32)
        return out

    window_page, extra_page = key.pages
    swa, swa_cap = cache(window_page, 3 * window)
    inputs: dict[str, Any] = dict(
        query=torch.randn(CHECK_TOKENS, key.num_heads, REC.head_dim, generator=gen, device=cpu),
        swa_kv_cache=swa, sparse_indices=ids(swa_cap, window),
        swa_topk_lens=torch.tensor([window, window // 3, 0, window], dtype=torch.int32),
        bmm1_scale=REC.head_dim ** -0.5, kv_layout="NHD", kv_cache_format=layout.FLASHINFER_FORMAT[key.kv_layout])
    sinks = torch.randn(key.num_heads, generator=gen)
    sinks[::3] = float("-inf")
    sinks[1::5] = 30.0  # outweighs every score: that head's output is near zero
    inputs["sinks"] = sinks
    if extra_page:
        extra, extra_cap = cache(extra_page, 2 * extra_width)
        inputs.update(compressed_kv_cache=extra, extra_sparse_indices=ids(extra_cap, extra_width),
                      extra_sparse_topk_lens=torch.tensor([extra_width, 7, 0, 0], dtype=torch.int32))
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    moved["query"] = moved["query"].to(torch.bfloat16)
    return moved


def splits_checked(key: Any) -> tuple[int | None, ...]:
    """The launch plans a kernel is run with: its own, and for the plugin's Triton kernel also a
    forced split (:data:`CHECK_SPLITS` ranges: the partials and the combine), whatever its plan for
    the case's shape would pick."""
    return (None, CHECK_SPLITS) if key.kernel == TRITON_DSV4 else (None,)


def run(kernel: Any, key: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """The kernel on the case, as the engines call it (FlashInfer gets the workspace vLLM gives it),
    once per :func:`splits_checked` plan, the outputs one after the other along the token axis."""
    device = torch.device(key.device)
    workspace = (torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                 if device.type == "cuda" else None)
    outs = []
    for splits in splits_checked(key):
        out = torch.empty_like(inputs["query"])
        kernel.fn(workspace_buffer=workspace, out=out, **inputs, **({} if splits is None else {"num_splits": splits}))
        outs.append(out)
    return torch.cat(outs)


def truth(key: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Float64 attention over the case's dequantized rows (the reference on a float64 q)."""
    record = RECORD_OF_FORMAT[inputs["kv_cache_format"]]
    swa, swa_page = pages_of("swa_kv_cache", inputs["swa_kv_cache"], "NHD", record)
    kwargs: dict[str, Any] = {"record": record}
    if "compressed_kv_cache" in inputs:
        extra, extra_page = pages_of("compressed_kv_cache", inputs["compressed_kv_cache"], "NHD", record)
        kwargs.update(extra_cache=extra, extra_indices=inputs["extra_sparse_indices"][:, 0],
                      extra_lengths=inputs["extra_sparse_topk_lens"], extra_page_size=extra_page)
    want = dsv4_attention_reference(inputs["query"].double(), swa, inputs["sparse_indices"][:, 0], swa_page,
                                    sm_scale=inputs["bmm1_scale"], swa_lengths=inputs["swa_topk_lens"],
                                    sinks=inputs["sinks"], **kwargs)
    return torch.cat([want] * len(splits_checked(key)))


def keys(decision: Decision, phase: str, kernel: str, *, q_dtype: str, device: str) -> list[dict[str, Any]]:
    """What proves ``kernel`` for ``phase`` of a layer kind's ``decision`` (``CheckKey`` fields): its
    record, the phase's q heads and the pages the engine's call passes."""
    call = decision.context.call
    assert call is not None  # a DeepSeek-V4 decision carries its call
    return [dict(kernel=kernel, phase=BOTH, kv_layout=decision.context.kv_cache_dtype,
                 num_heads=call.heads_for(phase), device=device, q_dtype=q_dtype, pages=tuple(call.pages_at_call))]


def sweep_keys(name: str, spec: Any, *, num_heads: int, device: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``doctor --self-check``'s keys for a DeepSeek-V4 kernel: each record it reads, on vLLM's window
    pages and C128A's 2-entry compressed pages."""
    return [(dict(kernel=name, phase=BOTH, kv_layout=record, num_heads=num_heads, device=device,
                  pages=tuple(SWEEP_PAGES)), dict(scale_format=None, topk=None))
            for record in sorted(spec.kv_cache_dtypes)]
