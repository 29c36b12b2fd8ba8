"""Kernel-test cases (imported by the kernel, dispatch and engine suites, and by tests/kernels/guarded_call.py):
random caches in any layout of ``layout.LAYOUTS``, on the test device (support.kernel_checks.DEVICE: CUDA
when present, else the CPU, where tests/conftest.py has set TRITON_INTERPRET)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from support.kernel_checks import DEVICE
from mla_sm120_plugin.kernels.dsa import layout, pack


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], D = the layout's head_dim (576, or 512 rope-less)
    kv_cache: torch.Tensor  # [P, page, W] (maybe a page-strided view)
    indices: torch.Tensor  # [T, topk] int32
    sm_scale: float
    kv_layout: str
    latent: torch.Tensor  # [P * page, D] fp32, what was written (before quantization)

    @property
    def num_slots(self) -> int:
        return self.kv_cache.shape[0] * self.kv_cache.shape[1]


def paged_cache(num_pages: int, kv_layout: str, page_size: int, page_pad: int) -> torch.Tensor:
    """A zeroed cache; with ``page_pad > 0`` a page-strided view (pages ``page_pad`` elements apart
    more than packed), as vLLM's ``flat_kv_row_view`` can hand out. Pads keep 16-byte alignment."""
    if page_pad == 0:
        return pack.make_cache(num_pages, kv_layout, page_size)
    width = pack.token_width(kv_layout)
    base = torch.zeros(num_pages, page_size * width + page_pad, dtype=pack.cache_dtype(kv_layout))
    return base.as_strided((num_pages, page_size, width), (page_size * width + page_pad, width, 1))


def build_case(
    *,
    kv_layout: str = layout.FP8_DS_MLA,
    num_pages: int = 3,
    num_tokens: int = 4,
    num_heads: int = 16,
    topk: int = 64,
    page_size: int = layout.PAGE_SIZE,
    scale_format: str = layout.SCALE_ARBITRARY,
    page_pad: int = 0,
    invalid_fraction: float = 0.2,
    q_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = DEVICE,
) -> Case:
    """Random unit-scale tokens in every slot, random candidates with -1 and out-of-range ids.

    q and the cached tokens are as wide as the layout's ``head_dim``; the cache is written by
    :func:`pack.pack` (``scale_format`` for fp8 layouts) and ``sm_scale`` is ``head_dim ** -0.5``.
    Built on the CPU from a seeded generator (the same values on every machine), then moved to
    ``device``."""
    lay = layout.get(kv_layout)
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_pages * page_size
    # Tiles of different magnitudes, so a wrong per-tile scale shows.
    tile_gain = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat_interleave(layout.FP8_TILE)
    latent = torch.randn(num_slots, lay.head_dim, generator=gen)
    latent[:, : lay.latent] *= tile_gain
    cache = paged_cache(num_pages, kv_layout, page_size, page_pad)
    pack.write_to_cache(cache, pack.pack(latent, kv_layout, scale_format), torch.arange(num_slots), page_size)

    indices = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int32)
    drop = torch.rand(num_tokens, topk, generator=gen) < invalid_fraction
    junk = torch.where(torch.rand(num_tokens, topk, generator=gen) < 0.5, -1, num_slots + 7)
    indices = torch.where(drop, junk.to(torch.int32), indices)
    q = torch.randn(num_tokens, num_heads, lay.head_dim, generator=gen).to(q_dtype)
    if device != "cpu":
        cache = _moved_view(cache, device)
    return Case(q.to(device), cache, indices.to(device), lay.head_dim**-0.5, kv_layout, latent.to(device))


def _moved_view(view: torch.Tensor, device: str) -> torch.Tensor:
    """``view`` on ``device`` with its strides (``.to`` would compact a page-strided view)."""
    storage = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage()).to(device)
    return storage.as_strided(view.shape, view.stride(), view.storage_offset())
