"""What any CUDA GPU can check (an H200 too): the claims the SM12x-only file cannot reach elsewhere.

- The self-check inside an engine's real construction context on the GPU: the default dtype bf16
  and ``torch.device("cuda")`` around it (the context that broke the first vLLM start).
- The Triton kernel's CUDA-graph safety: captured, replayed on new inputs, still the reference's
  answer (the catalog declares it graph-safe; vLLM captures decode).
- FlashInfer on a GPU that is not SM12x: refused with the GPU named, never a crash in a kernel.

Skipped only where there is no CUDA GPU; tests/gpu/test_flashinfer_sm120.py covers SM12x itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (any: an H200 or an RTX 50xx); this machine has none")

from support.kernel_checks import assert_kernel_close  # noqa: E402

from mla_sm120_plugin.errors import KernelUnavailable  # noqa: E402
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.dispatch import selfcheck  # noqa: E402
from mla_sm120_plugin.dispatch.binding import bind  # noqa: E402
from mla_sm120_plugin.dispatch.catalog import TRITON  # noqa: E402
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla  # noqa: E402
from mla_sm120_plugin.kernels.dsa.triton import triton_sparse_mla  # noqa: E402


def test_self_check_inside_an_engines_construction_context_on_the_gpu():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            result = selfcheck.check(bind(TRITON), phase="decode", kv_layout=layout.FP8_DS_MLA,
                                     scale_format=layout.SCALE_ARBITRARY, num_heads=8, topk=2048,
                                     device=selfcheck.engine_device())
    finally:
        torch.set_default_dtype(dtype)
    assert result.passed, result
    assert torch.get_default_dtype() == dtype


def _case(tokens: int, heads: int, topk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pages = 8
    latent = torch.randn(pages * layout.PAGE_SIZE, layout.HEAD_DIM, generator=gen)
    cache = pack.page_view(pack.quantize_fp8_ds_mla(latent, layout.SCALE_POW2)).cuda()
    indices = torch.randint(-1, pages * layout.PAGE_SIZE, (tokens, topk), generator=gen, dtype=torch.int32).cuda()
    q = torch.randn(tokens, heads, layout.HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
    return q, cache, indices


def test_triton_replays_in_a_cuda_graph():
    q, cache, indices = _case(4, 16, 256, seed=0)
    out = torch.empty(4, 16, layout.KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    call = dict(sm_scale=0.07, kv_layout=layout.FP8_DS_MLA, out=out)
    triton_sparse_mla(q, cache, indices, **call)  # compile and warm up eagerly, as vLLM does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_sparse_mla(q, cache, indices, **call)
    q2, _, indices2 = _case(4, 16, 256, seed=1)
    q.copy_(q2)
    indices.copy_(indices2)
    graph.replay()
    torch.cuda.synchronize()
    want = torch_sparse_mla(q.float(), cache, indices, sm_scale=0.07, kv_layout=layout.FP8_DS_MLA)
    assert_kernel_close(out.float(), want)


def test_flashinfer_refuses_a_gpu_that_is_not_sm12x():
    major, minor = torch.cuda.get_device_capability()
    if major == 12:
        pytest.skip("an SM12x GPU: tests/gpu/test_flashinfer_sm120.py runs FlashInfer here")
    from mla_sm120_plugin.dispatch import flashinfer

    flashinfer.clear_caches()
    q, cache, indices = _case(2, 16, 256, seed=2)
    with pytest.raises(KernelUnavailable) as err:
        flashinfer.flashinfer_sparse_mla(q, cache, indices, sm_scale=0.07, kv_layout=layout.FP8_DS_MLA,
                                         scale_format=layout.SCALE_POW2)
    message = str(err.value)
    # With flashinfer installed the probe names the GPU; without it (the H200 kind), the package.
    assert f"sm_{major}{minor}" in message or "flashinfer is not installed" in message, message
