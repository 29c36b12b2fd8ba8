"""Write and read DeepSeek-V4's records (torch), driven by :mod:`.layout`.

:func:`quantize` turns 512-wide rows into the 584-byte record's data and scale rows the way the
engines' writers do (UE8M0 exponent ``ceil(log2(max(amax, 1e-4) / 448))`` per 64 NoPE values,
e4m3 values, bf16 rope); :func:`quantize_nvfp4` into the 384-byte NVFP4 record's as FlashInfer's
writers document it (per 16 NoPE values ``scale = e4m3(amax * fp32(1/6))``, saturating, no floor;
``e2m1(x * (1 / scale))`` rounded to nearest even and saturating at 6, the sign kept; a scale of
0 gives codes 0 or -0; bf16 rope; 4 zero bytes after the 28 scales). :func:`new_cache` makes a
page-major cache; :func:`write` stores rows at global slots; :func:`gather` dequantizes the rows
at global slots (fp32, exact). Slots are ``page * page_size + row``, the ids the engines hand the
kernels; a slot outside the cache is refused here (the attention kernels mask it instead). Each
takes the record (:data:`.layout.FP8_RECORD` by default).
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsv4 import layout
from mla_sm120_plugin.kernels.shared.formats import E2M1_VALUES, e2m1_codes, e4m3_satfinite

REC = layout.FP8_RECORD
NVFP4 = layout.NVFP4_RECORD
_ONE_SIXTH = 1.0 / 6.0  # rounded to fp32 where it multiplies (torch.float32 arithmetic)


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
    scaled = e4m3_satfinite(nope * torch.ldexp(torch.ones_like(nope), -exp[..., None]))
    data = torch.empty(n, REC.data_bytes, dtype=torch.uint8, device=rows.device)
    data[:, :REC.nope] = scaled.reshape(n, REC.nope).view(torch.uint8)
    data[:, REC.nope:] = rows[:, REC.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, REC.scale_bytes, dtype=torch.uint8, device=rows.device)
    scales[:, :REC.num_scales] = torch.clamp(exp + layout.UE8M0_BIAS, 0, 255).to(torch.uint8)
    return data, scales


def quantize_nvfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ([N, 512], any float dtype; bf16 as the writers take) as 384-byte NVFP4 records.

    :returns: ``(data, scales)``: [N, 352] and [N, 32] uint8 (data: 224 bytes of e2m1 pairs, even
        index in the low nibble, then 64 bf16; scales: 28 e4m3 bytes then 4 zero bytes).
    """
    _check_rows(rows)
    n = rows.shape[0]
    nope = rows[:, :NVFP4.nope].float().reshape(n, NVFP4.num_scales, NVFP4.scale_group)
    amax = nope.abs().amax(dim=-1)
    sf = e4m3_satfinite(amax * torch.tensor(_ONE_SIXTH, dtype=torch.float32))
    scale = sf.float()
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / torch.where(scale == 0, torch.ones_like(scale), scale))
    codes = e2m1_codes(nope * inv[..., None]).reshape(n, NVFP4.nope)
    data = torch.empty(n, NVFP4.data_bytes, dtype=torch.uint8, device=rows.device)
    data[:, :NVFP4.nope_bytes] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    data[:, NVFP4.nope_bytes:] = rows[:, NVFP4.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, NVFP4.scale_bytes, dtype=torch.uint8, device=rows.device)
    scales[:, :NVFP4.num_scales] = sf.view(torch.uint8)
    return data, scales


_QUANTIZE = {REC.name: quantize, NVFP4.name: quantize_nvfp4}


def new_cache(num_pages: int, page_size: int, *, page_stride: int | None = None,
              device: torch.device | str = "cpu", record: layout.Dsv4Record = REC) -> torch.Tensor:
    """A zeroed page-major cache: [num_pages, page_stride] uint8 (the padded page by default)."""
    least = record.page_bytes(page_size)
    stride = least if page_stride is None else page_stride
    if num_pages < 1 or page_size < 1 or stride < page_size * record.token_bytes:
        raise KernelInputError(format_error(f"num_pages={num_pages}, page_size={page_size}, page_stride={page_stride}",
                                            f"positive counts and a page stride >= page_size x {record.token_bytes}",
                                            f"use page_stride={least} (the engines' padded page) or larger"))
    return torch.zeros(num_pages, stride, dtype=torch.uint8, device=device)


def _offsets(slots: torch.Tensor, page_size: int, page_stride: int,
             record: layout.Dsv4Record) -> tuple[torch.Tensor, torch.Tensor]:
    page, row = slots // page_size, slots % page_size
    base = page * page_stride
    return base + row * record.data_bytes, base + page_size * record.data_bytes + row * record.scale_bytes


def _check_slots(cache: torch.Tensor, slots: torch.Tensor, page_size: int, record: layout.Dsv4Record) -> torch.Tensor:
    if cache.dim() != 2 or cache.dtype != torch.uint8 or cache.shape[1] < page_size * record.token_bytes:
        raise KernelInputError(format_error(f"cache of shape {tuple(cache.shape)}, dtype {cache.dtype}",
                                            f"[pages, page_stride >= page_size x {record.token_bytes}] uint8",
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


def write(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, page_size: int,
          record: layout.Dsv4Record = REC) -> None:
    """Quantize ``rows`` ([N, 512]) into ``cache`` ([pages, page_stride] uint8) at ``slots`` ([N])."""
    slots = _check_slots(cache, slots, page_size, record)
    if slots.numel() != rows.shape[0]:
        raise KernelInputError(format_error(f"{rows.shape[0]} rows for {slots.numel()} slots", "one slot a row",
                                            "pass as many slots as rows"))
    data, scales = _QUANTIZE[record.name](rows)
    flat = _flat(cache)
    data_at, scale_at = _offsets(slots, page_size, cache.stride(0), record)
    flat[(data_at[:, None] + torch.arange(record.data_bytes, device=cache.device)).reshape(-1)] = data.reshape(-1)
    flat[(scale_at[:, None] + torch.arange(record.scale_bytes, device=cache.device)).reshape(-1)] = scales.reshape(-1)


def gather(cache: torch.Tensor, slots: torch.Tensor, page_size: int, record: layout.Dsv4Record = REC) -> torch.Tensor:
    """The rows at ``slots`` ([N]) dequantized: [N, 512] float32, exact (fp8 record: ``e4m3 * 2 **
    (byte - 127)``; NVFP4 record: ``e2m1 * e4m3 scale``; the bf16 rope as is)."""
    slots = _check_slots(cache, slots, page_size, record)
    flat = _flat(cache)
    data_at, scale_at = _offsets(slots, page_size, cache.stride(0), record)
    data = flat[(data_at[:, None] + torch.arange(record.data_bytes, device=cache.device))]
    scales = flat[(scale_at[:, None] + torch.arange(record.num_scales, device=cache.device))]
    rope = data[:, record.nope_bytes:].contiguous().view(torch.bfloat16).float()
    if record.nope_bits == 4:
        packed = data[:, :record.nope_bytes].to(torch.int64)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1, record.num_scales, record.scale_group)
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=cache.device)[codes]
        nope = values * scales.contiguous().view(torch.float8_e4m3fn).float()[..., None]
    else:
        nope = data[:, :record.nope].contiguous().view(torch.float8_e4m3fn).float().reshape(
            -1, record.num_scales, record.scale_group)
        nope = torch.ldexp(nope, scales.to(torch.int32)[..., None] - layout.UE8M0_BIAS)
    return torch.cat([nope.reshape(-1, record.nope), rope], dim=1)
