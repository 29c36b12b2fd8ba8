"""FlashInfer's native SM120/SM121 sparse MLA against the torch reference, on the GPU.

Runs only on an SM12x GPU (RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark) where the binding's probe
passes: ``flashinfer-python>=0.7.2.post1`` plus nvcc >= 12.8 (sm_120) / 12.9 (sm_121) or
``flashinfer-jit-cache``. The first call JIT-compiles FlashInfer's module (minutes).

Tolerance: FlashInfer quantises Q and P to fp8 inside the kernel; its upstream tests use
atol = rtol = 5e-3 for the output (docs/facts.md#flashinfer-sm120-sparse-mla). The LSE bound below is ours, looser, not yet measured
on hardware: tighten it from the first run's numbers.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 12:
        return f"GPU is sm_{major}{minor}, not SM12x"
    try:
        from mla_sm120_plugin.dispatch.flashinfer import probe
    except ImportError as error:
        return f"binding import failed: {error}"
    reasons = probe()
    return "; ".join(reasons) if reasons else None


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(
    _REASON is not None,
    reason=f"needs an SM120/SM121 GPU with flashinfer-python>=0.7.2.post1 and nvcc>=12.8 or flashinfer-jit-cache "
    f"(run `pytest tests/gpu/test_flashinfer_sm120.py` on an RTX 50xx / RTX PRO 6000 / DGX Spark); here: {_REASON}",
)

from mla_sm120_plugin.errors import KernelInputError, KernelUnavailable  # noqa: E402
from mla_sm120_plugin.dispatch import flashinfer as fi_binding  # noqa: E402
from mla_sm120_plugin.kernels.dsa import layout  # noqa: E402
from mla_sm120_plugin.kernels.dsa.pack import make_cache, quantize_fp8_ds_mla, write_to_cache  # noqa: E402
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla  # noqa: E402

OUT_TOL = 5e-3  # upstream FlashInfer tolerance (atol = rtol)
LSE_ATOL = 2e-2  # ours: fp8 Q moves the logits by ~1 %, not yet measured
SM_SCALE = (128 + 64) ** -0.5  # the DSA models' (qk_nope + qk_rope) ** -0.5, without YaRN mscale


def _case(num_tokens, num_heads, topk, scale_format, *, pages=None, seed=0, pad=0.1, out_of_range=0.02):
    """q, a filled fp8_ds_mla cache and indices with -1 padding and a few out-of-range ids."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = pages or max(2, math.ceil(2 * topk / layout.PAGE_SIZE))
    num_slots = pages * layout.PAGE_SIZE
    latent = torch.randn(num_slots, layout.HEAD_DIM, device="cuda", generator=gen)
    cache = make_cache(pages, layout.FP8_DS_MLA, device="cuda")
    write_to_cache(cache, quantize_fp8_ds_mla(latent, scale_format), torch.arange(num_slots, device="cuda"))
    q = (0.5 * torch.randn(num_tokens, num_heads, layout.HEAD_DIM, device="cuda", generator=gen)).to(torch.bfloat16)
    order = torch.rand(num_tokens, num_slots, device="cuda", generator=gen).argsort(dim=1)
    indices = order[:, :topk].to(torch.int32)
    roll = torch.rand(num_tokens, topk, device="cuda", generator=gen)
    indices = torch.where(roll < pad, torch.full_like(indices, -1), indices)
    indices = torch.where(roll > 1 - out_of_range, indices + num_slots, indices)
    return q, cache, indices


def _both(q, cache, indices, scale_format, **kwargs):
    got = fi_binding.flashinfer_sparse_mla(
        q, cache, indices, sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, scale_format=scale_format, **kwargs
    )
    want = torch_sparse_mla(q, cache, indices, sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, **kwargs)
    return got, want


def _assert_out(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=OUT_TOL, rtol=OUT_TOL)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "topk"),
    [(1, 64, 2048), (1, 4, 100), (3, 128, 2048), (64, 16, 512), (65, 64, 2048), (130, 8, 512), (96, 128, 1024)],
)
def test_matches_reference(num_tokens, num_heads, topk, scale_format):
    q, cache, indices = _case(num_tokens, num_heads, topk, scale_format)
    (out, lse), (ref, ref_lse) = _both(q, cache, indices, scale_format, return_lse=True)
    assert out.shape == (num_tokens, num_heads, layout.KV_LORA_RANK) and out.dtype == torch.bfloat16
    _assert_out(out, ref)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("lse_base", ["e", "2"])
@pytest.mark.parametrize("num_tokens", [5, 128])
def test_topk_length_sink_and_lse_base(num_tokens, lse_base):
    q, cache, indices = _case(num_tokens, 16, 512, "arbitrary", seed=1)
    topk_length = torch.randint(0, 513, (num_tokens,), dtype=torch.int32, device="cuda")
    topk_length[0] = 0  # a row with nothing valid: out 0, lse -inf
    sink = torch.randn(16, device="cuda")
    (out, lse), (ref, ref_lse) = _both(
        q, cache, indices, "arbitrary", topk_length=topk_length, sink=sink, return_lse=True, lse_base=lse_base
    )
    _assert_out(out, ref)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=LSE_ATOL, rtol=0)


def test_page_strided_cache_decode_only():
    q, cache, indices = _case(8, 64, 2048, "pow2", seed=2)
    page_bytes = layout.PAGE_SIZE * layout.FP8_DS_MLA_TOKEN_BYTES
    pool = torch.zeros(cache.shape[0], page_bytes + 64, dtype=torch.uint8, device="cuda")  # 64-byte gap a page
    strided = pool[:, :page_bytes].view(cache.shape[0], layout.PAGE_SIZE, -1)
    strided.copy_(cache)
    got, want = _both(q, strided, indices, "pow2")
    _assert_out(got, want)
    q_long = q.repeat(9, 1, 1)  # 72 tokens: the prefill path, which needs back-to-back pages
    with pytest.raises(KernelInputError, match="page-strided"):
        fi_binding.flashinfer_sparse_mla(
            q_long, strided, indices.repeat(9, 1), sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, scale_format="pow2"
        )


def test_out_of_envelope_is_an_input_error():
    q, cache, indices = _case(65, 4, 2048, "arbitrary", seed=3)
    with pytest.raises(KernelInputError, match="num_heads=4"):
        fi_binding.flashinfer_sparse_mla(
            q, cache, indices, sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, scale_format="arbitrary"
        )


def test_cuda_graph_capture_and_replay():
    q, cache, indices = _case(4, 64, 2048, "arbitrary", seed=4)
    out = torch.empty(4, 64, layout.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    call = dict(sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, scale_format="arbitrary", out=out)
    fi_binding.flashinfer_sparse_mla(q, cache, indices, **call)  # eager warm-up of this shape
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fi_binding.flashinfer_sparse_mla(q, cache, indices, **call)
    q2, _, indices2 = _case(4, 64, 2048, "arbitrary", seed=5, pages=cache.shape[0])
    q.copy_(q2)
    indices.copy_(indices2)
    graph.replay()
    torch.cuda.synchronize()
    want = torch_sparse_mla(q, cache, indices, sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA)
    _assert_out(out, want)


def test_first_call_during_capture_is_refused():
    q, cache, indices = _case(2, 16, 512, "pow2", seed=6)
    fi_binding._WRAPPERS.pop((torch.cuda.current_device(), "pow2_fp32"), None)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(KernelUnavailable, match="during CUDA graph capture"):
        with torch.cuda.graph(graph):
            fi_binding.flashinfer_sparse_mla(
                q, cache, indices, sm_scale=SM_SCALE, kv_layout=layout.FP8_DS_MLA, scale_format="pow2"
            )
