"""GPU kernel benchmark (``mla-sm120 bench``): time, bandwidth and FLOP rate against ceilings
measured in the same run. Public torch/Triton APIs only; the CPU memory harness, which needs
torch's private dispatch hooks, lives in ``benchmarks/cpu_memory.py``.

Per shape (fp8_ds_mla cache, bf16 q, top-k 2048) and kernel, as vLLM calls it (the bound kernel
function, no ``sparse_mla_forward`` validation):

* ``eager_us``: ``triton.testing.do_bench`` (launches back to back, host time included);
* ``graph_us``: ``triton.testing.do_bench_cudagraph`` (what vLLM's captured decode sees);
* ``host_us``: eager minus graph, the launch and Python cost of one call;
* ``gbps``: ``T * topk * 656`` cache bytes / graph time, and its fraction of the measured
  device-to-device copy bandwidth (bytes read plus written);
* ``tflops``: ``2 * T * H * topk * (576 + 512)`` / graph time, and its fraction of the measured
  dense bf16 matmul rate;
* ``max_abs_diff`` and ``max_rel_diff`` against the torch reference.

The report also carries the compile gate's ptxas numbers (registers, spills, shared memory) for
this GPU's architecture.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import torch

from mla_sm120_plugin.kernels import layout, pack
from mla_sm120_plugin.kernels.reference import torch_sparse_mla

TOPK = 2048
# (tokens, heads): single-token decode, a 64-token decode step, and a long prefill.
SHAPES = [(1, 8), (1, 16), (1, 128), (64, 4), (64, 8), (64, 16), (64, 128), (2048, 8), (2048, 16), (2048, 128)]
SHAPES_QUICK = [(1, 16), (64, 8), (64, 128)]
KERNELS = ("triton_sparse_mla", "flashinfer_sparse_mla")
FLOPS_PER_CANDIDATE_HEAD = 2 * (layout.HEAD_DIM + layout.KV_LORA_RANK)  # q.k over 576, p.v over 512


def make_inputs(num_heads: int, topk: int, num_tokens: int, kv_layout: str = layout.FP8_DS_MLA,
                device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Random bf16 q, a cache with ``max(2 * topk, 4096)`` filled slots, and in-range indices."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = math.ceil(max(2 * topk, 4096) / layout.PAGE_SIZE)
    num_slots = num_pages * layout.PAGE_SIZE
    cache = pack.make_cache(num_pages, kv_layout)
    # Written a page at a time so that building inputs sets a low memory high-water mark (the CPU
    # harness measures a call's rise above it).
    for page in range(num_pages):
        latent = torch.randn(layout.PAGE_SIZE, layout.HEAD_DIM, generator=gen)
        tokens = (pack.quantize_fp8_ds_mla(latent, layout.SCALE_ARBITRARY) if kv_layout == layout.FP8_DS_MLA
                  else pack.pack_bf16(latent))
        pack.write_to_cache(cache, tokens, page * layout.PAGE_SIZE + torch.arange(layout.PAGE_SIZE))
    indices = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int32)
    q = torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    return dict(q=q.to(device), kv_cache=cache.to(device), indices=indices.to(device),
                sm_scale=layout.HEAD_DIM**-0.5, kv_layout=kv_layout)


def measure_ceilings(device: str, quick: bool) -> dict[str, float]:
    """Device-to-device copy bandwidth (GB/s, read + written) and dense bf16 matmul rate (TFLOP/s)."""
    import triton.testing

    n_bytes = 1 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    del src, dst
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=5, rep=50)
    return dict(copy_gbps=2 * n_bytes / (copy_ms * 1e-3) / 1e9, matmul_tflops=2 * n**3 / (mm_ms * 1e-3) / 1e12,
                matmul_n=n)


def _kernel_fn(name: str, inputs: dict[str, Any]):
    """The bound kernel as the vLLM impl calls it: its own output buffer, no validation."""
    from mla_sm120_plugin.kernels.binding import bind

    bound = bind(name)
    out = torch.empty(*inputs["q"].shape[:2], layout.KV_LORA_RANK, dtype=torch.bfloat16, device=inputs["q"].device)
    return lambda: bound.call(inputs["q"], inputs["kv_cache"], inputs["indices"], sm_scale=inputs["sm_scale"],
                              kv_layout=inputs["kv_layout"], out=out, scale_format=layout.SCALE_ARBITRARY)


def _measure(name: str, inputs: dict[str, Any], ref: torch.Tensor, ceilings: dict[str, float]) -> dict[str, Any]:
    import triton.testing

    fn = _kernel_fn(name, inputs)
    got = fn().float()
    diff = (got - ref.float()).abs().max().item()
    eager_ms = triton.testing.do_bench(fn, warmup=10, rep=100)
    graph_ms = triton.testing.do_bench_cudagraph(fn, rep=100)
    tokens, heads = inputs["q"].shape[:2]
    kv_bytes = tokens * TOPK * layout.FP8_DS_MLA_TOKEN_BYTES
    flops = tokens * heads * TOPK * FLOPS_PER_CANDIDATE_HEAD
    gbps = kv_bytes / (graph_ms * 1e-3) / 1e9
    tflops = flops / (graph_ms * 1e-3) / 1e12
    return dict(eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3, host_us=(eager_ms - graph_ms) * 1e3,
                gbps=gbps, fraction_of_copy_bandwidth=gbps / ceilings["copy_gbps"],
                tflops=tflops, fraction_of_matmul=tflops / ceilings["matmul_tflops"],
                max_abs_diff=diff, max_rel_diff=diff / max(ref.float().abs().max().item(), 1e-30))


def run_gpu_benchmarks(device: str = "cuda", quick: bool = False) -> dict[str, Any]:
    """Every kernel that can run here on :data:`SHAPES` (JSON-serializable); see the module docstring."""
    from mla_sm120_plugin.kernels import compile_gate

    if not torch.cuda.is_available():
        from mla_sm120_plugin.errors import KernelUnavailable, format_error

        raise KernelUnavailable(format_error(f"device={device!r} on a machine without a CUDA GPU",
                                             "a CUDA GPU for timings", "run it on the GPU machine, or use "
                                             "--compile-only --arch 120 for the kernels' resources"))
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        from mla_sm120_plugin.errors import KernelUnavailable, format_error

        raise KernelUnavailable(format_error(f"device={device!r}", f"cuda:0..cuda:{torch.cuda.device_count() - 1} "
                                             "on this machine", "pick a GPU this machine has (nvidia-smi lists them)"))
    major, minor = torch.cuda.get_device_capability(device)
    ceilings = measure_ceilings(device, quick)
    rows = []
    for tokens, heads in SHAPES_QUICK if quick else SHAPES:
        inputs = make_inputs(heads, TOPK, tokens, device=device)
        ref = torch_sparse_mla(**inputs)
        row: dict[str, Any] = dict(num_tokens=tokens, num_heads=heads, topk=TOPK, kv_layout=layout.FP8_DS_MLA,
                                   q_dtype="bf16", kv_bytes=tokens * TOPK * layout.FP8_DS_MLA_TOKEN_BYTES,
                                   flops=tokens * heads * TOPK * FLOPS_PER_CANDIDATE_HEAD)
        for name in KERNELS:
            try:
                row[name] = _measure(name, inputs, ref, ceilings)
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a result
                row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:500]}")
        rows.append(row)
        del inputs, ref
        torch.cuda.empty_cache()
    arch = major * 10 + minor
    gate = compile_gate.report(arch) if arch in compile_gate.ARCHES else None
    return dict(
        device=torch.cuda.get_device_name(device), capability=f"{major}.{minor}", torch=torch.__version__,
        python=platform.python_version(), quick=quick, ceilings=ceilings,
        measures={k: v for k, v in (line.split(": ", 1) for line in _MEASURES)},
        results=rows, compiled=gate,
    )


_MEASURES = (
    "eager_us: triton.testing.do_bench median, host time included",
    "graph_us: triton.testing.do_bench_cudagraph, the call replayed from a CUDA graph",
    "host_us: eager_us - graph_us",
    "gbps: T * topk * 656 cache bytes / graph time",
    "tflops: 2 * T * H * topk * (576 + 512) / graph time",
    "ceilings: copy_gbps (1 GiB device copy, read + written), matmul_tflops (bf16 n^3 matmul)",
)


def plot(report: dict[str, Any], path: str) -> None:
    """Achieved bandwidth and FLOP rate per shape and kernel, each against its measured ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from mla_sm120_plugin.errors import KernelUnavailable, format_error

        raise KernelUnavailable(format_error("--plot without matplotlib", "matplotlib installed",
                                             "pip install 'mla-sm120-plugin[plot]'")) from exc
    rows = report["results"]
    labels = [f"T={r['num_tokens']}\nH={r['num_heads']}" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(rows) * 1.1), 8), sharex=True)
    width = 0.8 / len(KERNELS)
    for i, name in enumerate(KERNELS):
        xs = [j + i * width for j in range(len(rows))]
        axes[0].bar(xs, [r[name].get("gbps", 0) for r in rows], width, label=name)
        axes[1].bar(xs, [r[name].get("tflops", 0) for r in rows], width, label=name)
    axes[0].axhline(report["ceilings"]["copy_gbps"], color="k", linestyle="--", label="copy bandwidth")
    axes[1].axhline(report["ceilings"]["matmul_tflops"], color="k", linestyle="--", label="bf16 matmul")
    axes[0].set_ylabel("GB/s (cache bytes / graph time)")
    axes[1].set_ylabel("TFLOP/s")
    axes[1].set_xticks([j + width * (len(KERNELS) - 1) / 2 for j in range(len(rows))], labels)
    axes[0].set_title(f"sparse MLA, fp8_ds_mla, topk {TOPK}, bf16 q - {report['device']}")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
