"""DeepSeek-V4 decode timings on a GPU (``mla-sm120 bench --dsv4``): the plugin's Triton kernel on
its launch plan and unsplit, and FlashInfer's SM120 kernel where it runs, side by side.

Per shape (:data:`SHAPES`: T = 1 / 6 / 64 tokens (a decode step, an MTP verify of 1 + 5, a batch) x
8 / 16 / 64 / 128 heads x C4A (128 window + 512 compressed candidates, 64-entry compressed pages)
and C128A (128 + 8,192, 2-entry pages), each record) every kernel is called as vLLM calls it (FlashInfer's
SM120 surface: NHD pages, ``[T, 1, K]`` index rows, its 128 MiB workspace, its own ``out``), and a
row reports ``eager_us`` and ``graph_us`` (replayed from a CUDA graph), the GB/s of the minimum
bytes (:func:`~mla_sm120_plugin.kernels.dsv4.plan.traffic`) at the graph time and its fraction of
the copy bandwidth measured in the same run, the plan's split and modeled time, and the accuracy of
the first tokens against float64 over the dequantized rows.

The caches hold :data:`FOOTPRINT_BYTES` each (512 MiB: 5x an RTX 5090's 96 MB L2, 4x an RTX PRO
6000's 128 MB) and the ids are spread over all of it, so the bytes come from DRAM, not L2. The
rows are a few thousand written records tiled over the pool (the kernels read bytes; repeated
contents cost the same).
"""

from __future__ import annotations

import platform
from typing import Any, Callable

import torch

from mla_sm120_plugin.kernels.accuracy import measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack, plan
from mla_sm120_plugin.kernels.dsv4.reference import dsv4_attention_reference

TOKENS = (1, 6, 64)
HEADS = (8, 16, 64, 128)
WINDOW, WINDOW_PAGE = 128, 64
KINDS = {"c4a": (512, 64), "c128a": (8192, 2)}  # kind -> (compressed candidates, compressed page)
RECORDS = (layout.FP8_DSV4, layout.NVFP4_DSV4)
SHAPES = [(record, kind, t, h) for record in RECORDS for kind in KINDS for t in TOKENS for h in HEADS]
FOOTPRINT_BYTES = 512 << 20
WORKSPACE_BYTES = 128 << 20  # what vLLM hands the call (FlashInfer's DeepSeek-V4 workspace)
REFERENCE_TOKENS = 2  # tokens checked against float64 a shape
_WRITTEN_ROWS = 4096  # rows written by the packer, then tiled over the pool

_MEASURES = (
    "eager_us: triton.testing.do_bench median, host time included",
    "graph_us: triton.testing.do_bench_cudagraph, the call replayed from a CUDA graph",
    "gbps: the minimum bytes (cache rows + ids + q + out, once: kernels/dsv4/plan.traffic) / graph time",
    "fraction_of_copy_bandwidth: gbps / copy_gbps (1 GiB device copy, read + written, this run)",
    "modeled_us: the plan's model (max(bytes / the family's bandwidth, step chain x 1 us)), plan and unsplit",
    "cos_diff, rel_rms: the first tokens against float64 attention over the dequantized rows",
)


def _pool(record: layout.Dsv4Record, page_size: int, device: str, footprint: int, gen: torch.Generator
          ) -> tuple[torch.Tensor, int]:
    """A page-major cache of about ``footprint`` bytes in the engines' view ([pages, P, 1, bytes])."""
    pages = max(2, footprint // (page_size * record.token_bytes))
    written = max(1, min(pages, _WRITTEN_ROWS // page_size))
    rows = torch.randn(written * page_size, layout.HEAD_DIM, generator=gen)
    small = pack.new_cache(written, page_size, record=record)
    pack.write(small, rows, torch.arange(written * page_size), page_size, record=record)
    buf = small.to(device).repeat(-(-pages // written), 1)[:pages].contiguous()
    view = buf[:, : page_size * record.token_bytes].view(pages, page_size, 1, record.token_bytes)
    return view, pages * page_size


def build(record_name: str, kind: str, tokens: int, heads: int, device: str,
          footprint: int = FOOTPRINT_BYTES, seed: int = 0) -> dict[str, Any]:
    """One shape's call on FlashInfer's SM120 surface: full index rows spread over both pools."""
    record = layout.RECORDS[record_name]
    compressed, extra_page = KINDS[kind]
    gen = torch.Generator().manual_seed(seed)
    swa, swa_slots = _pool(record, WINDOW_PAGE, device, footprint, gen)
    extra, extra_slots = _pool(record, extra_page, device, footprint, gen)
    q = (torch.randn(tokens, heads, layout.HEAD_DIM, generator=gen) / 4).to(torch.bfloat16)
    return dict(
        query=q.to(device), swa_kv_cache=swa, compressed_kv_cache=extra,
        sparse_indices=torch.randint(0, swa_slots, (tokens, 1, WINDOW), generator=gen, dtype=torch.int32).to(device),
        extra_sparse_indices=torch.randint(0, extra_slots, (tokens, 1, compressed), generator=gen,
                                           dtype=torch.int32).to(device),
        swa_topk_lens=torch.full((tokens,), WINDOW, dtype=torch.int32, device=device),
        extra_sparse_topk_lens=torch.full((tokens,), compressed, dtype=torch.int32, device=device),
        sinks=torch.randn(heads, generator=gen).to(device), bmm1_scale=layout.HEAD_DIM ** -0.5, kv_layout="NHD",
        kv_cache_format=layout.FLASHINFER_FORMAT[record_name],
    )


def callables(inputs: dict[str, Any], out: torch.Tensor, workspace: torch.Tensor | None) -> dict[str, Callable[[], Any]]:
    """What is timed: ``plan`` (the Triton kernel on its launch plan), ``unsplit`` (the same, one
    range a head block: the kernel before it split) and ``flashinfer`` (FlashInfer's SM120 kernel)."""
    from mla_sm120_plugin.dispatch.binding import bind
    from mla_sm120_plugin.dispatch.catalog import FLASHINFER_DSV4, TRITON_DSV4

    triton_fn = bind(TRITON_DSV4).fn
    found: dict[str, Callable[[], Any]] = {
        "plan": lambda: triton_fn(workspace_buffer=workspace, out=out, **inputs),
        "unsplit": lambda: triton_fn(workspace_buffer=workspace, out=out, num_splits=1, **inputs),
    }
    try:
        flashinfer_fn = bind(FLASHINFER_DSV4).fn
    except Exception as exc:  # noqa: BLE001 - not installed or not this GPU: a result, not a failure
        found["flashinfer"] = _unavailable(exc)
    else:
        found["flashinfer"] = lambda: flashinfer_fn(workspace_buffer=workspace, out=out, **inputs)
    return found


def _unavailable(exc: Exception) -> Callable[[], Any]:
    def fail() -> Any:
        raise exc
    return fail


def reference(inputs: dict[str, Any], tokens: int) -> torch.Tensor:
    """Float64 attention of the first ``tokens`` tokens over the dequantized rows."""
    from mla_sm120_plugin.dispatch.dsv4 import RECORD_OF_FORMAT, pages_of

    record = RECORD_OF_FORMAT[inputs["kv_cache_format"]]
    swa, swa_page = pages_of("swa_kv_cache", inputs["swa_kv_cache"], "NHD", record)
    extra, extra_page = pages_of("compressed_kv_cache", inputs["compressed_kv_cache"], "NHD", record)
    return dsv4_attention_reference(
        inputs["query"][:tokens].double(), swa, inputs["sparse_indices"][:tokens, 0], swa_page,
        sm_scale=inputs["bmm1_scale"], swa_lengths=inputs["swa_topk_lens"][:tokens], extra_cache=extra,
        extra_indices=inputs["extra_sparse_indices"][:tokens, 0], extra_lengths=inputs["extra_sparse_topk_lens"][:tokens],
        extra_page_size=extra_page, sinks=inputs["sinks"], record=record)


def _time(fn: Callable[[], Any], minimum_bytes: int, copy_gbps: float) -> dict[str, float]:
    import triton.testing

    eager_ms = triton.testing.do_bench(fn, warmup=5, rep=30)
    graph_ms = triton.testing.do_bench_cudagraph(fn, rep=30)
    gbps = minimum_bytes / (graph_ms * 1e-3) / 1e9
    return dict(eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3, gbps=gbps,
                fraction_of_copy_bandwidth=gbps / copy_gbps)


def shape_row(record_name: str, kind: str, tokens: int, heads: int, device: str, family: str,
              copy_gbps: float | None, footprint: int = FOOTPRINT_BYTES,
              workspace: torch.Tensor | None = None) -> dict[str, Any]:
    """One shape: each of :func:`callables` checked against float64 and (with ``copy_gbps``) timed;
    ``workspace``: the uint8 bytes vLLM would pass the call (None: the kernels allocate)."""
    record = layout.RECORDS[record_name]
    compressed, _ = KINDS[kind]
    inputs = build(record_name, kind, tokens, heads, device, footprint)
    n_ref = min(tokens, REFERENCE_TOKENS)
    want = reference(inputs, n_ref)
    out = torch.empty_like(inputs["query"])
    cfg = plan.launch_config(record, tokens, heads, WINDOW, compressed, family)
    shape = plan.shape_of(record)
    ctas = shape.ctas_per_sm[family]
    minimum = plan.traffic(cfg, tokens, heads, WINDOW, compressed, record).minimum
    row: dict[str, Any] = dict(
        record=record_name, kind=kind, num_tokens=tokens, num_heads=heads,
        candidates=dict(window=WINDOW, compressed=compressed), minimum_bytes=minimum,
        num_splits=cfg.num_splits, chunk=cfg.chunk(WINDOW + compressed),
        modeled_us=dict(plan=plan.modeled(cfg, plan.FAMILIES[family], tokens, heads, WINDOW, compressed, ctas,
                                          record)["modeled_us"],
                        unsplit=plan.modeled(shape.config, plan.FAMILIES[family], tokens, heads, WINDOW, compressed,
                                             ctas, record)["modeled_us"]),
        kernels={})
    for label, fn in callables(inputs, out, workspace).items():
        entry: dict[str, Any] = {}
        try:
            fn()
            acc = measure(out[:n_ref], want)
            entry.update(cos_diff=acc.cos_diff, rel_rms=acc.rel_rms)
            if copy_gbps is not None:
                entry.update(_time(fn, minimum, copy_gbps))
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run this shape here is a result
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["kernels"][label] = entry
    return row


def run(device: str = "cuda", *, shapes: list[tuple[str, str, int, int]] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every shape of :data:`SHAPES` (or ``shapes``) on a CUDA GPU, as JSON-ready data; ``progress``
    gets the report after every shape (a run cut short keeps what it measured)."""
    from mla_sm120_plugin.errors import KernelUnavailable, format_error

    if not torch.cuda.is_available():
        raise KernelUnavailable(format_error(f"device={device!r} on a machine without a CUDA GPU",
                                             "a CUDA GPU for DeepSeek-V4 timings",
                                             "run it on the GPU machine; `mla-sm120 bench --traffic` models the "
                                             "plans without one"))
    import triton
    import triton.testing

    from mla_sm120_plugin.kernels.shared.launch_plan import gpu_family

    major, minor = torch.cuda.get_device_capability(device)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50) * 1e-3) / 1e9
    del src, dst
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # vLLM's, made once a device
    report: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device), capability=f"{major}.{minor}", family=gpu_family(major, minor),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        footprint_bytes=FOOTPRINT_BYTES, copy_gbps=copy_gbps,
        measures={k: v for k, v in (line.split(": ", 1) for line in _MEASURES)}, results=[])
    for shape in shapes or SHAPES:
        report["results"].append(shape_row(*shape, device=device, family=report["family"], copy_gbps=copy_gbps,
                                           workspace=workspace))
        torch.cuda.empty_cache()
        if progress is not None:
            progress(report)
    return report
