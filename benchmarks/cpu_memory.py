"""CPU memory harness for the torch reference (``python benchmarks/bench_kernels.py --device cpu``).

Lives outside the runtime package because it uses torch's private dispatch APIs. The memory-bounded
torch reference runs against a naive full-gather baseline (every candidate key of every token
gathered and dequantized at once), at a few model shapes: time and peak memory, two ways:

* ``peak_live_tensor_bytes``: the largest total size of tensors created by torch ops during the
  call and alive at once (inputs excluded), tracked op by op with :class:`LiveTensorPeak`;
  deterministic, but blind to scratch a single op allocates internally.
* ``peak_rss_rise_bytes``: how far one call raises the process's resident-memory high-water mark
  above the RSS at its start (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``;
  ``ru_maxrss`` elsewhere), in a fresh subprocess after the inputs are built. Includes allocator
  slack and untracked scratch; undercounts when the call reuses memory the allocator kept.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.tools.bench import make_inputs
from mla_sm120_plugin.kernels.dsa.reference import DEFAULT_MAX_CHUNK_BYTES, torch_sparse_mla

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


def _call(bound: int | None, inputs: dict[str, Any]):
    if bound is None:
        return naive_full_gather(**inputs)
    return torch_sparse_mla(**inputs, max_chunk_bytes=bound)


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


RSS_METHODS = ("vmhwm", "sampled", "ru_maxrss")


def _sampled_peak(fn: Callable[[], Any], period_s: float = 2e-4) -> int:
    """The largest ``VmRSS`` a thread sees, reading it every ``period_s`` while ``fn`` runs (and once
    after), minus the RSS before: for a kernel whose temporaries live for milliseconds or more."""
    import threading

    before = _proc_status_bytes("VmRSS")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _proc_status_bytes("VmRSS"))
            done.wait(period_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _proc_status_bytes("VmRSS")) - before


def _peak_rss_rise(fn: Callable[[], Any], method: str | None = None) -> tuple[int, str]:
    """How far one call of ``fn`` raises resident memory above the RSS before it, and how it was read.

    ``vmhwm`` (Linux, the default where it works): reset the high-water mark to the current RSS
    (``/proc/self/clear_refs`` = 5), run, read ``VmHWM``. ``sampled`` (Linux, where clear_refs is not
    writable, as in some containers): a thread's readings of ``VmRSS`` during the call. ``ru_maxrss``
    (elsewhere): the process's lifetime peak, which a fresh interpreter's imports may already have
    set above anything the call adds, so a rise of 0 there means "not measurable", not "no memory".
    """
    if method in (None, "vmhwm"):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            if method == "vmhwm":
                raise
        else:
            before = _proc_status_bytes("VmRSS")
            fn()
            return _proc_status_bytes("VmHWM") - before, "vmhwm"
    if method in (None, "sampled") and os.path.exists("/proc/self/status"):
        return _sampled_peak(fn), "sampled"
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * scale, "ru_maxrss"


def _peak_in_subprocess(bound: int | None, shape: dict[str, int], method: str | None = None) -> int | None:
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import cpu_memory; "
        f"print(json.dumps(cpu_memory._rss_rise({bound!r}, {shape!r}, {method!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def _rss_rise(bound: int | None, shape: dict[str, int], method: str | None = None) -> int:
    inputs = make_inputs(**shape)
    return _peak_rss_rise(lambda: _call(bound, inputs), method)[0]


def _cpu_results(quick: bool, kinds: dict[str, int | None], rss_method: str | None = None) -> list[dict[str, Any]]:
    rows = []
    for shape in CPU_SHAPES_QUICK if quick else CPU_SHAPES:
        inputs = make_inputs(**shape)
        row: dict[str, Any] = dict(shape, kv_layout=layout.FP8_DS_MLA)
        outs = {}
        for kind, bound in kinds.items():
            externals = [inputs["q"], inputs["kv_cache"], inputs["indices"]]
            with LiveTensorPeak(externals) as mode:
                outs[kind] = _call(bound, inputs)
            seconds = _median_seconds(lambda: _call(bound, inputs), repeats=1 if quick else 3)
            row[kind] = dict(
                max_chunk_bytes=bound,
                seconds=seconds,
                peak_live_tensor_bytes=mode.peak,
                peak_rss_rise_bytes=_peak_in_subprocess(bound, shape, rss_method),
            )
        base = row["naive_full_gather"]
        for kind in kinds:
            if kinds[kind] is None:
                continue
            row[kind]["time_ratio_over_naive"] = row[kind]["seconds"] / base["seconds"]
            row[kind]["live_peak_ratio_over_naive"] = row[kind]["peak_live_tensor_bytes"] / base["peak_live_tensor_bytes"]
            row[kind]["max_abs_diff_vs_naive"] = (outs[kind].float() - outs["naive_full_gather"].float()).abs().max().item()
        rows.append(row)
    return rows


def run_cpu_benchmarks(quick: bool = False, kinds: dict[str, int | None] | None = None,
                       rss_method: str | None = None) -> dict[str, Any]:
    """The CPU report: environment, what each number measures, one row per shape (JSON-serializable).

    kinds: which callables to measure (name -> the reference's max_chunk_bytes, None for the naive
    gather); default :data:`CPU_KINDS`. rss_method: one of :data:`RSS_METHODS`, or None for the best
    this machine allows (:func:`_peak_rss_rise`).
    """
    return dict(
        device="cpu",
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_threads=torch.get_num_threads(),
        quick=quick,
        measures=dict(
            seconds="median wall time of one call (after one warm-up call)",
            peak_live_tensor_bytes="max total bytes of op-created tensors alive at once, inputs excluded",
            peak_rss_rise_bytes="rise of resident memory during one call, in a fresh subprocess ("
                                "VmHWM reset before the call, else sampled VmRSS, else ru_maxrss)",
            naive_full_gather="all T x topk keys gathered and dequantized to fp32 at once",
        ),
        cpu=_cpu_results(quick, kinds or CPU_KINDS, rss_method),
    )
