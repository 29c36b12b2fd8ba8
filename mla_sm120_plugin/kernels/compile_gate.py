"""Compile every Triton kernel variant the dispatcher can launch, for a GPU this machine need not have.

Triton's interpreter runs a kernel as Python: both branches of a constexpr ``if``, no type
unification, no register allocation. So a kernel that passes every CPU test can still fail to
compile, or spill, on a real GPU. This module builds each variant the way a launch would (same
signature, same argument specialization) with ``triton.compile`` for a :class:`GPUTarget`, then
reads its resources from the ptxas Triton bundles (``ptxas -v``): registers, spill bytes and the
stack frame. ``shared_bytes`` is what Triton reserves as dynamic shared memory for the launch.

Used by ``mla-sm120 bench --compile-only --arch 120 --json`` and by the test suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mla_sm120_plugin.kernels import layout

# Compute capability as Triton's GPUTarget takes it -> shared memory one block may use (bytes).
ARCHES = {120: 101_376, 121: 101_376, 90: 232_448}
WARP_SIZE = 32
_REPRESENTATIVE_TOKENS = 4  # strides below come from a [4, H, 576] q; any T > 1 specializes the same
_REPRESENTATIVE_HEADS = 40  # not a multiple of 16, so head strides specialize as in the worst case


def _describe(describe: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in describe.items())


def launches() -> list[Any]:
    """One :class:`~mla_sm120_plugin.kernels.triton.Launch` per distinct variant the dispatcher can
    launch: cache layout x output dtype (q's: bf16 or fp32; q itself is always bf16 on a GPU) x
    final/split x every block configuration of :func:`~mla_sm120_plugin.kernels.triton.launch_config`,
    with the combine kernel for each output dtype. Built by the same ``launch_plan`` a call runs, on
    small CPU tensors (never launched)."""
    import torch

    from mla_sm120_plugin.kernels import pack
    from mla_sm120_plugin.kernels import triton as tk

    tokens, heads = _REPRESENTATIVE_TOKENS, _REPRESENTATIVE_HEADS
    found: dict[str, Any] = {}
    for cfg in tk.launch_variants():
        for cache_layout in layout.KV_LAYOUTS:
            for q_dtype in (torch.bfloat16, torch.float32):
                q = torch.empty(tokens, heads, layout.HEAD_DIM, dtype=q_dtype)
                plan = tk.launch_plan(
                    q, pack.make_cache(2, cache_layout), torch.empty(tokens, 64, dtype=torch.int32),
                    sm_scale=0.1, kv_layout=cache_layout, topk_length=torch.empty(tokens, dtype=torch.int32),
                    sink=torch.empty(heads), out=torch.empty(tokens, heads, layout.KV_LORA_RANK, dtype=q_dtype),
                    lse=torch.empty(tokens, heads), lse_base="e", cfg=cfg, interpret=False,
                )
                for launch in plan:
                    found.setdefault(_describe(launch.describe), launch)
    return list(found.values())


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


def compile_launch(launch: Any, arch: int) -> dict[str, Any]:
    """Compile one launch's variant for ``sm_<arch>a``; a failure is a result (``compiled: False``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row: dict[str, Any] = dict(variant=_describe(launch.describe), compiled=False, registers=None,
                               spill_bytes=None, spill_load_bytes=None, stack_bytes=None, shared_bytes=None,
                               error=None, **launch.describe)
    try:
        signature, consts, attrs = _specialize(launch.kernel, list(launch.args), launch.constexprs, arch)
        compiled = triton.compile(ASTSource(fn=launch.kernel, signature=signature, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, WARP_SIZE), options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
        row.update(_ptxas_resources(compiled.asm["ptx"], arch))
        row["shared_bytes"] = int(compiled.metadata.shared)
        row["compiled"] = True
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is what this reports
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[-800:]}"
    return row


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
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-m", __name__, str(arch)], capture_output=True, text=True,
                              env=env, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"compile gate subprocess failed (rc {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout)
    return _report_here(arch)


def _report_here(arch: int) -> dict[str, Any]:
    import triton

    rows = [compile_launch(launch, arch) for launch in launches()]
    compiled = [r for r in rows if r["compiled"]]
    return dict(
        arch=arch,
        target=f"sm_{arch}a",
        triton=triton.__version__,
        shared_limit_bytes=ARCHES[arch],
        all_compiled=len(compiled) == len(rows),
        max_spill_bytes=max((r["spill_bytes"] for r in compiled), default=None),
        max_shared_bytes=max((r["shared_bytes"] for r in compiled), default=None),
        max_registers=max((r["registers"] for r in compiled), default=None),
        variants=rows,
    )


if __name__ == "__main__":
    print(json.dumps(_report_here(int(sys.argv[1]))))
