"""Pack, unpack and store KV-cache tokens in the layouts of :mod:`.layout` (torch).

The byte layout itself is described once, in :mod:`mla_sm120_plugin.kernels.dsa.layout`, as data
(:class:`~mla_sm120_plugin.kernels.dsa.layout.CacheLayout`); this module only moves values into and out
of those bytes, for every layout, driven by that data: :func:`pack` and :func:`dequantize`. It is
the writer the tests and benchmarks use, and the dequantizer the torch reference uses.

Global slot ids are ``page * page_size + row``, the same ids ``indices`` carries.
"""

from __future__ import annotations

import torch

from mla_sm120_plugin.errors import KernelInputError, format_error
from mla_sm120_plugin.kernels.dsa import layout, nvfp4

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


def describe(kv_layout: str) -> str:
    """One layout in words, from its data: ``fp8_nope (528 B: 512 fp8 latent + 4 fp32 scales, no rope)``."""
    lay = layout.LAYOUTS[kv_layout]
    if lay.nvfp4:
        parts = (f"{lay.latent} e2m1 latent + {lay.rope} e4m3 rope + {lay.num_scales} e4m3 scales, "
                 f"one per {lay.latent_format.block}")
    elif lay.fp8:
        parts = f"{lay.latent} fp8 latent + {lay.latent // layout.FP8_TILE} fp32 scales"
        parts += f" + {lay.rope} bf16 rope" if lay.rope else ", no rope"
        if lay.row > lay.used:
            parts += f", {lay.row - lay.used} reserved"
    else:
        parts = f"{lay.row} x bf16: {lay.latent} latent" + (f" + {lay.rope} rope" if lay.rope else ", no rope")
    return f"{lay.name} ({lay.token_bytes} B: {parts})"


def describe_all() -> str:
    """Every layout in words (what an error's ``fix`` lists)."""
    return "; ".join(describe(name) for name in layout.KV_LAYOUTS)


def get_layout(kv_layout: object) -> layout.CacheLayout:
    """The :class:`~.layout.CacheLayout` called ``kv_layout``.

    :raises KernelInputError: naming every known layout.
    """
    lay = layout.LAYOUTS.get(kv_layout) if isinstance(kv_layout, str) else None
    if lay is None:
        raise KernelInputError(
            format_error(
                given=f"kv_layout={kv_layout!r}",
                supported=f"one of {layout.KV_LAYOUTS}",
                fix=f"pass the layout the cache is written in: {describe_all()}",
            )
        )
    return lay


def _check_latent(latent: torch.Tensor, lay: layout.CacheLayout) -> None:
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2 or latent.shape[1] != lay.head_dim:
        shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        rope = f"{lay.latent} latent + {lay.rope} rope" if lay.rope else f"{lay.latent} latent, no rope"
        raise KernelInputError(
            format_error(
                given=f"latent shape {shape} for kv_layout={lay.name!r}",
                supported=f"[N, {lay.head_dim}] ({rope})",
                fix="pass one row per token: the latent, then the rope where the layout has one",
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


def pack(latent: torch.Tensor, kv_layout: str, scale_format: str | None = None) -> torch.Tensor:
    """Pack tokens into the rows of ``kv_layout`` (any layout of :data:`.layout.LAYOUTS`).

    fp8 layouts: each 128-wide latent tile gets one fp32 scale, stored right after the latent:
    ``pow2`` stores ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` (DeepSeek-V3.2), ``arbitrary``
    stores ``amax / 448`` (GLM), and :data:`ZERO_TILE_SCALE` for an all-zero tile. The stored fp8
    value is ``clamp(x / scale, -448, 448)`` rounded to nearest by torch. A rope part, where the
    layout has one, is stored as raw bfloat16 bytes (an fp32 input is rounded to bfloat16 first).
    bf16 layouts: the values rounded to bfloat16. Bytes a row reserves (``fp8_ds_mla_nope``'s
    [528, 656)) are written as zeros. Non-finite inputs give non-finite scales; they are not checked.

    latent: [N, layout.head_dim], bfloat16 or float32 (the latent, then the rope if any)
    nvfp4 layout: vLLM's writer, bit for bit (:func:`.nvfp4.pack_rows`); its scale format is fixed.

    scale_format: "pow2" or "arbitrary"; required for fp8 layouts, ignored for nvfp4 and bf16 ones
    returns: [N, layout.row], uint8 (fp8 layouts) or bfloat16, contiguous
    """
    lay = get_layout(kv_layout)
    _check_latent(latent, lay)
    n = latent.shape[0]
    if lay.nvfp4:
        return nvfp4.pack_rows(latent, lay)
    if not lay.fp8:
        rows = torch.zeros(n, lay.row, dtype=torch.bfloat16, device=latent.device)  # [N, row]
        rows[:, : lay.head_dim] = latent.to(torch.bfloat16)
        return rows
    tiles = lay.latent // layout.FP8_TILE
    x = latent.float()
    nope = x[:, : lay.latent].reshape(n, tiles, layout.FP8_TILE)  # [N, 4, 128]
    amax = nope.abs().amax(dim=-1)  # [N, 4]
    scales = _tile_scales(amax, scale_format)  # [N, 4] fp32
    scaled = (nope / scales[:, :, None]).clamp(-layout.FP8_E4M3_MAX, layout.FP8_E4M3_MAX)  # [N, 4, 128]
    fp8 = scaled.to(torch.float8_e4m3fn).reshape(n, lay.latent)  # [N, 512]

    packed = torch.zeros(n, lay.row, dtype=torch.uint8, device=latent.device)  # [N, row]; reserved bytes stay 0
    packed[:, : lay.latent] = fp8.view(torch.uint8)
    packed[:, lay.scale_offset : lay.scale_offset + 4 * tiles] = scales.contiguous().view(torch.uint8)
    if lay.rope:
        rope = latent[:, lay.latent :].to(torch.bfloat16).contiguous()  # [N, rope]
        packed[:, lay.rope_offset : lay.used] = rope.view(torch.uint8)
    return packed


def dequantize(rows: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """Cached rows of ``kv_layout`` as fp32 values: ``fp8 * scale`` for the latent of fp8 layouts,
    ``e2m1 * e4m3 block scale`` for nvfp4 (exact in fp32); the rope (if any) and bf16 values widened;
    reserved bytes are never read.

    rows: [..., layout.row], uint8 (fp8 and nvfp4 layouts) or bfloat16 (any strides; the last dim need not be
        contiguous)
    returns: [..., layout.head_dim], float32
    """
    lay = get_layout(kv_layout)
    if rows.dtype != cache_dtype(kv_layout) or rows.shape[-1] != lay.row:
        raise KernelInputError(
            format_error(
                given=f"rows dtype {rows.dtype}, shape {tuple(rows.shape)} for kv_layout={kv_layout!r}",
                supported=f"{cache_dtype(kv_layout)} [..., {lay.row}]",
                fix=f"pass rows of the {kv_layout} cache, or the kv_layout they were written in",
            )
        )
    if not lay.quantized:
        return rows[..., : lay.head_dim].float()  # [..., head_dim]
    if lay.nvfp4:
        return nvfp4.dequantize_rows(rows, lay)
    lead = rows.shape[:-1]
    tiles = lay.latent // layout.FP8_TILE
    values = torch.empty(*lead, lay.head_dim, dtype=torch.float32, device=rows.device)  # [..., head_dim]
    # Scales and rope are copied out (16 + 2 * rope bytes a token) so the dtype views below never
    # depend on the caller's strides or storage-offset alignment; the fp8 bytes are viewed in place.
    scales = rows[..., lay.scale_offset : lay.scale_offset + 4 * tiles].contiguous().view(torch.float32)  # [..., 4]
    nope = rows[..., : lay.latent].view(torch.float8_e4m3fn)  # [..., 512]
    shape = (*lead, tiles, layout.FP8_TILE)
    torch.mul(
        nope.float().reshape(shape),  # [..., 4, 128]
        scales[..., None],  # [..., 4, 1]
        out=values[..., : lay.latent].unflatten(-1, shape[-2:]),
    )
    if lay.rope:
        values[..., lay.latent :].copy_(rows[..., lay.rope_offset : lay.used].contiguous().view(torch.bfloat16))
    return values


def quantize_fp8_ds_mla(latent: torch.Tensor, scale_format: str) -> torch.Tensor:
    """:func:`pack` into ``fp8_ds_mla`` (656 bytes a token).

    latent: [N, 576], bfloat16 or float32 (512 latent then 64 rope)
    returns: [N, 656], uint8
    """
    return pack(latent, layout.FP8_DS_MLA, scale_format)


def dequantize_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` of ``fp8_ds_mla`` rows.

    packed: [..., 656], uint8 (any strides; the last dim need not be contiguous)
    returns: [..., 576], float32
    """
    return dequantize(packed, layout.FP8_DS_MLA)


def pack_bf16(latent: torch.Tensor) -> torch.Tensor:
    """:func:`pack` into ``bf16`` (the 576 values, rounded to bfloat16).

    latent: [N, 576], bfloat16 or float32
    returns: [N, 576], bfloat16, contiguous
    """
    return pack(latent, layout.BF16)


_TORCH_DTYPES = {layout.UINT8: torch.uint8, layout.BFLOAT16: torch.bfloat16}


def token_width(kv_layout: str) -> int:
    """Last-dim size of a cache in ``kv_layout``: bytes for uint8 layouts, elements for bf16 ones."""
    return get_layout(kv_layout).row


def cache_dtype(kv_layout: str) -> torch.dtype:
    """Element dtype of a cache in ``kv_layout``."""
    return _TORCH_DTYPES[get_layout(kv_layout).element]


def make_cache(
    num_pages: int,
    kv_layout: str,
    page_size: int = layout.PAGE_SIZE,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zero-filled paged cache (zero bytes decode to zero values in every layout).

    returns: [num_pages, page_size, layout.row], uint8 (fp8 layouts) or bfloat16
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
    tokens: [N, width], the cache's dtype (from :func:`pack`)
    slot_mapping: [N], any integer dtype, global slot ids
    """
    if tokens.dim() != 2 or tokens.shape[1] != kv_cache.shape[-1] or tokens.dtype != kv_cache.dtype:
        raise KernelInputError(
            format_error(
                given=f"tokens {tuple(tokens.shape)} {tokens.dtype}",
                supported=f"[N, {kv_cache.shape[-1]}] {kv_cache.dtype} (the cache's row and dtype)",
                fix="pack tokens with pack(latent, kv_layout, scale_format) for this cache's layout",
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
