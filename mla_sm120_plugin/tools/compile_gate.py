"""Compile every Triton kernel variant the dispatcher can launch, for a GPU this machine need not have.

The interpreter runs a kernel as Python (both branches of a constexpr ``if``, no register
allocation), so a kernel that passes every CPU test can still fail to compile, or spill, on a
GPU. :func:`launches` builds each variant the way a launch would (the kernels' own launch
plans); :func:`compile_launch` compiles it with ``triton.compile`` for a :class:`GPUTarget` and
reads, from the tools Triton bundles, its registers and spills (``ptxas -v``), shared memory,
static resources (``cuobjdump -res-usage``), SASS MMA and global-load kinds (``nvdisasm``) and
CTAs per SM (:func:`ctas_per_sm`, from :data:`SM_LIMITS`).

:func:`gate_failures` is the gate: every variant compiles, without spills (except where its caches
are served only on other arches, :data:`SERVED_ONLY_ON`), within a block's shared memory; fast fp8
variants on sm_120a/121a run their latent dots as ``QMMA.SF`` and fit the CTAs per SM the launch
plan assumes, under the bundled ptxas and a CUDA >= 13 one (:func:`system_ptxas`); on sm_120a/121a
every streaming kernel keeps a DRAM latency's bytes in flight per SM (CTAs x candidates a step x
row bytes x (stages - 1, at least 1) >= :func:`latency_bytes_per_sm`), and every DeepSeek-V4
variant's loop costs what its plan's model counts (:func:`dsv4_model_failures`). Used by
``mla-sm120 bench --compile-only --arch 120 --json`` and by the test suite. More:
docs/kernels.md, section ``tools/compile_gate.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mla_sm120_plugin.kernels.dsa import layout

# Compute capability as Triton's GPUTarget takes it -> shared memory one block may use (bytes).
ARCHES = {120: 101_376, 121: 101_376, 90: 232_448}
WARP_SIZE = 32
# Per-SM limits (CUDA C Programming Guide, compute capabilities table): 32-bit registers, shared
# memory, resident threads and CTAs; registers are allocated per warp in units of 256 (8 a
# thread), and the driver reserves 1 KB of shared memory per CTA.
SM_LIMITS = {
    120: dict(registers=65_536, shared=102_400, threads=1_536, ctas=32),
    121: dict(registers=65_536, shared=102_400, threads=1_536, ctas=32),
    90: dict(registers=65_536, shared=233_472, threads=2_048, ctas=32),
}
_REG_UNIT = 256
_RESERVED_SHARED_PER_CTA = 1_024
FAST_KERNEL = "sparse_mla_fast"  # the variants the fp8 rules apply to (their describe's kernel=)
FP8_MMA_ARCHES = (120, 121)  # where a fast variant must show QMMA.SF and the plan's CTAs per SM
FP8_MMA_KIND = "QMMA.SF.16832.F32.E4M3.E4M3.E8"  # the full-rate (block-scaled) fp8 MMA on SM12x
# Layouts the plugin serves on some arches only -> those arches. nvfp4_ds_mla: the policy serves it
# on SM12x alone (vLLM reads it with FlashMLA on SM100 and nowhere else); on sm_90a its exact-kernel
# variants compile but spill (255 registers, 4-24 bytes: the e2m1 decode's extra live values), a cost
# no served configuration pays.
SERVED_ONLY_ON = {layout.NVFP4_DS_MLA: (120, 121)}
DSV4_KERNEL = "dsv4"
# The main kernels whose loads must cover a DRAM latency on SM12x (the residency rule:
# :func:`bytes_in_flight` >= :func:`latency_bytes_per_sm`); the combine and the writers read little.
STREAMING_KERNELS = ("sparse_mla", FAST_KERNEL, DSV4_KERNEL)
_REPRESENTATIVE_TOKENS = 4  # strides below come from a [4, H, 576] q; any T > 1 specializes the same
_REPRESENTATIVE_HEADS = 40  # not a multiple of 16, so head strides specialize as in the worst case


def _describe(describe: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in describe.items())


def launches() -> list[Any]:
    """One :class:`~mla_sm120_plugin.kernels.shared.triton.Launch` per distinct variant the dispatcher can
    launch: for the exact kernel, cache layout (every one of ``layout.KV_LAYOUTS``, rope-less ones
    included) x output dtype (q's: bf16 or fp32; q itself is always bf16 on a GPU) x final/split;
    for the fast kernel the same over the fp8 layouts (``layout.FP8_LAYOUTS``; a bf16 cache goes to
    the exact kernel); with the combine kernel for each partial and output dtype. Built by the same
    ``launch_plan`` a call runs, on small CPU tensors in each layout's own geometry (q as wide as
    its ``head_dim``, rows of its ``row``; never launched).

    Launches whose compiled code is the same (:func:`_compiled_identity`: same kernel, specialized
    signature, constexprs and options) are one variant, compiled once: its ``cache`` names every
    layout it serves (``fp8_ds_mla_nope+fp8_nope``: the 656- and 528-byte rope-less rows differ
    only in the row stride, a runtime argument specialized alike)."""
    import torch

    from mla_sm120_plugin.kernels.dsa import pack
    from mla_sm120_plugin.kernels.dsa import triton as tk
    from mla_sm120_plugin.kernels.dsa import triton_fast as tf
    from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

    tokens, heads = _REPRESENTATIVE_TOKENS, _REPRESENTATIVE_HEADS
    found: dict[tuple, Any] = {}
    kinds = [(tk.launch_plan, cfg, layout.KV_LAYOUTS) for cfg in tk.launch_variants()]
    kinds += [(tf.launch_plan, dsa_plan.FAST.config(splits, 2), layout.FP8_LAYOUTS) for splits in (1, 2)]
    for make_plan, cfg, cache_layouts in kinds:
        for cache_layout in cache_layouts:
            for q_dtype in (torch.bfloat16, torch.float32):
                q = torch.empty(tokens, heads, layout.get(cache_layout).head_dim, dtype=q_dtype)
                plan = make_plan(
                    q, pack.make_cache(2, cache_layout), torch.empty(tokens, 64, dtype=torch.int32),
                    sm_scale=0.1, kv_layout=cache_layout, topk_length=torch.empty(tokens, dtype=torch.int32),
                    sink=torch.empty(heads), out=torch.empty(tokens, heads, layout.KV_LORA_RANK, dtype=q_dtype),
                    lse=torch.empty(tokens, heads), lse_base="e", cfg=cfg, interpret=False,
                )
                for launch in plan:
                    key = _compiled_identity(launch)
                    seen = found.get(key)
                    if seen is None:
                        found[key] = launch
                    elif "cache" in launch.describe and cache_layout not in seen.describe["cache"].split("+"):
                        found[key] = dataclasses.replace(seen, describe={
                            **seen.describe, "cache": f"{seen.describe['cache']}+{cache_layout}"})
    unique: dict[tuple, Any] = {}
    for launch in [*found.values(), *dsv4_launches()]:
        unique.setdefault(_compiled_identity(launch), launch)  # the combine both families share, once
    return list(unique.values())


def dsv4_launches() -> list[Any]:
    """The DeepSeek-V4 kernel's variants as the engines call it (lengths and sinks always given): the
    window cache alone and with a compressed cache, for each record it reads (the 584-byte fp8 one,
    the 384-byte NVFP4 one), unsplit and split (with the combine); its page sizes, strides and the
    split's range are runtime values."""
    import torch

    from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout
    from mla_sm120_plugin.kernels.dsv4 import pack as dsv4_pack
    from mla_sm120_plugin.kernels.dsv4 import plan as dsv4_plan
    from mla_sm120_plugin.kernels.dsv4 import triton as dsv4_triton

    tokens, heads = _REPRESENTATIVE_TOKENS, _REPRESENTATIVE_HEADS
    q = torch.empty(tokens, heads, dsv4_triton.REC.head_dim, dtype=torch.bfloat16)
    indices, lengths = torch.empty(tokens, 128, dtype=torch.int32), torch.empty(tokens, dtype=torch.int32)
    found = []
    for record in dsv4_layout.ALL_RECORDS.values():
        window = dsv4_pack.new_cache(2, 64, record=record)
        compressed = dsv4_pack.new_cache(2, 2, record=record)
        base = dsv4_plan.shape_of(record).config
        for extra, splits in ((False, 1), (True, 1), (False, 2), (True, 2)):
            for launch in dsv4_triton.launch_plan(
                    q, torch.empty_like(q), window, indices, 64, sm_scale=0.04, swa_lengths=lengths,
                    extra_cache=compressed if extra else None, extra_indices=indices if extra else None,
                    extra_lengths=lengths if extra else None, extra_page_size=2 if extra else None,
                    sinks=torch.empty(heads), record=record, cfg=base.split(splits, 3)):
                found.append(dataclasses.replace(launch, describe={**launch.describe, "cache": record.name}))
    return found + dsv4_writer_launches()


def dsv4_writer_launches() -> list[Any]:
    """The NVFP4 record's writers as vLLM's layer runs them: the window rows, and the compressor's rows
    for each compression vLLM's DeepSeek-V4 has (C4A: 8 overlapping states, C128A: 128)."""
    import torch

    from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout
    from mla_sm120_plugin.kernels.dsv4 import nvfp4_writer as writer
    from mla_sm120_plugin.kernels.dsv4 import pack as dsv4_pack

    tokens = _REPRESENTATIVE_TOKENS
    rec = dsv4_layout.NVFP4_RECORD
    cache = dsv4_pack.new_cache(2, 64, record=rec)
    slots, positions = torch.empty(tokens, dtype=torch.int64), torch.empty(tokens, dtype=torch.int64)
    cos_sin = torch.empty(4096, dsv4_layout.ROPE_DIM, dtype=torch.float32)
    found = [writer.window_launch(torch.empty(tokens, rec.head_dim, dtype=torch.bfloat16), slots, positions, cos_sin,
                                  cache, 64, cache.stride(0), 128)]
    for ratio, overlap, block in ((4, True, 4), (128, False, 8)):
        width = (1 + overlap) * rec.head_dim
        found.append(writer.compress_launch(
            slots, torch.empty(8, block, 2 * width, dtype=torch.float32), slots, torch.empty(tokens, dtype=torch.int32),
            torch.empty(4, 64, dtype=torch.int32), block, width, positions, ratio, (1 + overlap) * ratio,
            torch.empty(rec.head_dim, dtype=torch.bfloat16), 1e-6, cos_sin, cache, 64, cache.stride(0), 128))
    return found


def _compiled_identity(launch: Any) -> tuple:
    """What decides a launch's compiled code: its kernel, the signature, constexprs and attributes
    Triton's launcher derives from its arguments, and the compile options (the target aside)."""
    signature, consts, attrs = _specialize(launch.kernel, list(launch.args), launch.constexprs, 120)
    return (launch.kernel, repr(signature), repr(sorted(consts.items())), repr(sorted(attrs.items())),
            launch.num_warps, launch.num_stages, launch.maxnreg)


def _specialize(kernel: Any, args: list[Any], constexprs: dict[str, Any], arch: int) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attributes exactly as Triton's launcher derives them from ``args``."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    backend = CUDABackend(GPUTarget("cuda", arch, WARP_SIZE))
    signature: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    positional = iter(args)
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            consts[param.name] = constexprs[param.name]
            continue
        value = next(positional)
        kind, spec = native_specialize_impl(backend, value, param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":  # Triton folds an int argument equal to 1
            consts[param.name] = spec
        elif isinstance(spec, str):
            attrs[(index,)] = backend.parse_attr(spec)
    return signature, consts, attrs


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_resources(ptx: str, arch: int) -> dict[str, int]:
    """Registers, stack frame and spill bytes of ``ptx``, from the ptxas that Triton bundles."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}",
             str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, timeout=600,
        )
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log.strip()[-500:]}")
    regs, spills = _REGS.search(log), _SPILLS.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log.strip()[-500:]}")
    return dict(registers=int(regs.group(1)), stack_bytes=int(spills.group(1)),
                spill_bytes=int(spills.group(2)), spill_load_bytes=int(spills.group(3)))


def _bundled_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# An instruction line of nvdisasm -c: /*0420*/  [@[!]P0]  OPCODE.MODIFIERS operands ;
_SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def _mma_counts(opcodes: list[str]) -> dict[str, int]:
    """The MMA instructions among SASS ``opcodes`` (``HMMA``, ``QMMA.SF``, ...: an MMA opcode), by kind."""
    counts: dict[str, int] = {}
    for name in opcodes:
        if "MMA" in name.split(".")[0]:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _longest_loop(sass: str) -> tuple[int, dict[str, int]]:
    """The longest loop body of ``nvdisasm -c`` text (from a label to a branch back to it): its
    instructions (a thread's, one iteration) and its MMAs by kind; ``(0, {})`` where there is none.
    A kernel's inner loop, whose instructions a step costs, is its longest."""
    body: list[str] = []
    at: dict[str, int] = {}
    best: tuple[int, dict[str, int]] = (0, {})
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            at[label.group(1)] = len(body)
            continue
        op = _SASS_OPCODE.search(line)
        if op is None:
            continue
        body.append(op.group(1))
        target = _SASS_TARGET.search(line)
        if op.group(1).startswith("BRA") and target and target.group(1) in at:
            loop = body[at[target.group(1)]:]
            if len(loop) > best[0]:
                best = (len(loop), _mma_counts(loop))
    return best


def _cubin_readings(cubin: bytes) -> dict[str, Any]:
    """Registers, stack, static shared memory (``cuobjdump -res-usage``), SASS MMA kinds and
    global-load kinds with their counts, and the longest loop's instructions and MMAs
    (:func:`_longest_loop`; ``nvdisasm -c``), from the cubin Triton built."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([_bundled_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True,
                               text=True, timeout=600)
        sass = subprocess.run([_bundled_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True,
                              timeout=600)
    found = _RES_USAGE.search(usage.stdout)
    if usage.returncode != 0 or found is None or sass.returncode != 0:
        raise RuntimeError(f"cuobjdump/nvdisasm failed: {(usage.stderr + sass.stderr).strip()[-500:]}")
    opcodes = [op.group(1) for op in map(_SASS_OPCODE.search, sass.stdout.splitlines()) if op is not None]
    loads: dict[str, int] = {}
    for name in opcodes:
        if name.startswith(("LDG", "LDGSTS")) and not name.startswith("LDGDEPBAR"):
            loads[name] = loads.get(name, 0) + 1
    loop_instructions, loop_mma = _longest_loop(sass.stdout)
    return dict(cubin_registers=int(found.group(1)), cubin_stack_bytes=int(found.group(2)),
                static_shared_bytes=int(found.group(3)), local_bytes=int(found.group(4)),
                mma=_mma_counts(opcodes), global_loads=dict(sorted(loads.items())),
                loop_instructions=loop_instructions, loop_mma=loop_mma)


def ctas_per_sm(arch: int, registers: int, warps: int, shared_bytes: int) -> tuple[int, str]:
    """CTAs of a kernel one SM of ``sm_<arch>`` holds, and the limit that decides it
    (``registers``, ``shared`` or ``threads``); ``shared_bytes`` is the CTA's dynamic + static."""
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-registers * WARP_SIZE // _REG_UNIT) * _REG_UNIT
    by = dict(
        registers=lim["registers"] // (regs_per_warp * warps),
        shared=lim["shared"] // (shared_bytes + _RESERVED_SHARED_PER_CTA),
        threads=lim["threads"] // (warps * WARP_SIZE),
        ctas=lim["ctas"],
    )
    limit = min(by, key=by.get)
    return by[limit], limit


def compile_launch(launch: Any, arch: int) -> dict[str, Any]:
    """Compile one launch's variant for ``sm_<arch>a``; a failure is a result (``compiled: False``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row: dict[str, Any] = dict(variant=_describe(launch.describe), compiled=False, registers=None,
                               spill_bytes=None, spill_load_bytes=None, stack_bytes=None, shared_bytes=None,
                               ctas_per_sm=None, ctas_limited_by=None, step_bytes=None, bytes_in_flight=None,
                               mma=None, global_loads=None, loop_instructions=None, loop_mma=None,
                               instructions_per_candidate=None, error=None, **launch.describe)
    try:
        signature, consts, attrs = _specialize(launch.kernel, list(launch.args), launch.constexprs, arch)
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        if getattr(launch, "maxnreg", None) is not None:
            options["maxnreg"] = launch.maxnreg
        compiled = triton.compile(ASTSource(fn=launch.kernel, signature=signature, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, WARP_SIZE), options=options)
        # ptxas -v and the disassembler (~3 s a variant) are separate processes: run them side by side.
        with ThreadPoolExecutor(max_workers=2) as pool:
            resources = pool.submit(_ptxas_resources, compiled.asm["ptx"], arch)
            readings = pool.submit(_cubin_readings, compiled.asm["cubin"])
            row.update(resources.result())
            row.update(readings.result())
        row["shared_bytes"] = int(compiled.metadata.shared)
        row["ctas_per_sm"], row["ctas_limited_by"] = ctas_per_sm(
            arch, row["cubin_registers"], launch.num_warps, row["shared_bytes"] + row["static_shared_bytes"])
        # bytes in flight per SM: CTAs x one step's rows x the steps a pipelined loop keeps ahead
        row["step_bytes"] = step_bytes(launch.describe)
        if row["step_bytes"] is not None:
            row["bytes_in_flight"] = row["ctas_per_sm"] * row["step_bytes"] * max(1, launch.num_stages - 1)
        candidates = launch.describe.get("block_n") or launch.describe.get("block_k")
        if candidates and row["loop_instructions"]:
            # warp instructions a candidate: a step's loop body, in every warp, over its candidates
            row["instructions_per_candidate"] = round(row["loop_instructions"] * launch.num_warps / candidates, 1)
        row["compiled"] = True
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is what this reports
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[-800:]}"
    return row


def gate_failures(arch: int, rows: list[dict[str, Any]]) -> list[str]:
    """Why the variants of ``arch`` fail the gate (empty: they pass); see the module docstring."""
    failures = []
    for r in rows:
        if not r["compiled"]:
            failures.append(f"{r['variant']}: does not compile: {r['error']}")
            continue
        caches = str(r.get("cache", "")).split("+")
        served = all(arch in SERVED_ONLY_ON.get(c, (arch,)) for c in caches)
        if served and (r["spill_bytes"] or r["stack_bytes"] or r["local_bytes"]):
            failures.append(f"{r['variant']}: spills ({r['spill_bytes']} B spilled, {r['stack_bytes']} B stack)")
        if r["shared_bytes"] > ARCHES[arch]:
            failures.append(f"{r['variant']}: {r['shared_bytes']} B of shared memory > {ARCHES[arch]} B a block")
        if (r["kernel"] in STREAMING_KERNELS and arch in FP8_MMA_ARCHES
                and (r.get("bytes_in_flight") or 0) < latency_bytes_per_sm(arch)):
            failures.append(f"{r['variant']}: {r.get('bytes_in_flight')} B in flight per SM ({r['ctas_per_sm']} CTA x "
                            f"{r.get('step_bytes')} B a step) < {latency_bytes_per_sm(arch):.0f} B, what the GPU moves "
                            f"per SM in one DRAM latency (limited by {r['ctas_limited_by']})")
        if r["kernel"] == DSV4_KERNEL and arch in FP8_MMA_ARCHES:
            failures += dsv4_model_failures(r)
        if r["kernel"] == FAST_KERNEL and arch in FP8_MMA_ARCHES:
            qmma = {kind for kind in r["mma"] if kind.startswith("QMMA")}
            if qmma != {FP8_MMA_KIND}:
                failures.append(f"{r['variant']}: its fp8 MMAs are {sorted(qmma)}, not only {FP8_MMA_KIND}: {r['mma']}")
            planned = fast_ctas_per_sm(arch)
            if r["ctas_per_sm"] < planned:
                failures.append(f"{r['variant']}: {r['ctas_per_sm']} CTA per SM (< {planned}, what the launch "
                                f"plan sizes its waves with; limited by {r['ctas_limited_by']})")
    return failures


# How far a DeepSeek-V4 variant's loop may run past the instructions its plan's model counts (the
# model takes the costliest variant's; an unrelated edit moves a loop by a few instructions).
DSV4_INSTRUCTION_SLACK = 0.02


def dsv4_model_failures(row: dict[str, Any]) -> list[str]:
    """Where a compiled DeepSeek-V4 variant costs more than its plan's model counts
    (:class:`~..kernels.dsv4.plan.Compiled`): its loop's MMAs, by kind, times the warps must be the
    model's a step, and its loop's instructions times the warps at most the model's (within
    :data:`DSV4_INSTRUCTION_SLACK`), so the modeled times are the compiled code's."""
    from mla_sm120_plugin.kernels.dsv4 import plan as dsv4_plan

    compiled = dsv4_plan.SHAPES[row["record"]].compiled
    warps = row["warps"]
    failures = []
    mma = {kind: count * warps for kind, count in (row.get("loop_mma") or {}).items()}
    if mma != compiled.mma:
        failures.append(f"{row['variant']}: its loop's MMAs x {warps} warps are {mma}, the model counts {compiled.mma}")
    if (row.get("loop_instructions") or 0) * warps > compiled.instructions * (1 + DSV4_INSTRUCTION_SLACK):
        failures.append(f"{row['variant']}: its loop is {row['loop_instructions']} x {warps} warp instructions a step, "
                        f"the model counts {compiled.instructions}")
    return failures


def latency_bytes_per_sm(arch: int) -> float:
    """What one SM of the family's reference part must have in flight to cover a DRAM latency:
    its bandwidth x :data:`~..kernels.shared.launch_plan.LATENCY_US` / its SMs (RTX 5090: 10.5 KB)."""
    from mla_sm120_plugin.kernels.shared.launch_plan import FAMILIES, gpu_family

    family = FAMILIES[gpu_family(arch // 10, arch % 10)]
    return family.latency_bytes / family.num_sms


def step_bytes(describe: dict[str, Any]) -> int | None:
    """Cache bytes one step of a streaming kernel's loop loads (candidates a step x a row's bytes read)."""
    if describe.get("kernel") == DSV4_KERNEL:
        from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout

        return describe["block_n"] * dsv4_layout.RECORDS[describe["record"]].token_bytes
    if describe.get("kernel") in STREAMING_KERNELS:
        from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

        return describe["block_k"] * max(dsa_plan.row_bytes_read(c) for c in describe["cache"].split("+"))
    return None


def fast_ctas_per_sm(arch: int) -> int:
    """CTAs per SM the launch plan assumes for the fast kernel on ``sm_<arch>a``."""
    from mla_sm120_plugin.kernels.dsa import plan as dsa_plan

    return dsa_plan.FAST.ctas_per_sm[dsa_plan.gpu_family(arch // 10, arch % 10)]


def report(arch: int) -> dict[str, Any]:
    """Compile every variant for ``arch`` (120, 121 or 90): ``{"arch", "triton", "variants": [...]}``.

    Under ``TRITON_INTERPRET=1`` the kernels are interpreter objects that cannot be compiled, so
    the report is made in a fresh Python process without it.
    """
    if arch not in ARCHES:
        from mla_sm120_plugin.errors import KernelInputError, format_error

        raise KernelInputError(format_error(f"arch={arch}", f"one of {sorted(ARCHES)}",
                                            "pass 120 (RTX 50xx / RTX PRO 6000), 121 (DGX Spark) or 90 (H100/H200)"))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and k not in PTXAS_OVERRIDES}
        done = subprocess.run([sys.executable, "-m", __name__, str(arch)], capture_output=True, text=True,
                              env=env, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"compile gate subprocess failed (rc {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout)
    return _report_here(arch)


# Set by FlashInfer's import (flashinfer/triton/__init__.py) to a system ptxas of CUDA >= 13 found on
# PATH; it compiles the same PTX differently (CUDA 13.0's gives the exact fp8_ds_mla variant 128
# registers and a 4-byte spill where Triton's bundled 13.3 gives 134 and none). The gate reads the
# compiler Triton ships, whatever the calling process imported.
PTXAS_OVERRIDES = ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH")


_RELEASE = re.compile(r"release (\d+)\.(\d+)")


def _ptxas_release(path: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    found = _RELEASE.search(out.stdout + out.stderr)
    return (int(found.group(1)), int(found.group(2))) if out.returncode == 0 and found else None


@functools.cache
def system_ptxas() -> dict[str, str] | None:
    """The CUDA >= 13 ptxas a deployment's Triton may compile with instead of its own:
    ``{"path", "release", "found_by"}``, or None when this machine has none.

    First the one FlashInfer's import points ``TRITON_PTXAS_BLACKWELL_PATH`` at (``ptxas`` on
    PATH, release >= 13: the same rule); else the one pip's ``nvidia-cuda-nvcc`` (installed with
    vLLM's torch) puts beside the CUDA libraries, so an engine environment always gates a second
    build."""
    import importlib.util
    import shutil

    candidates = [(shutil.which("ptxas"), "ptxas on PATH (what FlashInfer's import selects)")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append((str(Path(root) / "cu13" / "bin" / "ptxas"), "pip's nvidia-cuda-nvcc"))
    for path, found_by in candidates:
        if path and Path(path).is_file():
            release = _ptxas_release(path)
            if release and release[0] >= 13:
                return dict(path=str(Path(path).resolve()), release=f"{release[0]}.{release[1]}", found_by=found_by)
    return None


def _compile_fresh(launch: Any, arch: int, ptxas: str | None = None) -> dict[str, Any]:
    """:func:`compile_launch` with Triton's bundled ptxas (or with ``ptxas``, through Triton's own
    override variables), into a private, empty Triton cache (a cubin cached by another checkout's
    run, or built by another ptxas, is never what the gate reads)."""
    from triton.backends.nvidia import compiler as nvidia_compiler

    # Triton memoizes the ptxas version (it picks the PTX version from it): forget it on the way in
    # and out, so each build's PTX is the one its ptxas reads.
    nvidia_compiler.get_ptxas_version.cache_clear()
    saved = {key: os.environ.get(key) for key in ("TRITON_CACHE_DIR", *PTXAS_OVERRIDES)}
    with tempfile.TemporaryDirectory(prefix="mla-sm120-gate-") as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        for key in PTXAS_OVERRIDES:
            os.environ.pop(key, None)
            if ptxas is not None:
                os.environ[key] = ptxas
        try:
            return compile_launch(launch, arch)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            nvidia_compiler.get_ptxas_version.cache_clear()


def _report_here(arch: int) -> dict[str, Any]:
    import triton

    every = launches()
    rows = [_compile_fresh(launch, arch) for launch in every]
    compiled = [r for r in rows if r["compiled"]]
    failures = gate_failures(arch, rows)
    other = system_ptxas() if arch in FP8_MMA_ARCHES else None
    other_rows = []
    if other is not None:
        other_rows = [_compile_fresh(launch, arch, other["path"]) for launch in every
                      if launch.describe.get("kernel") == FAST_KERNEL]
        failures += [f"[ptxas {other['release']}] {f}" for f in gate_failures(arch, other_rows)]
    return dict(
        arch=arch,
        target=f"sm_{arch}a",
        triton=triton.__version__,
        shared_limit_bytes=ARCHES[arch],
        sm_limits=SM_LIMITS[arch],
        all_compiled=len(compiled) == len(rows),
        max_spill_bytes=max((r["spill_bytes"] for r in compiled), default=None),
        max_shared_bytes=max((r["shared_bytes"] for r in compiled), default=None),
        max_registers=max((r["registers"] for r in compiled), default=None),
        min_fast_ctas_per_sm=min((r["ctas_per_sm"] for r in compiled if r["kernel"] == FAST_KERNEL), default=None),
        gate_passed=not failures,
        gate_failures=failures,
        variants=rows,
        system_ptxas=other,
        system_ptxas_variants=other_rows,
    )


if __name__ == "__main__":
    print(json.dumps(_report_here(int(sys.argv[1]))))
