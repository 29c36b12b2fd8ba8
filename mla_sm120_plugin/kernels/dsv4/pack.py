"""Write and read DeepSeek-V4's 584-byte record (torch), driven by :mod:`.layout`.

:func:`quantize` turns 512-wide rows into data and scale rows the way the engines' writers do
(UE8M0 exponent ``ceil(log2(max(amax, 1e-4) / 448))`` per 64 NoPE values, e4m3 values, bf16
rope); :func:`new_cache` makes a page-major cache; :func:`write` stores rows at global slots;
:func:`gather` dequantizes the rows at global slots (fp32). Slots are ``page * page_size + row``,
the ids the engines hand the kernels; a slot outside the cache is refused here (the attention
kernels mask it instead).
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsv4 import layout

REC = layout.FP8_RECORD


def _check_rows(rows: torch.Tensor, name: str = "rows") -> None:
    if rows.dim() != 2 or rows.shape[1] != REC.head_dim or not rows.dtype.is_floating_point:
        raise KernelInputError(format_error(f"{name} of shape {tuple(rows.shape)}, dtype {rows.dtype}",
                                            f"[N, {REC.head_dim}] floating-point rows ({REC.nope} NoPE + {REC.rope} rope)",
                                            "pass the layer's 512-wide rows (after its norm and rope)"))


def exponents(amax: torch.Tensor) -> torch.Tensor:
    """The UE8M0 exponent of each group: ``ceil(log2(max(amax, 1e-4) / 448))``, exactly (int32).

    ``frexp`` gives ``v = m * 2**e`` with ``m`` in [0.5, 1): ``ceil(log2(v))`` is ``e - 1`` for
    ``m == 0.5`` (a power of two) and ``e`` otherwise; a float log2 can round a value just above a
    power of two onto it and pick a scale one step too small.
    """
    ratio = torch.clamp(amax.float(), min=layout.AMAX_FLOOR) / layout.E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ([N, 512], any float dtype; bf16 as the engines write) as records.

    :returns: ``(data, scales)``: [N, 576] and [N, 8] uint8 (data: 448 e4m3 then 64 bf16; scales:
        7 exponent bytes then a zero pad byte).
    """
    _check_rows(rows)
    n = rows.shape[0]
    nope = rows[:, :REC.nope].float().reshape(n, REC.num_scales, REC.scale_group)
    exp = exponents(nope.abs().amax(dim=-1))
    scaled = torch.clamp(nope * torch.ldexp(torch.ones_like(nope), -exp[..., None]), -layout.E4M3_MAX, layout.E4M3_MAX)
    data = torch.empty(n, REC.data_bytes, dtype=torch.uint8, device=rows.device)
    data[:, :REC.nope] = scaled.reshape(n, REC.nope).to(torch.float8_e4m3fn).view(torch.uint8)
    data[:, REC.nope:] = rows[:, REC.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, REC.scale_bytes, dtype=torch.uint8, device=rows.device)
    scales[:, :REC.num_scales] = torch.clamp(exp + layout.UE8M0_BIAS, 0, 255).to(torch.uint8)
    return data, scales


def new_cache(num_pages: int, page_size: int, *, page_stride: int | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed page-major cache: [num_pages, page_stride] uint8 (the padded page by default)."""
    least = REC.page_bytes(page_size)
    stride = least if page_stride is None else page_stride
    if num_pages < 1 or page_size < 1 or stride < page_size * REC.token_bytes:
        raise KernelInputError(format_error(f"num_pages={num_pages}, page_size={page_size}, page_stride={page_stride}",
                                            f"positive counts and a page stride >= page_size x {REC.token_bytes}",
                                            f"use page_stride={least} (the engines' padded page) or larger"))
    return torch.zeros(num_pages, stride, dtype=torch.uint8, device=device)


def _offsets(slots: torch.Tensor, page_size: int, page_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    page, row = slots // page_size, slots % page_size
    base = page * page_stride
    return base + row * REC.data_bytes, base + page_size * REC.data_bytes + row * REC.scale_bytes


def _check_slots(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    if cache.dim() != 2 or cache.dtype != torch.uint8 or cache.shape[1] < page_size * REC.token_bytes:
        raise KernelInputError(format_error(f"cache of shape {tuple(cache.shape)}, dtype {cache.dtype}",
                                            f"[pages, page_stride >= page_size x {REC.token_bytes}] uint8",
                                            "make it with new_cache(num_pages, page_size)"))
    slots = slots.to(torch.int64).reshape(-1)
    capacity = cache.shape[0] * page_size
    bad = (slots < 0) | (slots >= capacity)
    if bool(bad.any()):
        raise KernelInputError(format_error(f"slots {slots[bad][:4].tolist()} (cache of {capacity} slots)",
                                            f"slots in [0, {capacity})", "write and read only slots the cache holds"))
    return slots


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """The bytes from the first page's start to the last page's last used byte, as one row (a cache
    whose pages sit further apart than its rows are wide is a strided view; slot offsets use the
    page stride either way)."""
    span = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1]
    return cache.as_strided((span,), (1,))


def write(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, page_size: int) -> None:
    """Quantize ``rows`` ([N, 512]) into ``cache`` ([pages, page_stride] uint8) at ``slots`` ([N])."""
    slots = _check_slots(cache, slots, page_size)
    if slots.numel() != rows.shape[0]:
        raise KernelInputError(format_error(f"{rows.shape[0]} rows for {slots.numel()} slots", "one slot a row",
                                            "pass as many slots as rows"))
    data, scales = quantize(rows)
    flat = _flat(cache)
    data_at, scale_at = _offsets(slots, page_size, cache.stride(0))
    flat[(data_at[:, None] + torch.arange(REC.data_bytes, device=cache.device)).reshape(-1)] = data.reshape(-1)
    flat[(scale_at[:, None] + torch.arange(REC.scale_bytes, device=cache.device)).reshape(-1)] = scales.reshape(-1)


def gather(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The rows at ``slots`` ([N]) dequantized: [N, 512] float32 (``fp8 * 2 ** (byte - 127)``, rope)."""
    slots = _check_slots(cache, slots, page_size)
    flat = _flat(cache)
    data_at, scale_at = _offsets(slots, page_size, cache.stride(0))
    data = flat[(data_at[:, None] + torch.arange(REC.data_bytes, device=cache.device))]
    scales = flat[(scale_at[:, None] + torch.arange(REC.num_scales, device=cache.device))]
    nope = data[:, :REC.nope].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, REC.num_scales, REC.scale_group)
    nope = torch.ldexp(nope, scales.to(torch.int32)[..., None] - layout.UE8M0_BIAS)
    rope = data[:, REC.nope:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(-1, REC.nope), rope], dim=1)
