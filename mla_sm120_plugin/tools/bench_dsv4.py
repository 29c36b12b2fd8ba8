"""DeepSeek-V4 timings on a GPU (``mla-sm120 bench --dsv4``): the plugin's Triton kernel on its launch
plan and unsplit, and FlashInfer's SM120 kernel where it serves the shape, side by side, each row with
the plan's modeled time and its terms, so the first timing run calibrates the model.

Per shape (:data:`SHAPES`, each record, C4A (128 window + 512 compressed candidates, 64-entry
compressed pages) and C128A (128 + 8,192, 2-entry pages)): decode steps and MTP / DSpark verifies of
one request (T = 1, 2, 4, 6), a batched decode of 64 requests, at 8 / 16 / 32 / 64 / 128 heads;
prefill chunks of one request (T = 512, 2,048, 8,192) at 16 and 32 heads. Every kernel is called as
vLLM calls it (FlashInfer's SM120 surface: NHD pages, ``[T, 1, K]`` index rows, its 128 MiB
workspace, its own ``out``; FlashInfer's decode call takes at most 64 tokens, so a prefill row has
an ``error`` entry for it), and a row reports ``eager_us`` and ``graph_us`` (replayed from a CUDA
graph), the GB/s of the minimum bytes (:func:`~mla_sm120_plugin.kernels.dsv4.plan.traffic`) at the
graph time and its fraction of the copy bandwidth measured in the same run, the plan's split, its
modeled time beside the unsplit launch's and the model's terms (:func:`~..kernels.dsv4.plan.modeled`:
DRAM, MMA, issue, chain), and the accuracy of the first tokens against float64 over the dequantized
rows.

The caches hold :data:`FOOTPRINT_BYTES` each (512 MiB: 5x an RTX 5090's 96 MB L2, 4x an RTX PRO
6000's 128 MB). A batch of one-token requests has its ids spread over all of it, so its bytes come
from DRAM; a request of several tokens reads one set of compressed rows and overlapping windows
(consecutive slots), as the model counts it (:func:`~..kernels.dsv4.plan.request_rows`). The rows are
a few thousand written records tiled over the pool (the kernels read bytes; repeated contents cost
the same).
"""

from __future__ import annotations

import platform
from typing import Any, Callable

import torch

from mla_sm120_plugin.kernels.accuracy import measure
from mla_sm120_plugin.kernels.dsv4 import layout, pack, plan
from mla_sm120_plugin.kernels.dsv4.reference import dsv4_attention_reference

DECODE_TOKENS = (1, 2, 4, 6, plan.BATCH_TOKENS)  # a decode step, MTP / DSpark verifies of one request, a batch
DECODE_HEADS = (8, 16, 32, 64, 128)
PREFILL_TOKENS = (512, 2048, 8192)  # prefill chunks of one request
PREFILL_HEADS = (16, 32)
WINDOW, WINDOW_PAGE = 128, 64
KINDS = {"c4a": (512, 64), "c128a": (8192, 2)}  # kind -> (compressed candidates, compressed page)
RECORDS = (layout.FP8_DSV4, layout.NVFP4_DSV4)


SHAPES = [(record, kind, t, h) for record in RECORDS for kind in KINDS
          for t, heads in ((t, DECODE_HEADS) for t in DECODE_TOKENS) for h in heads] + [
    (record, kind, t, h) for record in RECORDS for kind in KINDS for t in PREFILL_TOKENS for h in PREFILL_HEADS]
FOOTPRINT_BYTES = 512 << 20
WORKSPACE_BYTES = 128 << 20  # what vLLM hands the call (FlashInfer's DeepSeek-V4 workspace)
REFERENCE_TOKENS = 2  # tokens checked against float64 a shape
_WRITTEN_ROWS = 4096  # rows written by the packer, then tiled over the pool

_MEASURES = (
    "eager_us: triton.testing.do_bench median, host time included",
    "graph_us: triton.testing.do_bench_cudagraph, the call replayed from a CUDA graph",
    "gbps: the minimum bytes (cache rows + ids + q + out, once: kernels/dsv4/plan.traffic) / graph time",
    "fraction_of_copy_bandwidth: gbps / copy_gbps (1 GiB device copy, read + written, this run)",
    "modeled_us: the plan's model (kernels/dsv4/plan.modeled: max(DRAM, the step chain)), plan and unsplit",
    "model: the plan's terms, µs: dram_us, mma_us, issue_us, chain_us, modeled_us, bound, ratio",
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


def _index_rows(tokens: int, width: int, slots: int, gen: torch.Generator, one_request: bool,
                window: bool) -> torch.Tensor:
    """``[T, 1, width]`` slot ids: one request's (a window of consecutive slots moving a slot a token;
    one compressed row for every token) or, else, each token's own, spread over the pool."""
    if not one_request:
        return torch.randint(0, slots, (tokens, 1, width), generator=gen, dtype=torch.int32)
    if window:
        start = int(torch.randint(0, slots - tokens - width, (1,), generator=gen))
        return (start + torch.arange(tokens)[:, None] + torch.arange(width)[None, :]).to(torch.int32)[:, None]
    return torch.randint(0, slots, (1, 1, width), generator=gen, dtype=torch.int32).expand(tokens, 1, width).clone()


def build(record_name: str, kind: str, tokens: int, heads: int, device: str,
          footprint: int = FOOTPRINT_BYTES, seed: int = 0, requests: int | None = None) -> dict[str, Any]:
    """One shape's call on FlashInfer's SM120 surface: full index rows over both pools, each token's
    own (``requests`` None or T) or, for one request, shared as :func:`_index_rows` makes them."""
    record = layout.RECORDS[record_name]
    compressed, extra_page = KINDS[kind]
    gen = torch.Generator().manual_seed(seed)
    swa, swa_slots = _pool(record, WINDOW_PAGE, device, footprint, gen)
    extra, extra_slots = _pool(record, extra_page, device, footprint, gen)
    q = (torch.randn(tokens, heads, layout.HEAD_DIM, generator=gen) / 4).to(torch.bfloat16)
    one = requests == 1 and tokens > 1
    return dict(
        query=q.to(device), swa_kv_cache=swa, compressed_kv_cache=extra,
        sparse_indices=_index_rows(tokens, WINDOW, swa_slots, gen, one, True).to(device),
        extra_sparse_indices=_index_rows(tokens, compressed, extra_slots, gen, one, False).to(device),
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
              workspace: torch.Tensor | None = None, requests: int | None = None) -> dict[str, Any]:
    """One shape: each of :func:`callables` checked against float64 and (with ``copy_gbps``) timed;
    ``workspace``: the uint8 bytes vLLM would pass the call (None: the kernels allocate);
    ``requests``: how many requests the tokens are (None: :func:`.plan.requests_of`)."""
    record = layout.RECORDS[record_name]
    compressed, _ = KINDS[kind]
    requests = plan.requests_of(tokens) if requests is None else requests
    inputs = build(record_name, kind, tokens, heads, device, footprint, requests=requests)
    n_ref = min(tokens, REFERENCE_TOKENS)
    want = reference(inputs, n_ref)
    out = torch.empty_like(inputs["query"])
    cfg = plan.launch_config(record, tokens, heads, WINDOW, compressed, family)
    shape = plan.shape_of(record)
    ctas = shape.ctas_per_sm[family]
    minimum = plan.traffic(cfg, tokens, heads, WINDOW, compressed, record, family, requests).minimum
    model = plan.modeled(cfg, plan.FAMILIES[family], tokens, heads, WINDOW, compressed, ctas, record, requests)
    row: dict[str, Any] = dict(
        record=record_name, kind=kind, num_tokens=tokens, num_heads=heads, requests=requests,
        candidates=dict(window=WINDOW, compressed=compressed), minimum_bytes=minimum,
        num_splits=cfg.num_splits, chunk=cfg.chunk(WINDOW, compressed),
        modeled_us=dict(plan=model["modeled_us"],
                        unsplit=plan.modeled(shape.config, plan.FAMILIES[family], tokens, heads, WINDOW,
                                             compressed, ctas, record, requests)["modeled_us"]),
        model=model, kernels={})
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
