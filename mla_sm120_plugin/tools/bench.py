"""GPU kernel benchmark (``mla-sm120 bench``): time, bandwidth and FLOP rate against ceilings
measured in the same run, for the exact and the fast Triton kernels side by side, each with the
configuration table's choice and its neighbours. Public torch/Triton APIs only; the CPU memory
harness, which needs torch's private dispatch hooks, lives in ``benchmarks/cpu_memory.py``.

Per shape (:data:`SHAPES`: T = 1 / 64 / 2048 tokens x 4-128 heads, top-k 2048, bf16 q, an
fp8_ds_mla cache with arbitrary fp32 scales by default or any layout of ``layout.KV_LAYOUTS``) and
per kernel and launch configuration, called as vLLM calls it (its own output buffer, no
validation), a row reports ``eager_us``, ``graph_us`` (CUDA graph), ``host_us``, ``gbps`` and
``tflops`` with their fractions of the measured copy bandwidth and bf16 matmul rate, the accuracy
against float64 over the dequantized rows with the kernel's declared ``bound``, and the
``config`` and ``traffic`` (:func:`~mla_sm120_plugin.kernels.dsa.plan.traffic`). On sm_90
the fast kernel's fp8 dots are emulated and its rows say so in ``note``. Each field's definition:
docs/kernels.md, section ``tools/bench.py``.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import torch

from mla_sm120_plugin.kernels.accuracy import measure
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.kernels.dsa import plan
from mla_sm120_plugin.kernels.dsa.reference import torch_sparse_mla

TOPK = 2048
SWEEP_TOKENS = (1, 64, 2048)  # single-token decode, a 64-token decode step, a long prefill
SWEEP_HEADS = (4, 8, 16, 64, 128)  # GLM-5 at TP 16 / 8 / 4 / 1, DeepSeek-V3.2 at TP 1
SHAPES = [(t, h) for t in SWEEP_TOKENS for h in SWEEP_HEADS]
SHAPES_QUICK = [(1, 16), (64, 8), (64, 128)]
TRITON_KERNELS = (plan.EXACT.name, plan.FAST.name)
OTHER_KERNELS = ("flashinfer_sparse_mla",)
KERNELS = TRITON_KERNELS + OTHER_KERNELS
TABLE = "table"  # the configuration table's choice; the other candidates are named by their change
REFERENCE_TOKENS = 32  # the torch reference checks this many tokens of each shape (T=2048 would take long)


def flops_per_candidate_head(kv_layout: str) -> int:
    """``2 * (head_dim + latent)``: q.k over the layout's head width (576 or 512), p.v over 512."""
    lay = layout.get(kv_layout)
    return 2 * (lay.head_dim + lay.latent)


FLOPS_PER_CANDIDATE_HEAD = flops_per_candidate_head(layout.FP8_DS_MLA)  # the DSA layout's: 2 * (576 + 512)
SM90_FAST_NOTE = ("sm_90: fp8 dots emulated (no fp8 mma.sync; Triton widens e4m3 to bf16 and runs HMMA); "
                  "not SM120's fp8-MMA speed")


def make_inputs(num_heads: int, topk: int, num_tokens: int, kv_layout: str = layout.FP8_DS_MLA,
                device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Random bf16 q ([T, H, head_dim]), a ``kv_layout`` cache with ``max(2 * topk, 4096)`` filled
    slots (arbitrary scales for fp8 layouts), and in-range indices."""
    lay = layout.get(kv_layout)
    gen = torch.Generator().manual_seed(seed)
    num_pages = math.ceil(max(2 * topk, 4096) / layout.PAGE_SIZE)
    num_slots = num_pages * layout.PAGE_SIZE
    cache = pack.make_cache(num_pages, kv_layout)
    # Written a page at a time so that building inputs sets a low memory high-water mark (the CPU
    # harness measures a call's rise above it).
    for page in range(num_pages):
        latent = torch.randn(layout.PAGE_SIZE, lay.head_dim, generator=gen)
        tokens = pack.pack(latent, kv_layout, layout.SCALE_ARBITRARY)
        pack.write_to_cache(cache, tokens, page * layout.PAGE_SIZE + torch.arange(layout.PAGE_SIZE))
    indices = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int32)
    q = torch.randn(num_tokens, num_heads, lay.head_dim, generator=gen).to(torch.bfloat16)
    return dict(q=q.to(device), kv_cache=cache.to(device), indices=indices.to(device),
                sm_scale=lay.head_dim**-0.5, kv_layout=kv_layout)


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


def candidate_configs(kernel: str, num_tokens: int, num_heads: int, topk: int,
                      family: str) -> dict[str, plan.LaunchConfig]:
    """The table's config for this shape and its neighbours: half and twice the splits, and one
    split (duplicates dropped), so the sweep shows what the table's choice is worth."""
    table = plan.launch_config(kernel, num_tokens, num_heads, topk, family)
    blocks = -(-topk // table.block_k)
    found = {TABLE: table}
    for label, splits in (("half_splits", table.num_splits // 2), ("double_splits", table.num_splits * 2),
                          ("one_split", 1)):
        splits = max(1, min(splits, blocks, plan.MAX_SPLITS))
        per = -(-blocks // splits)
        cfg = plan.with_splits(table, -(-blocks // per), per)
        if cfg not in found.values():
            found[label] = cfg
    return found


def _triton_fn(kernel: str, inputs: dict[str, Any], cfg: plan.LaunchConfig, out: torch.Tensor):
    from mla_sm120_plugin.kernels.dsa import triton as exact
    from mla_sm120_plugin.kernels.dsa import triton_fast as fast

    run = exact._run if kernel == plan.EXACT.name else fast._run
    return lambda: run(inputs["q"], inputs["kv_cache"], inputs["indices"], sm_scale=inputs["sm_scale"],
                       kv_layout=inputs["kv_layout"], topk_length=None, sink=None, out=out, return_lse=False,
                       lse_base="e", config=cfg)


def _bound_fn(name: str, inputs: dict[str, Any], out: torch.Tensor):
    """A registered kernel as the vLLM impl calls it: its own output buffer, no validation."""
    from mla_sm120_plugin.dispatch.binding import bind

    bound = bind(name)
    return lambda: bound.call(inputs["q"], inputs["kv_cache"], inputs["indices"], sm_scale=inputs["sm_scale"],
                              kv_layout=inputs["kv_layout"], out=out, scale_format=layout.SCALE_ARBITRARY)


def _bound(kernel: str) -> dict[str, float] | None:
    """The kernel's declared accuracy bound (its KernelSpec's, the one source of truth)."""
    from mla_sm120_plugin.dispatch import catalog

    spec = {catalog.TRITON: catalog.TRITON_SPEC, catalog.TRITON_FAST: catalog.TRITON_FAST_SPEC}.get(kernel)
    if spec is None or spec.accuracy is None:
        return None
    return dict(cos_diff=spec.accuracy.cos_diff, rel_rms=spec.accuracy.rel_rms, max_rel=spec.accuracy.max_rel)


def _measure(fn, ref: torch.Tensor, ceilings: dict[str, float], tokens: int, heads: int, quick: bool,
             kv_layout: str = layout.FP8_DS_MLA) -> dict[str, Any]:
    import triton.testing

    got = fn()[: ref.shape[0]]
    diff = (got.double() - ref.double()).abs().max().item()
    acc = measure(got, ref)  # ref: float64 over the dequantized rows
    rep = 20 if quick else 40
    eager_ms = triton.testing.do_bench(fn, warmup=5, rep=rep)
    graph_ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
    kv_bytes = tokens * TOPK * plan.row_bytes_read(kv_layout)
    flops = tokens * heads * TOPK * flops_per_candidate_head(kv_layout)
    gbps = kv_bytes / (graph_ms * 1e-3) / 1e9
    tflops = flops / (graph_ms * 1e-3) / 1e12
    return dict(eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3, host_us=(eager_ms - graph_ms) * 1e3,
                gbps=gbps, fraction_of_copy_bandwidth=gbps / ceilings["copy_gbps"],
                tflops=tflops, fraction_of_matmul=tflops / ceilings["matmul_tflops"],
                max_abs_diff=diff, max_rel_diff=acc.max_rel, cos_diff=acc.cos_diff, rel_rms=acc.rel_rms)


def _config_dict(cfg: plan.LaunchConfig) -> dict[str, Any]:
    return dict(num_splits=cfg.num_splits, chunk=cfg.blocks_per_split * cfg.block_k, block_h=cfg.block_h,
                block_k=cfg.block_k, warps=cfg.num_warps, stages=cfg.num_stages, maxnreg=cfg.maxnreg,
                partial_dtype=cfg.partial_dtype)


def _shape_row(tokens: int, heads: int, device: str, family: str, sm90: bool, ceilings: dict[str, float],
               quick: bool, kv_layout: str = layout.FP8_DS_MLA) -> dict[str, Any]:
    inputs = make_inputs(heads, TOPK, tokens, kv_layout, device=device)
    n_ref = min(tokens, REFERENCE_TOKENS)
    # float64 q: the reference computes in float64 throughout, over the rows as the cache holds them.
    ref = torch_sparse_mla(inputs["q"][:n_ref].double(), inputs["kv_cache"], inputs["indices"][:n_ref],
                           sm_scale=inputs["sm_scale"], kv_layout=inputs["kv_layout"])
    out = torch.empty(tokens, heads, layout.KV_LORA_RANK, dtype=torch.bfloat16, device=device)
    row: dict[str, Any] = dict(num_tokens=tokens, num_heads=heads, topk=TOPK, kv_layout=kv_layout,
                               scale_format=layout.SCALE_ARBITRARY, q_dtype="bf16",
                               kv_bytes=tokens * TOPK * plan.row_bytes_read(kv_layout),
                               flops=tokens * heads * TOPK * flops_per_candidate_head(kv_layout), kernels={})
    for kernel in TRITON_KERNELS:
        per_config: dict[str, Any] = {}
        for label, cfg in candidate_configs(kernel, tokens, heads, TOPK, family).items():
            entry: dict[str, Any] = dict(config=_config_dict(cfg), bound=_bound(kernel),
                                         traffic=plan.traffic(cfg, tokens, heads, TOPK, kv_layout=kv_layout).as_dict())
            if kernel == plan.FAST.name and sm90:
                entry["note"] = SM90_FAST_NOTE
            try:
                entry.update(_measure(_triton_fn(kernel, inputs, cfg, out), ref, ceilings, tokens, heads, quick,
                                      kv_layout))
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a result
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            per_config[label] = entry
        row["kernels"][kernel] = per_config
    for name in OTHER_KERNELS:
        try:
            row["kernels"][name] = {TABLE: _measure(_bound_fn(name, inputs, out), ref, ceilings, tokens, heads, quick,
                                                    kv_layout)}
        except Exception as exc:  # noqa: BLE001
            row["kernels"][name] = {TABLE: dict(error=f"{type(exc).__name__}: {str(exc)[:500]}")}
    return row


def run_gpu_benchmarks(device: str = "cuda", quick: bool = False, *, shapes: list[tuple[int, int]] | None = None,
                       compile_report: bool = True, progress=None, kv_layout: str = layout.FP8_DS_MLA) -> dict[str, Any]:
    """Every kernel and candidate configuration on :data:`SHAPES` over a ``kv_layout`` cache
    (JSON-serializable); see the module docstring. ``compile_report`` adds the compile gate's readings for this GPU's arch;
    ``progress``, if given, is called with the report so far after every shape (a run cut short
    by a time limit keeps what it measured)."""
    from mla_sm120_plugin.tools import compile_gate

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
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    family = plan.gpu_family(major, minor)
    report: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device), capability=f"{major}.{minor}", family=family,
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(), quick=quick,
        kv_layout=kv_layout,
        ceilings=measure_ceilings(device, quick),
        measures={k: v for k, v in (line.split(": ", 1) for line in _MEASURES)},
        fast_kernel_note=SM90_FAST_NOTE if major == 9 else None, results=[], compiled=None,
    )
    for tokens, heads in shapes or (SHAPES_QUICK if quick else SHAPES):
        report["results"].append(_shape_row(tokens, heads, device, family, major == 9, report["ceilings"], quick,
                                            kv_layout))
        torch.cuda.empty_cache()
        if progress is not None:
            progress(report)
    arch = major * 10 + minor
    if compile_report and arch in compile_gate.ARCHES:
        try:
            report["compiled"] = compile_gate.report(arch)
        except Exception as exc:  # noqa: BLE001 - e.g. an older Triton without the specialization API
            report["compiled"] = dict(error=f"{type(exc).__name__}: {str(exc)[:500]}")
    return report


_MEASURES = (
    "eager_us: triton.testing.do_bench median, host time included",
    "graph_us: triton.testing.do_bench_cudagraph, the call replayed from a CUDA graph",
    "host_us: eager_us - graph_us",
    "gbps: T * topk * row cache bytes (the bytes of a row the kernels load: 656, 528 rope-less) / graph time",
    "tflops: 2 * T * H * topk * (head_dim + 512) / graph time (head_dim 576, 512 rope-less)",
    "traffic: modeled bytes of the config's launches (plan.traffic), and its ratio to the minimum",
    "ceilings: copy_gbps (1 GiB device copy, read + written), matmul_tflops (bf16 n^3 matmul)",
)


def _table_entry(row: dict[str, Any], kernel: str) -> dict[str, Any]:
    return row["kernels"].get(kernel, {}).get(TABLE, {})


def plot(report: dict[str, Any], path: str) -> None:
    """Write :func:`figure` of ``report`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(report: dict[str, Any]) -> Any:
    """Per shape: GB/s and TFLOP/s of each kernel's table config against the measured ceilings, and
    the CUDA-graph time of every candidate config (a matplotlib figure of three axes)."""
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
    fig, axes = plt.subplots(3, 1, figsize=(max(8, len(rows) * 1.2), 11), sharex=True)
    width = 0.8 / len(KERNELS)
    for i, name in enumerate(KERNELS):
        xs = [j + i * width for j in range(len(rows))]
        axes[0].bar(xs, [_table_entry(r, name).get("gbps", 0) for r in rows], width, label=name)
        axes[1].bar(xs, [_table_entry(r, name).get("tflops", 0) for r in rows], width, label=name)
    axes[0].axhline(report["ceilings"]["copy_gbps"], color="k", linestyle="--", label="copy bandwidth")
    axes[1].axhline(report["ceilings"]["matmul_tflops"], color="k", linestyle="--", label="bf16 matmul")
    series = sorted({(k, label) for r in rows for k in TRITON_KERNELS for label in r["kernels"].get(k, {})})
    cand_width = 0.8 / max(len(series), 1)
    for i, (kernel, label) in enumerate(series):
        xs = [j + i * cand_width for j in range(len(rows))]
        axes[2].bar(xs, [r["kernels"].get(kernel, {}).get(label, {}).get("graph_us", 0) for r in rows], cand_width,
                    label=f"{kernel.replace('triton_sparse_mla', 'triton')} {label}")
    axes[2].set_yscale("log")
    axes[0].set_ylabel("GB/s (cache bytes / graph time)")
    axes[1].set_ylabel("TFLOP/s")
    axes[2].set_ylabel("graph us (every candidate config)")
    axes[2].set_xticks([j + 0.4 for j in range(len(rows))], labels)
    note = f"\n{report['fast_kernel_note']}" if report.get("fast_kernel_note") else ""
    axes[0].set_title(f"sparse MLA, {report.get('kv_layout', layout.FP8_DS_MLA)}, topk {TOPK}, bf16 q - "
                      f"{report['device']}{note}", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
