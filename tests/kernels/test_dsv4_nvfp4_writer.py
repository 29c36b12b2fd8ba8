"""The writers of DeepSeek-V4's 384-byte NVFP4 record (kernels/dsv4/nvfp4_writer.py), under Triton's
interpreter: every byte they store is FlashInfer's documented record (tests/support/layout_oracle.py
``encode_dsv4_nvfp4_row``, in Python floats) of the row the layer math gives (docs/facts.md#deepseek-v4: GPT-J rope
in fp32 on the last 64 values, bf16; the compressor's per-value softmax over its saved states, RMS
norm with its weight, rope at the block's first position), slots < 0 or past the cache are skipped
and no other byte changes."""

from __future__ import annotations

import pytest
import torch

from support.layout_oracle import dsv4_compressed_row, dsv4_nvfp4_entry, dsv4_roped_bf16, encode_dsv4_nvfp4_row
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsv4 import nvfp4_writer

SENTINEL = 0xA5  # what the cache holds where nothing is written


def _cache(pages: int, page_size: int, pad: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A [pages, P, 384] engine view over padded pages, filled with the sentinel; and its base."""
    base = torch.full((pages, page_size * 384 + pad), SENTINEL, dtype=torch.uint8)
    return base.as_strided((pages, page_size, 384), (base.stride(0), 384, 1)), base


def _expect(base: torch.Tensor, written: dict[int, torch.Tensor], page_size: int) -> None:
    """The written slots hold the record of their rows; every other byte is the sentinel."""
    seen = torch.zeros_like(base, dtype=torch.bool)
    for slot, row in written.items():
        data, scales = encode_dsv4_nvfp4_row(row.float().tolist())
        assert dsv4_nvfp4_entry(base, slot, page_size) == (data, scales), slot
        page, r = divmod(slot, page_size)
        seen[page, r * 352:(r + 1) * 352] = True
        seen[page, page_size * 352 + r * 32:page_size * 352 + (r + 1) * 32] = True
    assert bool((base[~seen] == SENTINEL).all())


def test_window_rows_are_roped_and_stored_as_flashinfers_record():
    gen = torch.Generator().manual_seed(0)
    tokens, page_size, pages = 10, 4, 5
    kv = torch.randn(tokens, 512, generator=gen) * torch.logspace(-3, 2, 512)[torch.randperm(512, generator=gen)]
    kv[1, :16] = 0.0  # a zero group: scale 0
    kv[2, 16:32] = -0.0  # negative zeros keep their sign bit
    kv[3, :16] = 1e-5  # amax / 6 rounds to 0
    kv[3, 16:32] = 1e-4  # ... to an e4m3 subnormal
    kv[4, :16] = 3000.0  # saturated scale
    kv[5, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # e2m1 ties at scale 1
    kv = kv.to(torch.bfloat16)
    cos_sin = torch.randn(64, 64, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.tensor([0, 3, 5, -1, 19, 7, 2, 11, pages * page_size, 6])  # -1 and past the cache: skipped
    cache, base = _cache(pages, page_size)
    nvfp4_writer.insert_rows(cache, kv, slots, positions, cos_sin)
    want = {int(s): dsv4_roped_bf16(kv[t].float(), cos_sin[positions[t], :32], cos_sin[positions[t], 32:])
            for t, s in enumerate(slots.tolist()) if 0 <= s < pages * page_size}
    _expect(base, want, page_size)


def _states(gen, blocks: int, block: int, width: int) -> torch.Tensor:
    return torch.randn(blocks, block, 2 * width, generator=gen) * 2


@pytest.mark.parametrize("ratio, overlap, state_block", [(4, True, 4), (128, False, 8)], ids=["c4a", "c128a"])
def test_compressed_rows_are_the_gated_sum_normed_roped_and_stored(ratio, overlap, state_block):
    gen = torch.Generator().manual_seed(ratio)
    width = (1 + overlap) * 512
    states = _states(gen, 200, state_block, width)
    table = (torch.randperm(199, generator=gen)[:160].view(2, 80) + 1).int()
    positions = torch.tensor([299, 255, 256, 131, 127, 3, 7, 11])  # closing a block or not; 3 / 7: before 0
    req = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.int32)
    state_slots = torch.tensor([5, 6, 7, 8, 9, 10, 11, -1])  # -1: a padding token, skipped
    page_size = 256 // ratio
    slots = torch.tensor([1, 2, 3, page_size + 4, page_size + 5, 2 * page_size, 2 * page_size + 1, 9])
    weight = (torch.randn(512, generator=gen) / 4 + 1).to(torch.bfloat16)
    cos_sin = torch.randn(400, 64, generator=gen)
    cache, base = _cache(4, page_size)
    nvfp4_writer.compress_insert(cache, slots, state_cache=states, state_slots=state_slots, token_to_req=req,
                                 block_table=table, state_block=state_block, state_width=width, positions=positions,
                                 ratio=ratio, overlap=overlap, norm_weight=weight, eps=1e-6, cos_sin_cache=cos_sin)
    want = {}
    win = (1 + overlap) * ratio
    for t, pos in enumerate(positions.tolist()):
        if state_slots[t] < 0 or (pos + 1) % ratio:
            continue
        kv, score = [], []
        for j, p in enumerate(range(pos - win + 1, pos + 1)):
            half = 512 if j >= ratio else 0
            row = states[table[req[t], p // state_block], p % state_block] if p >= 0 else None
            kv.append(None if row is None else row[half:half + 512])
            score.append(None if row is None else row[width + half:width + half + 512])
        start = pos // ratio * ratio
        want[int(slots[t])] = dsv4_roped_bf16(dsv4_compressed_row(kv, score, weight, 1e-6), cos_sin[start, :32],
                                              cos_sin[start, 32:])
    assert len(want) == (6 if ratio == 4 else 2)  # what closes a block, skipping the padding token
    _expect(base, want, page_size)


def test_q_is_normed_roped_and_padded_with_zero_heads():
    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(3, 5, 512, generator=gen) * 7).to(torch.bfloat16)
    cos_sin = torch.randn(16, 64, generator=gen)
    positions = torch.tensor([4, 0, 15])
    out = nvfp4_writer.normed_roped_query(q, positions, cos_sin, 8, 1e-6)
    assert out.shape == (3, 8, 512) and out.dtype == torch.bfloat16 and bool((out[:, 5:] == 0).all())
    x = q.double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    for t, p in enumerate(positions.tolist()):
        for h in range(5):
            want = dsv4_roped_bf16(x[t, h].float(), cos_sin[p, :32], cos_sin[p, 32:]).double()
            assert torch.allclose(out[t, h].double(), want, rtol=2 ** -7, atol=1e-6), (t, h)


@pytest.mark.parametrize("bad, name", [
    (dict(cache=torch.zeros(2, 4, 584, dtype=torch.uint8)), "cache"),
    (dict(kv=torch.zeros(3, 448, dtype=torch.bfloat16)), "kv"),
    (dict(cos_sin_cache=torch.zeros(16, 32)), "cos_sin_cache"),
    (dict(slots=torch.zeros(5, dtype=torch.int64)), "slots / kv / positions"),
])
def test_bad_arguments_are_refused_by_name(bad, name):
    args = dict(cache=_cache(2, 4)[0], kv=torch.zeros(3, 512, dtype=torch.bfloat16),
                slots=torch.zeros(3, dtype=torch.int64), positions=torch.zeros(3, dtype=torch.int64),
                cos_sin_cache=torch.zeros(16, 64))
    args.update(bad)
    with pytest.raises(KernelInputError) as err:
        nvfp4_writer.insert_rows(**args)
    assert str(err.value).startswith(f"given: {name}")
