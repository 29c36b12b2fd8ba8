"""Kernel benchmarks with machine-readable results (``mla-sm120 bench``, ``benchmarks/bench_kernels.py``).

CPU: the memory-bounded torch reference against a naive full-gather baseline (every candidate key
of every token gathered and dequantized at once), at a few model shapes: time and peak memory.
Peak memory is reported two ways, both stated in the output:

* ``peak_live_tensor_bytes``: the largest total size of tensors created by torch ops during the
  call and alive at once (inputs excluded), tracked op by op with :class:`LiveTensorPeak`;
  deterministic, but blind to scratch a single op allocates internally.
* ``peak_rss_rise_bytes``: how far one call raises the process's resident-memory high-water mark
  above the RSS at its start (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``;
  ``ru_maxrss`` elsewhere), in a fresh subprocess after the inputs are built. Includes allocator
  slack and untracked scratch; undercounts when the call reuses memory the allocator kept.

GPU (``torch.cuda.is_available()``): the Triton kernel, FlashInfer's (when it can run) and the
reference against the memory-bandwidth roofline, bytes = T * topk * token_bytes (the cache bytes
the kernel must read; q, indices and output are ignored), reported as GB/s and fraction of the
device's peak bandwidth (:data:`PEAK_GBPS`, or ``peak_gbps``).
"""

from __future__ import annotations

import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mla_sm120_plugin.kernels.catalog import BUILTIN_KERNELS
from mla_sm120_plugin.kernels import layout, pack
from mla_sm120_plugin.kernels.reference import DEFAULT_MAX_CHUNK_BYTES, torch_sparse_mla

# Peak DRAM bandwidth by device-name substring (FACTS.md section 5 and vendor sheets), GB/s.
PEAK_GBPS = {
    "RTX 5090": 1792.0,
    "RTX PRO 6000": 1792.0,
    "GB10": 273.0,
    "H200": 4800.0,
    "H100": 3350.0,
    "B200": 8000.0,
    "RTX 4090": 1008.0,
}

CPU_SHAPES_QUICK = [dict(num_heads=16, topk=2048, num_tokens=16)]
CPU_SHAPES = [
    dict(num_heads=16, topk=2048, num_tokens=16),
    dict(num_heads=64, topk=2048, num_tokens=64),
    dict(num_heads=128, topk=512, num_tokens=64),
]
# The reference runs at its default bound and at a tight one, to show what the bound costs.
SMALL_CHUNK_BYTES = 32 * 1024 * 1024
CPU_KINDS = {
    "torch_sparse_mla": DEFAULT_MAX_CHUNK_BYTES,
    "torch_sparse_mla_32MiB": SMALL_CHUNK_BYTES,
    "naive_full_gather": None,
}
GPU_TOPK = 2048
GPU_HEADS = (8, 16, 64, 128)
GPU_TOKENS = (1, 16, 64, 512)
GPU_HEADS_QUICK = (16, 64)
GPU_TOKENS_QUICK = (1, 64)


class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of live tensor storages created by torch ops inside the mode (inputs excluded).

    Each op's outputs are counted once per storage and released when their last tensor dies, so
    scratch that an op allocates and frees internally is not seen: a lower bound on the true peak.
    """

    def __init__(self, external: list[torch.Tensor]):
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in external}
        self.live: dict[int, list[int]] = {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0 or key in self.external:
                continue
            if key in self.live:
                self.live[key][1] += 1
            else:
                self.live[key] = [t.untyped_storage().nbytes(), 1]
                self.current += self.live[key][0]
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return result


def naive_full_gather(q, kv_cache, indices, *, sm_scale, kv_layout):
    """Baseline: gather and dequantize every candidate of every token at once (no chunking).

    q: [T, H, 576], kv_cache: [P, page, W], indices: [T, topk] int32 -> out [T, H, 512] q's dtype
    """
    flat = pack.flat_view(kv_cache)  # [S, W]
    num_slots = flat.shape[0]
    idx = indices.long()
    valid = (idx >= 0) & (idx < num_slots)  # [T, K]
    raw = flat[torch.where(valid, idx, 0)]  # [T, K, W]
    keys = pack.dequantize_fp8_ds_mla(raw) if kv_layout == layout.FP8_DS_MLA else raw.float()  # [T, K, 576]
    keys = keys.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale  # [T, H, K]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [T, H, K]
    return torch.einsum("thk,tkd->thd", probs, keys[..., : layout.KV_LORA_RANK]).to(q.dtype)


def make_inputs(num_heads: int, topk: int, num_tokens: int, kv_layout: str = layout.FP8_DS_MLA,
                device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Random q, a cache with ``max(2 * topk, 4096)`` filled slots, and in-range indices."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = math.ceil(max(2 * topk, 4096) / layout.PAGE_SIZE)
    num_slots = num_pages * layout.PAGE_SIZE
    cache = pack.make_cache(num_pages, kv_layout)
    # Written a page at a time so that building inputs sets a low memory high-water mark (the
    # subprocess peak measurement can only see a call that rises above it).
    for page in range(num_pages):
        latent = torch.randn(layout.PAGE_SIZE, layout.HEAD_DIM, generator=gen)
        tokens = (pack.quantize_fp8_ds_mla(latent, layout.SCALE_ARBITRARY) if kv_layout == layout.FP8_DS_MLA
                  else pack.pack_bf16(latent))
        pack.write_to_cache(cache, tokens, page * layout.PAGE_SIZE + torch.arange(layout.PAGE_SIZE))
    indices = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, dtype=torch.int32)
    q = torch.randn(num_tokens, num_heads, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    return dict(q=q.to(device), kv_cache=cache.to(device), indices=indices.to(device),
                sm_scale=layout.HEAD_DIM**-0.5, kv_layout=kv_layout)


def _call(kind: str, inputs: dict[str, Any]):
    if CPU_KINDS[kind] is None:
        return naive_full_gather(**inputs)
    return torch_sparse_mla(**inputs, max_chunk_bytes=CPU_KINDS[kind])


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise OSError(f"{field} not in /proc/self/status")


def _peak_rss_rise(fn: Callable[[], Any]) -> tuple[int, str]:
    """How far one call of ``fn`` raises the resident-memory high-water mark, and how it was read.

    Linux: reset the high-water mark to the current RSS (``/proc/self/clear_refs`` = 5), run, read
    ``VmHWM`` minus the RSS before. Elsewhere ``ru_maxrss``, which a child inherits from its parent
    at fork on Linux, hence not the first choice.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_bytes("VmRSS")
        fn()
        return _proc_status_bytes("VmHWM") - before, "VmHWM after clear_refs"
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fn()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * scale, "ru_maxrss"


def _peak_in_subprocess(kind: str, shape: dict[str, int]) -> int | None:
    code = (
        "import json, sys; from mla_sm120_plugin.kernels import bench; "
        f"print(json.dumps(bench._rss_rise({kind!r}, {shape!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def _rss_rise(kind: str, shape: dict[str, int]) -> int:
    inputs = make_inputs(**shape)
    return _peak_rss_rise(lambda: _call(kind, inputs))[0]


def _cpu_results(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for shape in CPU_SHAPES_QUICK if quick else CPU_SHAPES:
        inputs = make_inputs(**shape)
        row: dict[str, Any] = dict(shape, kv_layout=layout.FP8_DS_MLA)
        outs = {}
        for kind, bound in CPU_KINDS.items():
            externals = [inputs["q"], inputs["kv_cache"], inputs["indices"]]
            with LiveTensorPeak(externals) as mode:
                outs[kind] = _call(kind, inputs)
            seconds = _median_seconds(lambda: _call(kind, inputs), repeats=1 if quick else 3)
            row[kind] = dict(
                max_chunk_bytes=bound,
                seconds=seconds,
                peak_live_tensor_bytes=mode.peak,
                peak_rss_rise_bytes=_peak_in_subprocess(kind, shape),
            )
        base = row["naive_full_gather"]
        for kind in CPU_KINDS:
            if CPU_KINDS[kind] is None:
                continue
            row[kind]["time_ratio_over_naive"] = row[kind]["seconds"] / base["seconds"]
            row[kind]["live_peak_ratio_over_naive"] = row[kind]["peak_live_tensor_bytes"] / base["peak_live_tensor_bytes"]
            row[kind]["max_abs_diff_vs_naive"] = (outs[kind].float() - outs["naive_full_gather"].float()).abs().max().item()
        rows.append(row)
    return rows


def _peak_for(name: str, override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override, "--peak-gbps"
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps, f"table entry {key!r}"
    return None, "unknown device: pass --peak-gbps"


def _compiled_shared_bytes() -> int | None:
    """Largest shared-memory size among the compiled Triton sparse-MLA kernels (None if unknown)."""
    try:
        from mla_sm120_plugin.kernels import triton as tk

        sizes = []
        for cache in tk._sparse_mla_kernel.device_caches.values():
            for compiled in cache[0].values():
                sizes.append(int(compiled.metadata.shared))
        return max(sizes) if sizes else None
    except Exception:  # noqa: BLE001 - Triton's cache layout is internal and changes between versions
        return None


def _gpu_results(device: str, quick: bool, peak_gbps: float | None) -> dict[str, Any]:
    import triton.testing

    from mla_sm120_plugin.kernels import api

    name = torch.cuda.get_device_name(device)
    peak, peak_source = _peak_for(name, peak_gbps)
    rows = []
    for heads in GPU_HEADS_QUICK if quick else GPU_HEADS:
        for tokens in GPU_TOKENS_QUICK if quick else GPU_TOKENS:
            inputs = make_inputs(heads, GPU_TOPK, tokens, device=device)
            kv_bytes = tokens * GPU_TOPK * layout.FP8_DS_MLA_TOKEN_BYTES
            row: dict[str, Any] = dict(num_heads=heads, topk=GPU_TOPK, num_tokens=tokens,
                                       kv_layout=layout.FP8_DS_MLA, kv_bytes=kv_bytes)
            if peak:
                row["roofline_us"] = kv_bytes / (peak * 1e9) * 1e6
            ref = torch_sparse_mla(**inputs)
            for kernel in BUILTIN_KERNELS:
                extra = {"scale_format": layout.SCALE_ARBITRARY} if kernel == "flashinfer_sparse_mla" else {}

                def fn(kernel=kernel, extra=extra):
                    return api.sparse_mla_forward(**inputs, kernel=kernel, **extra)

                try:
                    diff = (fn().float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a result
                    row[kernel] = dict(error=f"{type(exc).__name__}: {exc}")
                    continue
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                row[kernel] = dict(us=ms * 1e3, gbps=gbps, max_abs_diff_vs_reference=diff,
                                   fraction_of_peak=gbps / peak if peak else None)
            rows.append(row)
    return dict(device_name=name, peak_gbps=peak, peak_source=peak_source,
                triton_shared_memory_bytes=_compiled_shared_bytes(), results=rows)


def run_benchmarks(quick: bool = False, device: str | None = None, peak_gbps: float | None = None) -> dict:
    """Run the benchmarks for ``device`` ("cpu", "cuda", "cuda:N"; default: cuda when available).

    Returns a JSON-serializable dict: environment, what each number measures, and one row per shape.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = dict(
        device=device,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_threads=torch.get_num_threads(),
        quick=quick,
    )
    if device == "cpu":
        report["measures"] = dict(
            seconds="median wall time of one call (after one warm-up call)",
            peak_live_tensor_bytes="max total bytes of op-created tensors alive at once, inputs excluded",
            peak_rss_rise_bytes="rise of the RSS high-water mark (VmHWM, reset before the call) in a fresh subprocess",
            naive_full_gather="all T x topk keys gathered and dequantized to fp32 at once",
        )
        report["cpu"] = _cpu_results(quick)
    else:
        report["measures"] = dict(
            us="triton.testing.do_bench median, microseconds",
            kv_bytes="T * topk * 656: cache bytes a call must read (the roofline numerator)",
            gbps="kv_bytes / time",
        )
        report["gpu"] = _gpu_results(device, quick, peak_gbps)
    return report
