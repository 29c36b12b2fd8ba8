"""Pack, unpack and store KV-cache tokens in the layouts of :mod:`.layout` (torch).

The byte layout itself is described once, in :mod:`mla_sm120_plugin.kernels.layout`; this module
only moves values into and out of those bytes. It is the writer the tests and benchmarks use, and
the dequantizer the torch reference uses.

Global slot ids are ``page * page_size + row``, the same ids ``indices`` carries.
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels import layout

# An all-zero tile has amax 0, so `amax / 448` would be a zero scale and `x / scale` 0/0. Any
# nonzero scale stores such a tile exactly (every fp8 value is 0), so we store 1.0: a readable,
# exactly representable value that no reader can mistake for "unset". The same value replaces a
# scale that underflows to 0 for a tile of tiny subnormal values; those values then quantize to 0,
# an absolute error below 2**-149 * 448.
ZERO_TILE_SCALE = 1.0


def _tile_scales(amax: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Per-tile fp32 scales from per-tile absolute maxima (any shape, float32)."""
    ratio = amax / layout.FP8_E4M3_MAX
    if scale_format == layout.SCALE_POW2:
        # 2 ** ceil(log2(v)) computed exactly with frexp: v = m * 2**e, m in [0.5, 1), so
        # ceil(log2(v)) = e - 1 when m == 0.5 (v is a power of two) and e otherwise. A float log2
        # can round a value just above a power of two down onto it and pick a scale too small.
        floored = torch.clamp(ratio, min=layout.POW2_SCALE_FLOOR)
        mantissa, exponent = torch.frexp(floored)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        return torch.ldexp(torch.ones_like(floored), exponent)
    if scale_format == layout.SCALE_ARBITRARY:
        return torch.where(ratio > 0, ratio, torch.full_like(ratio, ZERO_TILE_SCALE))
    raise KernelInputError(
        format_error(
            given=f"scale_format={scale_format!r}",
            supported=f"one of {layout.SCALE_FORMATS}",
            fix="pass 'pow2' for DeepSeek-V3.2 caches or 'arbitrary' for GLM caches",
        )
    )


def _check_latent(latent: torch.Tensor) -> None:
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2 or latent.shape[1] != layout.HEAD_DIM:
        shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise KernelInputError(
            format_error(
                given=f"latent shape {shape}",
                supported=f"[N, {layout.HEAD_DIM}] (512 latent + 64 rope)",
                fix="pass one row per token, latent and rope concatenated",
            )
        )
    if latent.dtype not in (torch.bfloat16, torch.float32):
        raise KernelInputError(
            format_error(
                given=f"latent dtype {latent.dtype}",
                supported="torch.bfloat16 or torch.float32",
                fix="cast the latent with .to(torch.bfloat16)",
            )
        )


def quantize_fp8_ds_mla(latent: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Pack tokens into the 656-byte ``fp8_ds_mla`` layout.

    Each 128-wide latent tile gets one fp32 scale: ``pow2`` stores
    ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` (DeepSeek-V3.2), ``arbitrary`` stores
    ``amax / 448`` (GLM), and :data:`ZERO_TILE_SCALE` for an all-zero tile. The stored fp8 value is
    ``clamp(x / scale, -448, 448)`` rounded to nearest by torch. The RoPE part is stored as raw
    bfloat16 bytes (an fp32 input is rounded to bfloat16 first). Non-finite inputs give non-finite
    scales; they are not checked here.

    latent: [N, 576], bfloat16 or float32 (512 latent then 64 rope)
    returns: [N, 656], uint8
    """
    _check_latent(latent)
    n = latent.shape[0]
    x = latent.float()
    nope = x[:, : layout.KV_LORA_RANK].reshape(n, layout.FP8_NUM_TILES, layout.FP8_TILE)  # [N, 4, 128]
    amax = nope.abs().amax(dim=-1)  # [N, 4]
    scales = _tile_scales(amax, scale_format)  # [N, 4] fp32
    scaled = (nope / scales[:, :, None]).clamp(-layout.FP8_E4M3_MAX, layout.FP8_E4M3_MAX)  # [N, 4, 128]
    fp8 = scaled.to(torch.float8_e4m3fn).reshape(n, layout.KV_LORA_RANK)  # [N, 512]
    rope = latent[:, layout.KV_LORA_RANK :].to(torch.bfloat16).contiguous()  # [N, 64]

    packed = torch.empty(n, layout.FP8_DS_MLA_TOKEN_BYTES, dtype=torch.uint8, device=latent.device)
    packed[:, layout.FP8_NOPE_OFFSET : layout.FP8_SCALE_OFFSET] = fp8.view(torch.uint8)
    packed[:, layout.FP8_SCALE_OFFSET : layout.FP8_ROPE_OFFSET] = scales.contiguous().view(torch.uint8)
    packed[:, layout.FP8_ROPE_OFFSET :] = rope.view(torch.uint8)
    return packed


def dequantize_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``fp8_ds_mla`` tokens to fp32 values (``value = fp8 * scale``, rope widened).

    packed: [..., 656], uint8 (any strides; the last dim need not be contiguous)
    returns: [..., 576], float32
    """
    if packed.dtype != torch.uint8 or packed.shape[-1] != layout.FP8_DS_MLA_TOKEN_BYTES:
        raise KernelInputError(
            format_error(
                given=f"packed dtype {packed.dtype}, shape {tuple(packed.shape)}",
                supported=f"torch.uint8 [..., {layout.FP8_DS_MLA_TOKEN_BYTES}]",
                fix="pass rows of the fp8_ds_mla cache",
            )
        )
    lead = packed.shape[:-1]
    values = torch.empty(*lead, layout.HEAD_DIM, dtype=torch.float32, device=packed.device)
    # Scales and rope are copied out (16 + 128 bytes a token) so the dtype views below never depend
    # on the caller's strides or storage-offset alignment; the 512 fp8 bytes are viewed in place.
    scales = packed[..., layout.FP8_SCALE_OFFSET : layout.FP8_ROPE_OFFSET].contiguous().view(torch.float32)
    rope = packed[..., layout.FP8_ROPE_OFFSET :].contiguous().view(torch.bfloat16)  # [..., 64]
    nope = packed[..., layout.FP8_NOPE_OFFSET : layout.FP8_SCALE_OFFSET].view(torch.float8_e4m3fn)
    tiles = (*lead, layout.FP8_NUM_TILES, layout.FP8_TILE)
    torch.mul(
        nope.float().reshape(tiles),  # [..., 4, 128]
        scales[..., None],  # [..., 4, 1]
        out=values[..., : layout.KV_LORA_RANK].unflatten(-1, tiles[-2:]),
    )
    values[..., layout.KV_LORA_RANK :].copy_(rope)
    return values  # [..., 576]


def pack_bf16(latent: torch.Tensor) -> torch.Tensor:
    """Pack tokens into the ``bf16`` layout (the 576 values, rounded to bfloat16).

    latent: [N, 576], bfloat16 or float32
    returns: [N, 576], bfloat16, contiguous
    """
    _check_latent(latent)
    return latent.to(torch.bfloat16).contiguous()


def token_width(kv_layout: str) -> int:
    """Last-dim size of a cache in ``kv_layout``: bytes for fp8_ds_mla, elements for bf16."""
    if kv_layout == layout.FP8_DS_MLA:
        return layout.FP8_DS_MLA_TOKEN_BYTES
    if kv_layout == layout.BF16:
        return layout.BF16_TOKEN_ELEMS
    raise KernelInputError(
        format_error(
            given=f"kv_layout={kv_layout!r}",
            supported=f"one of {layout.KV_LAYOUTS}",
            fix="pass 'fp8_ds_mla' for the 656-byte fp8 cache or 'bf16' for the 1152-byte cache",
        )
    )


def cache_dtype(kv_layout: str) -> torch.dtype:
    """Element dtype of a cache in ``kv_layout``."""
    token_width(kv_layout)  # validates the name
    return torch.uint8 if kv_layout == layout.FP8_DS_MLA else torch.bfloat16


def make_cache(
    num_pages: int,
    kv_layout: str,
    page_size: int = layout.PAGE_SIZE,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zero-filled paged cache (zero bytes decode to zero values in both layouts).

    returns: [num_pages, page_size, 656] uint8 (fp8_ds_mla) or [num_pages, page_size, 576] bfloat16
    """
    return torch.zeros(
        num_pages, page_size, token_width(kv_layout), dtype=cache_dtype(kv_layout), device=device
    )


def flat_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row per global slot.

    A 2-D cache is returned as is. A 3-D ``[pages, page_size, width]`` cache is returned as a
    *view* ``[pages * page_size, width]`` when its page stride equals ``page_size`` times its row
    stride (pages back to back, the usual case). A page-strided view (page stride larger than
    that, as vLLM's ``flat_kv_row_view`` can hand out) has no uniform slot stride, so no flat view
    of it exists: then this returns a contiguous *copy*, fine for reading, and writes to it do not
    reach the cache (use :func:`write_to_cache`, which handles both).

    kv_cache: [num_pages, page_size, width] or [num_slots, width], uint8 or bfloat16
    returns: [num_slots, width], same dtype
    """
    if kv_cache.dim() == 2:
        return kv_cache
    if kv_cache.dim() != 3:
        raise KernelInputError(
            format_error(
                given=f"kv_cache shape {tuple(kv_cache.shape)}",
                supported="[num_pages, page_size, width] or [num_slots, width]",
                fix="pass the layer's paged cache",
            )
        )
    pages, page_size, width = kv_cache.shape
    if kv_cache.stride(0) == page_size * kv_cache.stride(1):
        return kv_cache.as_strided((pages * page_size, width), (kv_cache.stride(1), kv_cache.stride(2)))
    return kv_cache.reshape(pages * page_size, width)  # copies: see the docstring


def page_view(rows: torch.Tensor, page_size: int = layout.PAGE_SIZE) -> torch.Tensor:
    """Rows of a cache as ``page_size``-row pages: the geometry every engine adapter passes the kernels.

    FlashInfer's SM120 kernels read 64-row pages only and read a 2-D tensor as one-row pages; the
    other kernels read any paged or flat cache. Slot ids do not change: row ``r`` is slot ``r`` of
    either view. vLLM's flat row view (blocks whole pages apart) and SGLang's ``[slots, 1, C]`` pool
    buffer both hold a whole number of 64-row pages.

    rows: [num_rows, width] with contiguous rows (row stride == width), num_rows % page_size == 0
    returns: [num_rows // page_size, page_size, width], a view of the same storage
    """
    if rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) != rows.shape[1] or rows.shape[0] % page_size:
        raise KernelInputError(
            format_error(
                given=f"cache rows {tuple(rows.shape)} with strides {tuple(rows.stride())}",
                supported=f"[num_rows, width] with back-to-back rows and num_rows a multiple of {page_size} "
                f"(whole {page_size}-row pages)",
                fix=f"allocate the cache in whole {page_size}-token pages (block sizes that are multiples of {page_size})",
            )
        )
    return rows.view(rows.shape[0] // page_size, page_size, rows.shape[1])


def write_to_cache(
    kv_cache: torch.Tensor,
    tokens: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int = layout.PAGE_SIZE,
) -> None:
    """Store packed tokens at global slots, in place; slot ``-1`` (vLLM's padding) is skipped.

    Works on page-strided views: it indexes ``(page, row)`` and never flattens the cache.

    kv_cache: [num_pages, page_size, width] or [num_slots, width], uint8 or bfloat16
    tokens: [N, width], the cache's dtype (from :func:`quantize_fp8_ds_mla` or :func:`pack_bf16`)
    slot_mapping: [N], any integer dtype, global slot ids
    """
    if tokens.dim() != 2 or tokens.shape[1] != kv_cache.shape[-1] or tokens.dtype != kv_cache.dtype:
        raise KernelInputError(
            format_error(
                given=f"tokens {tuple(tokens.shape)} {tokens.dtype}",
                supported=f"[N, {kv_cache.shape[-1]}] {kv_cache.dtype} (the cache's row and dtype)",
                fix="pack tokens with quantize_fp8_ds_mla or pack_bf16 for this cache's layout",
            )
        )
    if slot_mapping.shape != (tokens.shape[0],):
        raise KernelInputError(
            format_error(
                given=f"slot_mapping shape {tuple(slot_mapping.shape)}",
                supported=f"[{tokens.shape[0]}] (one slot per token)",
                fix="pass one global slot id per token",
            )
        )
    if kv_cache.dim() == 3 and kv_cache.shape[1] != page_size:
        raise KernelInputError(
            format_error(
                given=f"page_size={page_size} with kv_cache shape {tuple(kv_cache.shape)}",
                supported="page_size == kv_cache.shape[1]",
                fix=f"pass page_size={kv_cache.shape[1]}",
            )
        )
    num_slots = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    keep = slots >= 0
    slots, tokens = slots[keep], tokens.to(kv_cache.device)[keep]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise KernelInputError(
            format_error(
                given=f"slot_mapping max {int(slots.max())}",
                supported=f"slots in [0, {num_slots}) or -1 for padding",
                fix="allocate more pages or fix the slot mapping",
            )
        )
    if kv_cache.dim() == 2:
        kv_cache[slots] = tokens
    else:
        kv_cache[slots // page_size, slots % page_size] = tokens
