"""``mla-sm120``: check a deployment, inspect this machine, benchmark the kernels.

Exit codes: 0 servable / fine, 2 not servable or bad input (the message says why and how to
fix it), 1 an unexpected failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from typing import Any, Sequence

from .errors import MlaSm120Error

EXIT_OK = 0
EXIT_UNSERVABLE = 2

KV_DTYPE_ALIASES = {"auto": "bf16", "bfloat16": "bf16"}


def _check(args: argparse.Namespace) -> int:
    from . import config as config_mod
    from . import device as device_mod
    from .hooks.manager import get_registry
    from .modelinfo import resolve_model
    from .selection import decision_to_dict, explain, select
    from .types import SelectionContext

    reg = get_registry()
    facts = resolve_model(args.model, registry=reg)
    flags = {k: v for k, v in (("prefill_kernel", args.prefill_kernel), ("decode_kernel", args.decode_kernel)) if v}
    cfg = config_mod.load_config(
        flags or None, kernel_names=reg.kernels, config_file=args.config, inline_label="command-line flags"
    )
    settings = cfg.for_model(facts.name, facts.arch)
    kv = KV_DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    ctx = SelectionContext(
        model_arch=facts.arch,
        model_name=facts.name,
        kv_cache_dtype=kv,
        num_heads=facts.heads_per_rank(args.tp),
        index_topk=facts.index_topk,
        device=device_mod.detect(override=args.sm),
        prefill_kernel=settings.prefill_kernel,
        decode_kernel=settings.decode_kernel,
        kv_scale_format=settings.kv_scale_format,
        max_decode_tokens=args.max_decode_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graphs=not args.enforce_eager,
        forced_by=settings.forced_by(),
    )
    decision = select(ctx, registry=reg)
    print(json.dumps(decision_to_dict(decision), indent=2) if args.json else explain(decision))
    return EXIT_OK


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict[str, Any]:
    """What is installed, what GPU this is, what plugins registered, and each kernel's probe."""
    from . import device as device_mod
    from .hooks.manager import get_registry
    from .selection import probe_reasons

    dev = device_mod.detect(use_torch=True)
    reg = get_registry()
    kernels = []
    for name, spec in reg.kernels.items():
        reasons = probe_reasons(spec, dev)
        kernels.append(
            {
                "name": name,
                "provider": reg.providers[("kernel", name)],
                "priority": spec.priority,
                "phases": sorted(spec.phases),
                "kv_cache_dtypes": sorted(spec.kv_cache_dtypes),
                "can_run_here": not reasons,
                "reasons": list(reasons),
            }
        )
    return {
        "python": platform.python_version(),
        "packages": {d: _version(d) for d in ("mla-sm120-plugin", "torch", "triton", "flashinfer-python", "vllm", "pluggy")},
        "device": {
            "vendor": dev.vendor, "sm": dev.sm, "name": dev.name, "cuda_version": dev.cuda_version, "source": dev.source,
        },
        "plugins": dict(reg.plugins),
        "blocked_plugins": list(reg.blocked),
        "model_profiles": [
            {"name": p.name, "architectures": list(p.architectures), "provider": reg.providers[("profile", p.name)]}
            for p in reg.profiles.values()
        ],
        "kernels": kernels,
    }


# The self-check's shapes for `doctor --self-check`: GLM-5 at TP4 on a GPU; on the CPU (Triton's
# interpreter) a smaller top-k keeps it to seconds.
SELF_CHECK_HEADS = 16
SELF_CHECK_TOPK = {"gpu": 2048, "cpu": 128}


def self_check_rows() -> list[dict[str, Any]]:
    """Self-check every kernel that can run on this machine, per phase, layout and scale format.

    On a machine without a GPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET``
    is set here, before triton is imported, unless the caller set it).
    """
    import os

    from . import device as device_mod

    dev = device_mod.detect(use_torch=True)
    if not dev.is_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from .hooks.manager import get_registry
    from .kernels import selfcheck
    from .kernels.binding import bind
    from .kernels.layout import FP8_DS_MLA, SCALE_FORMATS
    from .selection import probe_reasons

    on_gpu = torch.cuda.is_available()
    target = "cuda" if on_gpu else "cpu"
    topk = SELF_CHECK_TOPK["gpu" if on_gpu else "cpu"]
    rows = []
    for name, spec in get_registry().kernels.items():
        if probe_reasons(spec, dev):
            continue  # `doctor` already says why it cannot run here
        for kv_layout in sorted(spec.kv_cache_dtypes):
            for scale_format in SCALE_FORMATS if kv_layout == FP8_DS_MLA else (SCALE_FORMATS[1],):
                for phase in sorted(spec.phases):
                    row = dict(kernel=name, phase=phase, kv_layout=kv_layout,
                               scale_format=scale_format if kv_layout == FP8_DS_MLA else None,
                               heads=SELF_CHECK_HEADS, topk=topk, device=target)
                    try:
                        result = selfcheck.check(bind(name), phase=phase, kv_layout=kv_layout,
                                                 scale_format=scale_format, num_heads=SELF_CHECK_HEADS,
                                                 topk=topk, device=target)
                    except MlaSm120Error as exc:  # the entry does not import
                        row.update(ran=False, passed=False, max_error=None, tolerance=spec.tolerance,
                                   seconds=0.0, error=f"{type(exc).__name__}: {exc}")
                    else:
                        row.update(ran=result.ran, passed=result.passed, max_error=result.max_error,
                                   tolerance=result.tolerance, seconds=result.seconds, error=result.error)
                    rows.append(row)
    return rows


def _doctor(args: argparse.Namespace) -> int:
    checks = self_check_rows() if args.self_check else None
    report = doctor_report()
    failed = bool(checks) and not all(row["passed"] for row in checks)
    if checks is not None:
        report["self_check"] = checks
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_UNSERVABLE if failed else EXIT_OK
    print(f"python      {report['python']}")
    for dist, ver in report["packages"].items():
        print(f"{dist:<18} {ver or 'not installed'}")
    d = report["device"]
    print(f"device      {d['vendor']} sm={d['sm']} {d['name']} cuda={d['cuda_version'] or '?'} [{d['source']}]")
    print("plugins:")
    for name, label in report["plugins"].items():
        print(f"  {name:<22} {label}")
    for name in report["blocked_plugins"]:
        print(f"  {name:<22} BLOCKED by MLA_SM120_DISABLE_PLUGINS")
    print("model profiles:")
    for p in report["model_profiles"]:
        print(f"  {p['name']:<16} {', '.join(p['architectures'])}  [{p['provider']}]")
    print("kernels:")
    for k in report["kernels"]:
        status = "can run here" if k["can_run_here"] else "cannot run here: " + "; ".join(k["reasons"])
        print(f"  {k['name']:<24} prio {k['priority']:<4} {status}  [{k['provider']}]")
    if checks is not None:
        print(f"self-check ({SELF_CHECK_HEADS} heads, top-k {checks[0]['topk'] if checks else '-'}, "
              f"on {checks[0]['device'] if checks else '-'}; max error as a fraction of the output's magnitude):")
        print(f"  {'kernel':<24} {'phase':<8} {'cache':<22} {'ran':<4} {'max error':>10} {'tolerance':>10} {'time':>8}  result")
        for c in checks:
            cache = c["kv_layout"] + (f"/{c['scale_format']}" if c["scale_format"] else "")
            err = f"{c['max_error']:.2e}" if c["max_error"] is not None else "-"
            print(f"  {c['kernel']:<24} {c['phase']:<8} {cache:<22} {'yes' if c['ran'] else 'no':<4} {err:>10} "
                  f"{c['tolerance']:>10.0e} {c['seconds']:>7.2f}s  {'ok' if c['passed'] else 'FAILED: ' + c['error']}")
        if not checks:
            print("  no kernel can run on this machine")
    return EXIT_UNSERVABLE if failed else EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    import os

    from .errors import KernelInputError, format_error

    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        # Refuse an unwritable destination before minutes of benchmarking, not after.
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise KernelInputError(format_error(f"{flag} {path}", "a file in an existing directory",
                                                f"create {os.path.dirname(os.path.abspath(path))} first"))
    if args.compile_only:
        from .kernels import compile_gate

        result = compile_gate.report(args.arch)
        text = json.dumps(result, indent=2)
        if not args.json:
            lines = [f"sm_{result['arch']}a, Triton {result['triton']}: {len(result['variants'])} variants, "
                     f"max spill {result['max_spill_bytes']} B, max shared {result['max_shared_bytes']} B "
                     f"(limit {result['shared_limit_bytes']} B)"]
            for v in result["variants"]:
                state = (f"{v['registers']:>3} regs  spill {v['spill_bytes']:>4} B  shared {v['shared_bytes']:>6} B"
                         if v["compiled"] else f"FAILED: {v['error']}")
                lines.append(f"  {v['variant']:<90} {state}")
            print("\n".join(lines))
        ok = result["all_compiled"] and result["max_spill_bytes"] == 0 and (
            result["max_shared_bytes"] <= result["shared_limit_bytes"])
    else:
        from .kernels import bench

        result = bench.run_gpu_benchmarks(device=args.device or "cuda", quick=args.quick)
        text = json.dumps(result, indent=2)
        ok = True
    if args.json or not args.compile_only:
        print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.plot and not args.compile_only:
        bench.plot(result, args.plot)  # after the JSON is out: a missing matplotlib loses no numbers
    return EXIT_OK if ok else EXIT_UNSERVABLE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-sm120", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="decide the kernels for a model/GPU/KV dtype, before any weight loads")
    check.add_argument("--model", required=True, help="profile name (glm-5, deepseek-v3.2), model directory or config.json")
    check.add_argument("--sm", help="plan for this GPU instead of this machine's: 12.0, 12.1, sm_121, 9.0, cpu, rocm")
    check.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides the heads)")
    check.add_argument("--kv-cache-dtype", default="fp8_ds_mla", help="fp8_ds_mla (default), bf16/auto, or what you pass vLLM")
    check.add_argument("--prefill-kernel", help="force a prefill kernel (auto or a kernel name)")
    check.add_argument("--decode-kernel", help="force a decode kernel (auto or a kernel name)")
    check.add_argument("--config", help="plugin config TOML (else MLA_SM120_CONFIG)")
    check.add_argument("--max-decode-tokens", type=int, help="most tokens a decode step sees (batch x (1 + spec tokens))")
    check.add_argument("--max-prefill-tokens", type=int, help="most tokens a prefill step sees (max_num_batched_tokens)")
    check.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (allows the torch reference for decode)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=_check)

    doctor = sub.add_parser("doctor", help="versions, GPU, plugins and kernel probes on this machine")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--self-check", action="store_true",
                        help="run every kernel that can run here against the torch reference; exit 2 if one fails")
    doctor.set_defaults(func=_doctor)

    bench = sub.add_parser("bench", help="kernel timings on this GPU, or compile reports for any GPU (JSON)")
    bench.add_argument("--compile-only", action="store_true",
                       help="compile every Triton variant for --arch without a GPU; exit 2 if any fails, spills "
                            "or exceeds the shared-memory limit")
    bench.add_argument("--arch", type=int, default=120, help="with --compile-only: 120, 121 or 90 (default 120)")
    bench.add_argument("--json", action="store_true", help="with --compile-only: JSON instead of a table")
    bench.add_argument("--quick", action="store_true", help="timings: three shapes, smaller matmul ceiling")
    bench.add_argument("--device", help="timings: cuda or cuda:N (default cuda)")
    bench.add_argument("--plot", help="timings: also draw GB/s and TFLOP/s against the ceilings (matplotlib)")
    bench.add_argument("--output", help="also write the JSON here")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MlaSm120Error as exc:
        if getattr(args, "json", False):
            print(json.dumps({"servable": False, "error": type(exc).__name__, "message": str(exc)}, indent=2))
        print(f"mla-sm120 {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNSERVABLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
