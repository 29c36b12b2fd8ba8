"""GLM-5.3-Flash's rope-less sparse-MLA layouts, end to end on the test device (CPU: interpreter).

``fp8_ds_mla_nope`` (vLLM: 656-byte rows, [528, 656) reserved zeros), ``fp8_nope`` (SGLang: packed
528-byte rows) and ``bf16_nope`` (512 x bf16): q and keys are the 512-wide latent, V the latent.

Ground truth is tests/support/layout_oracle.py: the packer's bytes are read back by its independent decoder
(struct and integer arithmetic), and every kernel - the torch reference, the exact Triton kernel,
the fast fp8 one - is compared with float64 attention over the keys that decoder reads from the
cache bytes. Cases are the engines': vLLM's 2176-wide -1-padded index rows (round_up(2048 + 3,
128)) and SGLang's 2051-wide ones, page sizes 64 and 256, page-strided and flat caches, pow2- and
arbitrary-written scales, the GLM-5.3-Flash softmax scale (256 ** -0.5, not 512 ** -0.5), heads
per rank 8 / 16 / 32 / 64, and adversarial ids (-1, out of range, duplicates, a short topk_length).
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from support import layout_oracle
from support.cli import assert_three_parts, clean_env
from support.kernel_checks import BF16_ULP, DEVICE, KERNEL_REL_TOL, ON_GPU, scaled_atol
from support.oracle import sparse_attention
from mla_sm120_plugin.errors import KernelInputError
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin import sparse_mla_forward
from mla_sm120_plugin.kernels.dsa import triton as tk
from mla_sm120_plugin.kernels.dsa import triton_fast as tf
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla
from test_reference import REF_REL_TOL  # the reference's own tolerance against float64

NOPE_FP8 = ("fp8_ds_mla_nope", "fp8_nope")
NOPE = (*NOPE_FP8, "bf16_nope")
GLM53_SM_SCALE = 256**-0.5  # (qk_nope 256)^-0.5: passed by the engine, never recomputed from 512
TILE = 128


def test_the_layouts_are_the_bytes_the_oracle_reads():
    """layout.py's data against the oracle's own table (docs/facts.md, DSA and rope-less layouts): row bytes, rope, fp8."""
    for name, (row_bytes, rope, fp8) in layout_oracle.ROWS.items():
        lay = layout.get(name)
        assert (lay.token_bytes, lay.rope, lay.fp8, lay.latent, lay.head_dim) == (row_bytes, rope, fp8, 512, 512 + rope)
    assert set(layout.KV_LAYOUTS) == set(layout_oracle.ROWS)


def test_the_public_docstring_table_is_the_layout_data():
    """sparse_mla_forward's docstring states D and the row per layout: they are layout.py's."""
    from mla_sm120_plugin.dispatch import forward

    rows = [line.split() for line in forward.sparse_mla_forward.__doc__.splitlines()
            if line.strip().startswith('"') and line.split()[1].isdigit()]
    stated = {cols[0].strip('"'): (int(cols[1]), int(cols[2])) for cols in rows}
    assert stated == {name: (lay.head_dim, lay.row) for name, lay in layout.LAYOUTS.items()}


# --- The packer's bytes --------------------------------------------------------------------------


def _latent(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 512] bf16: tile i of row r scaled by 4**i * 10**(r % 5 - 2) (scales over many octaves)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=gen)
    x *= (4.0 ** torch.arange(4)).repeat_interleave(TILE) * (10.0 ** (torch.arange(n) % 5 - 2))[:, None]
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize("kv_layout", NOPE_FP8)
def test_fp8_rows_are_latent_bytes_scales_and_reserved_zeros(kv_layout, scale_format):
    """Each byte where docs/facts.md#rope-less-layouts-glm-53-flash puts it: the e4m3 nearest to x / its tile's scale at [0, 512), the
    four scales (amax / 448, or the smallest power of two >= it) at [512, 528), then nothing
    (fp8_nope) or 128 zero bytes (fp8_ds_mla_nope), even over a cache full of garbage."""
    latent = _latent(5)
    latent[2, TILE : 2 * TILE] = 0  # an all-zero tile
    rows = pack.pack(latent, kv_layout, scale_format)
    width = layout_oracle.ROWS[kv_layout][0]
    assert rows.dtype == torch.uint8 and rows.shape == (5, width) and rows.is_contiguous()
    cache = torch.full((1, 8, width), 0xAB, dtype=torch.uint8)  # garbage the rows must overwrite whole
    pack.write_to_cache(cache, rows, torch.tensor([0, 1, 2, 3, 4]), page_size=8)
    for r, row in enumerate(layout_oracle.raw_rows(cache[0, :5])):
        assert len(row) == width
        scales = struct.unpack("<4f", row[512:528])
        for t in range(4):
            amax = numpy.float32(latent[r, t * TILE:(t + 1) * TILE].float().abs().max().item())
            ratio = float(amax / numpy.float32(448.0))
            if scale_format == layout.SCALE_ARBITRARY:
                assert scales[t] == (ratio if amax > 0 else 1.0), (r, t)
            else:
                floor = max(ratio, 1e-4)
                assert math.log2(scales[t]).is_integer() and scales[t] >= floor > scales[t] / 2, (r, t)
        for i in range(512):
            quotient = float(numpy.float32(float(latent[r, i])) / numpy.float32(scales[i // TILE]))
            assert layout_oracle.e4m3fn(row[i]) == layout_oracle.nearest_e4m3(quotient), (r, i)
        assert layout_oracle.reserved_bytes(row, kv_layout) == bytes(width - 528)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_the_three_fp8_rows_share_their_first_528_bytes(scale_format):
    """SGLang's 528-byte row is vLLM's rope-less 656-byte row without the reserved tail, and both
    are the DSA row's first 528 bytes for the same latent (the rope comes after them)."""
    latent = _latent(6, seed=1)
    rope = torch.randn(6, 64).to(torch.bfloat16)
    dsa = pack.pack(torch.cat([latent, rope], dim=1), layout.FP8_DS_MLA, scale_format)
    vllm = pack.pack(latent, "fp8_ds_mla_nope", scale_format)
    sglang = pack.pack(latent, "fp8_nope", scale_format)
    assert torch.equal(vllm[:, :528], dsa[:, :528]) and torch.equal(sglang, vllm[:, :528])
    assert torch.all(vllm[:, 528:] == 0)


def test_bf16_nope_rows_are_the_latent_in_bf16():
    latent = torch.randn(4, 512)
    rows = pack.pack(latent, "bf16_nope")
    assert rows.dtype == torch.bfloat16 and rows.shape == (4, 512)
    assert torch.equal(rows.view(torch.int16), latent.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(layout_oracle.decode_cache(rows, "bf16_nope"), latent.to(torch.bfloat16).double())


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize("kv_layout", NOPE)
def test_round_trip_against_the_oracle(kv_layout, scale_format):
    """dequantize(pack(x)) is what the oracle reads from the bytes (float64; the fp32 product rounds
    once), within e4m3's rounding of x (2**-4 relative, half a subnormal step absolute), and the
    same through a paged view."""
    latent = _latent(20, seed=2)
    rows = pack.pack(latent, kv_layout, scale_format)
    back = pack.dequantize(rows, kv_layout)
    assert back.dtype == torch.float32 and back.shape == (20, 512)
    decoded = layout_oracle.decode_cache(rows, kv_layout)
    torch.testing.assert_close(back.double(), decoded, rtol=2.0**-24, atol=0)
    x = latent.double()
    if layout.get(kv_layout).fp8:
        scales = torch.tensor([struct.unpack("<4f", row[512:528]) for row in layout_oracle.raw_rows(rows)],
                              dtype=torch.float64).repeat_interleave(TILE, dim=1)
        assert torch.all((decoded - x).abs() <= (2.0**-4 * x.abs() + 2.0**-10 * scales) * (1 + 1e-6))
    else:
        assert torch.equal(decoded, x)
    assert torch.equal(pack.dequantize(rows.view(4, 5, -1), kv_layout).view(20, -1), back)


def test_pack_and_dequantize_refuse_the_wrong_width():
    with pytest.raises(KernelInputError, match=r"(?s)given: latent shape \(2, 576\) for kv_layout='fp8_nope'.*"
                                               r"supported: \[N, 512\]"):
        pack.pack(torch.zeros(2, 576), "fp8_nope", "arbitrary")
    with pytest.raises(KernelInputError, match="scale_format"):
        pack.pack(torch.zeros(2, 512), "fp8_ds_mla_nope")  # fp8 rows need a scale format
    with pytest.raises(KernelInputError, match=r"supported: torch.uint8 \[\.\.\., 528\]"):
        pack.dequantize(torch.zeros(2, 656, dtype=torch.uint8), "fp8_nope")
    with pytest.raises(KernelInputError, match="kv_layout='fp8_e4m3'") as err:
        pack.make_cache(1, "fp8_e4m3")
    assert all(name in str(err.value) for name in layout.KV_LAYOUTS)


# --- Kernels against float64 attention over the bytes --------------------------------------------


def _exact(case, path, **kw):
    return tk._run(case["q"], case["kv_cache"], case["indices"], config=_config(plan.EXACT, path, case), **kw)


def _fast(case, path, **kw):
    return tf._run(case["q"], case["kv_cache"], case["indices"], config=_config(plan.FAST, path, case), **kw)


def _reference(case, path, **kw):
    return torch_sparse_mla(case["q"], case["kv_cache"], case["indices"], **kw)


KERNELS = {"reference": (_reference, REF_REL_TOL), "exact": (_exact, KERNEL_REL_TOL), "fast": (_fast, tf.TOLERANCE)}


def _config(shape: plan.KernelShape, path: str | None, case) -> plan.LaunchConfig | None:
    """None: the table's config; "decode": every step its own split; "prefill": one split."""
    if path is None:
        return None
    blocks = -(-case["indices"].shape[1] // shape.block_k)
    return shape.config(blocks, 1) if path == "decode" else shape.config(1, blocks)


def glm53_case(make_case, kv_layout, *, heads, tokens, width, valid, page_size, scale_format, seed, num_pages=6, page_pad=0,
               flat=False, q_dtype=torch.bfloat16):
    """The engines' inputs for one GLM-5.3-Flash sparse layer: [T, H, 512] q; a cache of 512-wide
    latent tokens (tiles of different gains, so a wrong per-tile scale shows) in ``kv_layout``,
    paged (``page_pad``: a page-strided view, pages that many bytes further apart) or flat; index
    rows ``width`` wide with ``valid`` token slots then -1 padding. Token 0 leads with -1, the first
    slot past the cache, one far past it and int32 max, then a run of one slot four times."""
    case = make_case(kv_layout=kv_layout, num_pages=num_pages, num_tokens=tokens, num_heads=heads, topk=width,
                      page_size=page_size, scale_format=scale_format, page_pad=page_pad, invalid_fraction=0.0,
                      q_dtype=q_dtype, seed=seed, device="cpu")
    indices = case.indices.clone()
    indices[:, valid:] = -1
    num_slots = case.num_slots
    indices[0, :4] = torch.tensor([-1, num_slots, num_slots + 1000, 2**31 - 1], dtype=torch.int32)
    indices[0, 4:8] = indices[0, 8]
    kv_cache = case.kv_cache
    if flat:
        kv_cache = pack.flat_view(kv_cache)
        assert kv_cache.dim() == 2
    return dict(q=case.q.to(DEVICE), kv_cache=_to_device(kv_cache), indices=indices.to(DEVICE), kv_layout=kv_layout,
                sm_scale=GLM53_SM_SCALE)


def _to_device(view: torch.Tensor) -> torch.Tensor:
    if DEVICE == "cpu":
        return view
    storage = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage()).to(DEVICE)
    return storage.as_strided(view.shape, view.stride(), view.storage_offset())


def _truth(case, topk_length=None, sink=None):
    """The oracle's (out, natural-log lse without the sink) over the rows the bytes hold."""
    keys = layout_oracle.decode_cache(case["kv_cache"], case["kv_layout"])  # [S, 512] float64 from the bytes
    return sparse_attention(case["q"], keys, case["indices"], case["sm_scale"], topk_length=topk_length, sink=sink)


def assert_matches_float64(got, want, rel: float) -> None:
    """``got`` (out, lse) within ``rel`` of the float64 result's magnitude, plus one bf16 ulp for a
    bf16 out (its own rounding)."""
    (out, lse), (want_out, want_lse) = got, want
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    rtol = BF16_ULP if out.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.cpu().double(), want_out, atol=scaled_atol(want_out, rel), rtol=rtol)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse)), "empty rows: lse -inf exactly there"
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], want_lse[finite], atol=scaled_atol(want_lse, rel), rtol=0)


def _run(kernel: str, case, path, topk_length=None, sink=None):
    fn, rel = KERNELS[kernel]
    got = fn(case, path, sm_scale=case["sm_scale"], kv_layout=case["kv_layout"], topk_length=topk_length, sink=sink,
             out=None, return_lse=True, lse_base="e")
    return got, rel


# (kv_layout, heads, tokens, width, valid, page_size, scale_format, page_pad, flat, path)
WIDE = {
    # vLLM: 656-byte rows as 64-row pages of a page-strided view, 2176-wide rows (2051 valid),
    # arbitrary-written scales, 16 heads (TP4), the table's own split config.
    "vllm_tp4_2176": ("fp8_ds_mla_nope", 16, 1, 2176, 2051, 64, "arbitrary", 48, False, None),
    # SGLang: packed 528-byte rows, flat, 2051 wide (its logical 256-token pages are slots here),
    # pow2-written scales, 8 heads (TP8), one split (its prefill path).
    "sglang_tp8_2051": ("fp8_nope", 8, 1, 2051, 2051, 256, "pow2", 0, True, "prefill"),
}
NARROW = {
    # 32 heads (TP2), 256-row pages, pow2 scales, the most splits the combine can see.
    "tp2_page256": ("fp8_ds_mla_nope", 32, 2, 160, 140, 256, "pow2", 0, False, "decode"),
    # 64 heads (TP1), one token: four head blocks; SGLang rows as 64-row pages.
    "tp1_fp8_nope": ("fp8_nope", 64, 1, 96, 90, 64, "arbitrary", 48, False, "prefill"),
    # bf16 rope-less rows (the exact kernel; the fast one hands bf16 to it).
    "bf16_nope": ("bf16_nope", 16, 3, 150, 120, 64, "arbitrary", 48, False, "decode"),
}


def _build(make_case, spec, seed):
    kv_layout, heads, tokens, width, valid, page_size, scale_format, page_pad, flat, path = spec
    num_pages = 4 if page_size == 256 else 10
    case = glm53_case(make_case, kv_layout, heads=heads, tokens=tokens, width=width, valid=valid, page_size=page_size,
                      scale_format=scale_format, seed=seed, num_pages=num_pages, page_pad=page_pad, flat=flat)
    return case, path


def _kernels_for(kv_layout):
    return ["reference", "exact", "fast"] if layout.get(kv_layout).fp8 else ["reference", "exact"]


@pytest.mark.parametrize("name", list(WIDE))
def test_engine_index_widths_match_float64(make_case, name):
    """Top-k 2176 (vLLM) and 2051 (SGLang) with -1 padding and the adversarial lead of token 0: every
    kernel within its tolerance of float64 attention over the bytes."""
    case, path = _build(make_case, WIDE[name], seed=11)
    want = _truth(case)
    for kernel in _kernels_for(case["kv_layout"]):
        got, rel = _run(kernel, case, path)
        assert_matches_float64(got, want, rel)


@pytest.mark.parametrize("name", list(NARROW))
def test_heads_pages_and_short_lengths_match_float64(make_case, name):
    """8-64 heads, page sizes 64 and 256, paged / page-strided / flat, both scale formats, a short
    topk_length (token 1) and a sink: every kernel within its tolerance of float64."""
    case, path = _build(make_case, NARROW[name], seed=5)
    tokens, heads = case["q"].shape[:2]
    lengths = torch.full((tokens,), case["indices"].shape[1], dtype=torch.int32, device=DEVICE)
    if tokens > 1:
        lengths[1] = 33  # cuts a block in two
    sink = torch.linspace(-1.0, 2.0, heads, device=DEVICE)
    want = _truth(case, lengths, sink)
    for kernel in _kernels_for(case["kv_layout"]):
        got, rel = _run(kernel, case, path, topk_length=lengths, sink=sink)
        assert_matches_float64(got, want, rel)


def test_empty_rows_give_zero_and_minus_inf(make_case):
    case = glm53_case(make_case, "fp8_nope", heads=8, tokens=3, width=70, valid=70, page_size=64, scale_format="arbitrary",
                      seed=3, num_pages=2)
    case["indices"][1] = -1
    case["indices"][2, :] = 2**31 - 1
    want = _truth(case)
    for kernel in _kernels_for("fp8_nope"):
        (out, lse), rel = _run(kernel, case, "decode")
        assert torch.all(out[1:].cpu() == 0) and torch.all(lse[1:].cpu() == -math.inf), kernel
        assert_matches_float64((out, lse), want, rel)


@pytest.mark.parametrize("kernel", ["reference", "exact", "fast"])
def test_reserved_bytes_are_never_read(make_case, kernel):
    """NaN in every row's reserved bytes [528, 656) changes nothing (a kernel that read the rope of a
    DSA row there would turn the output into NaN)."""
    case = glm53_case(make_case, "fp8_ds_mla_nope", heads=16, tokens=2, width=64, valid=60, page_size=64,
                      scale_format="arbitrary", seed=4, num_pages=2)
    clean, _ = _run(kernel, case, "prefill")
    case["kv_cache"][..., 528:] = 0xFF
    dirty, _ = _run(kernel, case, "prefill")
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_fast_hands_bf16_nope_to_the_exact_kernel(make_case):
    case = glm53_case(make_case, "bf16_nope", heads=8, tokens=2, width=40, valid=40, page_size=64, scale_format="arbitrary",
                      seed=6, num_pages=2)
    fast, _ = _run("fast", case, "prefill")
    exact, _ = _run("exact", case, "prefill")
    assert torch.equal(fast[0], exact[0]) and torch.equal(fast[1], exact[1])


def test_the_fast_tolerance_still_catches_a_wrong_scale(make_case):
    """What 0.15 must catch on a rope-less cache: every tile read with tile 0's scale."""
    case = glm53_case(make_case, "fp8_nope", heads=16, tokens=2, width=100, valid=100, page_size=64, scale_format="arbitrary",
                      seed=8, num_pages=2)
    want = _truth(case)
    rows = case["kv_cache"].reshape(-1, 528)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    rows[:, 512:528] = scales[:, :1].expand(-1, 4).contiguous().view(torch.uint8)
    got, _ = _run("fast", case, "prefill")
    with pytest.raises(AssertionError):
        assert_matches_float64(got, want, tf.TOLERANCE)


# --- The public entry -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_layout", NOPE)
def test_public_entry_serves_every_nope_layout(make_case, kv_layout):
    """sparse_mla_forward with kernel="auto" (the selection's choice on this device), and the exact
    Triton kernel by name, on a rope-less case."""
    case = glm53_case(make_case, kv_layout, heads=8, tokens=2, width=40, valid=36, page_size=64, scale_format="pow2", seed=9,
                      num_pages=2)
    want = _truth(case)
    for kernel in ("auto", "triton_sparse_mla"):
        out, lse = sparse_mla_forward(case["q"], case["kv_cache"], case["indices"], sm_scale=case["sm_scale"],
                                      kv_layout=kv_layout, kernel=kernel, return_lse=True)
        assert out.shape == (2, 8, 512)
        rel = tf.TOLERANCE if kernel == "auto" and layout.get(kv_layout).fp8 else KERNEL_REL_TOL
        assert_matches_float64((out, lse), want, rel)


def test_catalog_lists_the_layouts_each_kernel_reads():
    """The exact Triton kernel and the reference read every layout; the fast kernel every fp8 one
    (it hands bf16 to the exact kernel, which the registry need not know)."""
    from mla_sm120_plugin.dispatch import catalog

    assert catalog.TRITON_SPEC.kv_cache_dtypes == frozenset(layout.KV_LAYOUTS)
    assert catalog.TORCH_SPEC.kv_cache_dtypes == frozenset(layout.KV_LAYOUTS)
    assert catalog.TRITON_FAST_SPEC.kv_cache_dtypes == frozenset(layout.FP8_LAYOUTS)


REFUSED = {
    # what, argument, make(q, cache) -> (q, cache, kv_layout), a phrase of the fix
    "576-wide q for a rope-less cache": ("q", lambda q, c: (torch.zeros(*q.shape[:2], 576, dtype=q.dtype), c, "fp8_nope"),
                                         "fp8_ds_mla / nvfp4_ds_mla / bf16 take a 576-wide q"),
    "512-wide q for the DSA layout": ("q", lambda q, c: (q, torch.zeros(2, 64, 656, dtype=torch.uint8), "fp8_ds_mla"),
                                      "fp8_ds_mla_nope / fp8_nope / bf16_nope take a 512-wide q"),
    "656-byte rows named fp8_nope": ("kv_cache", lambda q, c: (q, torch.zeros(2, 64, 656, dtype=torch.uint8), "fp8_nope"),
                                     "are 'fp8_ds_mla' or 'fp8_ds_mla_nope'"),
    "528-byte rows named fp8_ds_mla_nope": ("kv_cache", lambda q, c: (q, c, "fp8_ds_mla_nope"), "are 'fp8_nope'"),
    "bf16 rows of 576 named bf16_nope": ("kv_cache", lambda q, c: (q, torch.zeros(2, 64, 576, dtype=torch.bfloat16),
                                                                   "bf16_nope"), "are 'bf16'"),
    "uint8 rows of 576 named bf16": ("kv_cache", lambda q, c: (torch.zeros(*q.shape[:2], 576, dtype=q.dtype),
                                                               torch.zeros(2, 64, 576, dtype=torch.uint8), "bf16"),
                                     "in kv_layout='bf16': bf16 (1152 B"),
    "misaligned 528-byte rows": ("kv_cache", lambda q, c: (q, torch.zeros(2 * 64 * 528 + 2, dtype=torch.uint8)[2:].view(
        2, 64, 528), "fp8_nope"), "aligned view"),
    "unknown layout": ("kv_layout", lambda q, c: (q, c, "fp8_e4m3"), "fp8_nope (528 B"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_wrong_widths_are_refused_with_the_layout_they_fit(what):
    argument, make, phrase = REFUSED[what]
    q = torch.randn(2, 4, 512, dtype=torch.bfloat16)
    cache = pack.make_cache(2, "fp8_nope")
    q, cache, kv_layout = make(q, cache)
    with pytest.raises(KernelInputError) as err:
        sparse_mla_forward(q, cache, torch.zeros(2, 8, dtype=torch.int32), sm_scale=GLM53_SM_SCALE,
                           kv_layout=kv_layout, kernel="torch_sparse_mla")
    assert_three_parts(str(err.value), f"{argument}=")
    assert phrase in str(err.value), str(err.value)


# --- No read past any storage, the memory bound -------------------------------------------------


@pytest.mark.skipif(ON_GPU, reason="guard pages protect host memory: the CPU (interpreter) run checks them")
def test_no_read_past_a_packed_528_byte_cache():
    """SGLang's 528-byte rows end where the storage ends: a kernel that read a rope or the 656-byte
    row's tail past the last slot would fault against the guard page (both kernels, one split and
    four, every input guarded: tests/kernels/guarded_call.py, one child process)."""
    script = Path(__file__).with_name("guarded_call.py")
    done = subprocess.run([sys.executable, str(script), "exact,fast", "fp8_nope", "1,4"], capture_output=True,
                          text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, f"rc={done.returncode} (-11 is SIGSEGV): {done.stderr[-2000:]}"


@pytest.mark.parametrize("kv_layout", NOPE)
def test_reference_memory_stays_under_its_bound(make_case, kv_layout):
    """The reference's bound is per layout (raw row, head_dim-wide fp32 keys): measured against it."""
    from cpu_memory import LiveTensorPeak  # benchmarks/ is on pytest's pythonpath

    from mla_sm120_plugin.kernels.dsa.reference import bytes_per_token

    case = glm53_case(make_case, kv_layout, heads=16, tokens=12, width=256, valid=256, page_size=64, scale_format="pow2",
                      seed=10, num_pages=4)
    q, cache, indices = (case[k].cpu() for k in ("q", "kv_cache", "indices"))
    out = torch.empty(12, 16, 512, dtype=torch.bfloat16)
    per_token = bytes_per_token(16, 256, kv_layout)
    lay = layout.get(kv_layout)
    assert per_token >= 256 * (lay.token_bytes + 2 * 4 * lay.head_dim)  # raw rows + the fp32 keys, at least
    with LiveTensorPeak([q, cache, indices, out]) as mode:
        torch_sparse_mla(q, cache, indices, sm_scale=GLM53_SM_SCALE, kv_layout=kv_layout, out=out,
                         max_chunk_bytes=3 * per_token)
    assert mode.peak <= 3 * per_token + 12 * 16 * 4  # + the [T, H] lse buffer
