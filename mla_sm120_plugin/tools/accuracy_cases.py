"""The accuracy regimes of FlashMLA's and FlashInfer's SM120 tests, as inputs (docs/facts.md#accuracy-metrics-and-regimes).

Shared by the kernel tests (tests/kernels/test_accuracy.py, whose truth is the independent byte
reader tests/layout_oracle.py) and the accuracy benchmark (benchmarks/kernel_accuracy.py), so both
measure the same cases:

* ``flat``: q = randn / 10 and half the candidate ids -1 (FlashInfer's SM120 grid);
* ``peaked``: q = randn with DeepSeek-V3.2's softmax scale (0.135): a few candidates dominate;
* ``outlier``: three latent channels 30x the rest and two q channels 20x;
* ``few``: five candidates, the rest -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_sm120_plugin.kernels.dsa import layout, pack

REGIMES = ("flat", "peaked", "outlier", "few")
PEAKED_SM_SCALE = 0.135  # DeepSeek-V3.2's layer.scaling: 192 ** -0.5 * mscale ** 2 = 0.1352 (docs/facts.md)


@dataclass
class RegimeCase:
    q: torch.Tensor  # [T, H, D] bf16, D = the layout's head_dim
    kv_cache: torch.Tensor  # [pages, 64, row], written by pack.pack with arbitrary scales
    indices: torch.Tensor  # [T, topk] int32, -1 for padding
    sm_scale: float
    kv_layout: str


def regime_case(regime: str, kv_layout: str, *, tokens: int = 2, heads: int = 16, topk: int = 96,
                pages: int = 4, seed: int = 0) -> RegimeCase:
    """One regime's inputs, built on the CPU from a seeded generator (the same on every machine)."""
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r}: one of {list(REGIMES)}")
    gen = torch.Generator().manual_seed(seed)
    lay = layout.get(kv_layout)
    slots = pages * layout.PAGE_SIZE
    latent = torch.randn(slots, lay.head_dim, generator=gen)
    q = torch.randn(tokens, heads, lay.head_dim, generator=gen)
    sm_scale = lay.head_dim ** -0.5
    if regime == "flat":
        q /= 10
    elif regime in ("peaked", "few"):
        sm_scale = PEAKED_SM_SCALE
    else:  # outlier
        latent[:, [3, 200, 333]] *= 30
        q[:, :, [7, 130]] *= 20
    cache = pack.make_cache(pages, kv_layout)
    pack.write_to_cache(cache, pack.pack(latent, kv_layout, layout.SCALE_ARBITRARY), torch.arange(slots),
                        layout.PAGE_SIZE)
    indices = torch.randint(0, slots, (tokens, topk), generator=gen, dtype=torch.int32)
    if regime == "flat":
        indices[:, ::2] = -1
    elif regime == "few":
        indices[:, 5:] = -1
    return RegimeCase(q.to(torch.bfloat16), cache, indices, sm_scale, kv_layout)
