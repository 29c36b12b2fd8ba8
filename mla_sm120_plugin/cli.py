"""``mla-sm120``: check a deployment, inspect this machine, benchmark the kernels.

Exit codes: 0 servable / fine, 2 not servable or bad input (the message says why and how to
fix it), 1 an unexpected failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any, Iterable, Sequence

from . import envs
from .errors import MlaSm120Error
from .files import printable

EXIT_OK = 0
EXIT_UNSERVABLE = 2

DESCRIPTION = "mla-sm120: check a deployment, inspect this machine, benchmark the kernels."
PLAN_FIX = "plan for the GPU you will run on: --sm 12.0 (RTX 50xx / RTX PRO 6000) or --sm 12.1 (DGX Spark)"


def _emit(text: str, stream: Any = None) -> None:
    """Write one block of output: undecodable path/environment bytes escaped, and a reader that went
    away (``| head -1``) ends the output quietly instead of with a BrokenPipeError traceback."""
    stream = sys.stdout if stream is None else stream
    try:
        stream.write(printable(text) + "\n")
    except BrokenPipeError:
        _silence(stream)
    else:
        _flush(stream)


def _flush(stream: Any) -> None:
    """Flush ``stream``; a reader that went away silences it instead of raising."""
    try:
        stream.flush()
    except BrokenPipeError:
        _silence(stream)


def _silence(stream: Any) -> None:
    # Python flushes stdout once more at exit and would report the broken pipe then: point the
    # descriptor at /dev/null so nothing is left to fail.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _printable_tree(value: Any) -> Any:
    """``value`` with every string made :func:`~mla_sm120_plugin.files.printable` (for JSON)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable_tree(k): _printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable_tree(v) for v in value]
    return value


def _json(value: Any) -> str:
    return json.dumps(_printable_tree(value), indent=2)


def _check_device(sm: str | None) -> Any:
    """The device to decide for: ``--sm``, else ``MLA_SM120_DEVICE``, else this machine's GPU."""
    from . import device as device_mod
    from .errors import UnsupportedConfiguration, format_error

    dev = device_mod.detect(override=sm)
    if not dev.is_gpu and not dev.is_planned:
        # A CPU-only machine is not a deployment: no engine serves DSA models here.
        raise UnsupportedConfiguration(
            format_error(
                f"no --sm, no {device_mod.DEVICE_ENV}, and no GPU found on this machine (nvidia-smi)",
                "a deployment on an NVIDIA SM120/SM121 GPU: this machine's, or one named with --sm",
                PLAN_FIX,
            )
        )
    return dev


def _check(args: argparse.Namespace) -> int:
    from .context import EngineLimits, plugin_config
    from .hooks.manager import get_registry
    from .modelinfo import resolve_model
    from .plan import check_kv_cache_dtype, plan
    from .report import explain, to_dict

    reg = get_registry()
    facts = resolve_model(args.model, registry=reg)
    flags = {k: v for k, v in (("prefill_kernel", args.prefill_kernel), ("decode_kernel", args.decode_kernel),
                               ("precision", args.precision)) if v}
    cfg = plugin_config(flags or None, kernel_names=reg.kernels, config_file=args.config,
                        inline_label="command-line flags")
    release, why = _engine_release(args.engine, args.engine_version)
    features = _engine_features(args.engine, release, args.engine_feature or ())
    limits = EngineLimits(
        tensor_parallel_size=args.tp,
        decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
        max_decode_tokens=args.max_decode_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graphs=not args.enforce_eager,
        features=features,
        engine=args.engine,
        release=release,
    )
    planned = plan(facts, cfg.for_model(facts.name, facts.arch), _check_device(args.sm),
                   check_kv_cache_dtype(facts, limits.facts, args.kv_cache_dtype), limits,
                   speculative_tokens=args.num_speculative_tokens, dspark=args.dspark, registry=reg)
    planned = dataclasses.replace(planned, notes=(*planned.notes, f"planned for {limits.facts.versioned} ({why})"))
    _emit(_json(to_dict(planned)) if args.json else explain(planned))
    return EXIT_OK


def _engine_features(name: str, release: str, given: Iterable[str]) -> frozenset[str]:
    """``--engine-feature`` values, each one the engine has (a setting that changes the cache or top-k path,
    or one the engine refuses under decode context parallelism).

    :raises ConfigError: a feature the engine does not have (given / supported / fix).
    """
    from .engines import lookup
    from .errors import ConfigError, format_error

    engine = lookup(name, release)
    known = sorted({*engine.feature_flags, *engine.dcp.features})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(format_error(f"--engine-feature {' '.join(unknown)} with --engine {name}",
                                       f"{engine.label}'s features: {', '.join(known)}",
                                       f"pass one of those, or plan with the engine that has it (--engine)"))
    return frozenset(given)


def _engine_release(name: str, given: str | None) -> tuple[str, str]:
    """The engine release ``check`` plans for and why: ``--engine-version``, else the installed
    release, else the newest the plugin supports.

    :raises UnsupportedConfiguration: the given or installed release is not supported (the words the
        engine's ``register()`` logs, with the flag that plans for another release).
    """
    from .engines import RELEASES, installed_release, release_refusal
    from .errors import UnsupportedConfiguration

    releases = tuple(RELEASES[name])
    chosen = given if given is not None else installed_release(name)
    if chosen is None:
        chosen, why = releases[-1], "none installed here: the newest the plugin supports"
    else:
        refusal = release_refusal(name, chosen, first_fix=f"pass --engine-version {' or '.join(releases)}")
        if refusal is not None:
            raise UnsupportedConfiguration(refusal)
        why = "--engine-version" if given is not None else "the release installed here"
    others = [release for release in releases if release != chosen]
    if others:
        why += f"; --engine-version {' or '.join(others)} plans for the other"
    return chosen, why


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# An entry-point plugin that imports slower than this is flagged: every `check` and every engine
# process start pays its import.
SLOW_IMPORT_S = 0.5


def _hook_faults(reg: Any) -> list[str]:
    """Plan every model profile once (planned SM120, the newest vLLM, TP 1, the cache ``check`` plans),
    so that every plugin's validate/select hooks run on each layer kind's context as its family shapes
    it (a DeepSeek-V4 profile: one context a layer kind), and report each fault a hook raises once (a
    hook that fails the same way on every context is one fault: its first line names plugin, hook and
    what it did)."""
    from .config import Settings
    from .context import EngineLimits
    from .device import parse_device
    from .engines import RELEASES
    from .errors import PluginError, UnsupportedConfiguration
    from .modelinfo import resolve_model
    from .plan import check_kv_cache_dtype, plan

    limits = EngineLimits(engine="vllm", release=tuple(RELEASES["vllm"])[-1], cuda_graphs=True)
    device = parse_device("12.0", source="doctor")
    faults: dict[str, str] = {}
    for profile in reg.profiles.values():
        try:
            facts = resolve_model(profile.name, registry=reg)
            plan(facts, Settings(), device, check_kv_cache_dtype(facts, limits.facts, None), limits, registry=reg)
        except PluginError as exc:
            faults.setdefault(str(exc).partition("\n")[0], str(exc))
        except UnsupportedConfiguration:
            pass  # a refusal is an answer, not a fault
    return list(faults.values())


def doctor_report() -> dict[str, Any]:
    """What is installed, what GPU this is, what plugins registered (and how fast), each kernel's
    probe, and every plugin fault found by loading the plugins and calling their hooks once."""
    from . import device as device_mod
    from .errors import PluginError
    from .hooks.manager import get_registry
    from .selection import probe_reasons

    dev = device_mod.detect(use_torch=True)
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "packages": {d: _version(d) for d in ("mla-sm120-plugin", "torch", "triton", "flashinfer-python", "vllm",
                                              "sglang", "pluggy")},
        "device": {
            "vendor": dev.vendor, "sm": dev.sm, "name": dev.name, "cuda_version": dev.cuda_version, "source": dev.source,
        },
        "plugins": {}, "plugin_import_seconds": {}, "slow_plugins": [], "blocked_plugins": [],
        "model_profiles": [], "kernels": [], "faults": [],
    }
    try:
        reg = get_registry()
    except PluginError as exc:  # a plugin that fails to load: nothing else can be listed
        report["faults"].append(str(exc))
        return report
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
    seconds = {name: round(t, 3) for name, t in reg.load_seconds.items()}
    report.update(
        plugins=dict(reg.plugins),
        plugin_import_seconds=seconds,
        slow_plugins=[name for name, t in seconds.items() if t > SLOW_IMPORT_S],
        blocked_plugins=list(reg.blocked),
        model_profiles=[
            {"name": p.name, "architectures": list(p.architectures), "provider": reg.providers[("profile", p.name)]}
            for p in reg.profiles.values()
        ],
        kernels=kernels,
        faults=_hook_faults(reg),
    )
    return report


def self_check_rows() -> list[dict[str, Any]]:
    """Self-check every kernel that can run on this machine, on each case its family sweeps
    (:func:`mla_sm120_plugin.dispatch.selfcheck.sweep`).

    On a machine without a GPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET``
    is set here, before triton is imported, unless the caller set it).
    """
    from . import device as device_mod

    if not device_mod.detect(use_torch=True).is_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from .dispatch import selfcheck

    return selfcheck.sweep("cuda" if torch.cuda.is_available() else "cpu")


def _doctor(args: argparse.Namespace) -> int:
    checks = self_check_rows() if args.self_check else None
    report = doctor_report()
    failed = bool(report["faults"]) or (bool(checks) and not all(row["passed"] for row in checks))
    if checks is not None:
        report["self_check"] = checks
    if args.json:
        _emit(_json(report))
        return EXIT_UNSERVABLE if failed else EXIT_OK
    lines: list[str] = []
    out = lines.append  # the report is one block, written once through _emit
    out(f"python      {report['python']}")
    for dist, ver in report["packages"].items():
        out(f"{dist:<18} {ver or 'not installed'}")
    d = report["device"]
    out(f"device      {d['vendor']} sm={d['sm']} {d['name']} cuda={d['cuda_version'] or '?'} [{d['source']}]")
    out("plugins:")
    for name, label in report["plugins"].items():
        took = report["plugin_import_seconds"].get(name)
        timing = "" if took is None else f"  imported in {took:.2f} s"
        if name in report["slow_plugins"]:
            timing += f" (SLOW: over {SLOW_IMPORT_S} s, paid by every check and engine process)"
        out(f"  {name:<22} {label}{timing}")
    for name in report["blocked_plugins"]:
        out(f"  {name:<22} BLOCKED by {envs.DISABLE_PLUGINS}")
    out("model profiles:")
    for p in report["model_profiles"]:
        out(f"  {p['name']:<16} {', '.join(p['architectures'])}  [{p['provider']}]")
    out("kernels:")
    for k in report["kernels"]:
        status = "can run here" if k["can_run_here"] else "cannot run here: " + "; ".join(k["reasons"])
        out(f"  {k['name']:<24} prio {k['priority']:<4} {status}  [{k['provider']}]")
    for fault in report["faults"]:
        out("FAULT: " + fault.replace("\n", "\n       "))
    if checks is not None:
        out(f"self-check ({checks[0]['heads'] if checks else '-'} heads, top-k {checks[0]['topk'] if checks else '-'}, "
              f"on {checks[0]['device'] if checks else '-'}; against float64 over the dequantized rows; "
              "max error as a fraction of the output's largest value; LSE: the largest error of the LSE a "
              "decode-context-parallel merge reads, in nats, where the row is checked as a DCP rank calls it):")
        out(f"  {'kernel':<24} {'phase':<8} {'cache':<22} {'ran':<4} {'cos_diff':>9} {'relRMS':>8} {'max error':>10} "
            f"{'LSE':>8} {'time':>8}  result")

        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        for c in checks:
            cache = c["kv_layout"] + (f"/{c['scale_format']}" if c["scale_format"] else "")
            out(f"  {c['kernel']:<24} {c['phase']:<8} {cache:<22} {'yes' if c['ran'] else 'no':<4} "
                f"{num(c['cos_diff'], '.2e'):>9} {num(c['rel_rms'], '.3%'):>8} {num(c['max_error'], '.2e'):>10} "
                f"{num(c.get('lse_error'), '.1e'):>8} {c['seconds']:>7.2f}s  "
                f"{'ok' if c['passed'] else 'FAILED: ' + c['error']}")
        if not checks:
            out("  no kernel can run on this machine")
    _emit("\n".join(lines))
    return EXIT_UNSERVABLE if failed else EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    import os
    import re

    from .errors import KernelInputError, format_error

    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        # Refuse an unwritable destination before minutes of benchmarking, not after.
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise KernelInputError(format_error(f"{flag} {path}", "a file in an existing directory",
                                                f"create {os.path.dirname(os.path.abspath(path))} first"))
    if not args.compile_only and args.device is not None and not re.fullmatch(r"cuda(:\d+)?", args.device):
        raise KernelInputError(format_error(f"--device {args.device!r}", "cuda or cuda:N (the benchmark times GPU "
                                            "kernels)", "pass --device cuda, or use --compile-only --arch 120 on a "
                                            "machine without a GPU"))
    clashing = [flag for flag, on in (("--compile-only", args.compile_only), ("--traffic", args.traffic),
                                      ("--plot", args.plot), ("--quick", args.quick)) if on]
    if args.dsv4 and clashing:
        raise KernelInputError(format_error(f"--dsv4 with {', '.join(clashing)}",
                                            "--dsv4 with --device, --output, --json",
                                            "time DeepSeek-V4 alone, or drop --dsv4 (`--traffic` prints its plans)"))
    if args.traffic:
        from .kernels.dsa import plan as dsa_plan
        from .kernels.dsv4 import plan as dsv4_plan

        if args.json:
            _emit(_json({**dsa_plan.json_report(args.traffic), "dsv4": dsv4_plan.json_report(args.traffic)}))
            return EXIT_OK
        _emit("\n\n".join([dsa_plan.format_report(args.traffic),
                            *(dsa_plan.format_table(kernel, args.traffic) for kernel in dsa_plan.KERNELS),
                            dsv4_plan.format_report(args.traffic)]))
        return EXIT_OK
    if args.compile_only:
        from .tools import compile_gate

        result = compile_gate.report(args.arch)
        text = json.dumps(result, indent=2)
        if not args.json:
            lines = [f"sm_{result['arch']}a, Triton {result['triton']}: {len(result['variants'])} variants, "
                     f"max spill {result['max_spill_bytes']} B, max shared {result['max_shared_bytes']} B "
                     f"(limit {result['shared_limit_bytes']} B)"]
            def describe(v: dict) -> str:
                mma = ", ".join(f"{kind} x{count}" for kind, count in v["mma"].items())
                state = (f"{v['registers']:>3} regs  spill {v['spill_bytes']:>4} B  shared {v['shared_bytes']:>6} B"
                         f"  {v['ctas_per_sm']} CTA/SM  {mma}" if v["compiled"] else f"FAILED: {v['error']}")
                return f"  {v['variant']:<90} {state}"

            lines.extend(describe(v) for v in result["variants"])
            other = result.get("system_ptxas")
            if other is not None:
                lines.append(f"fast variants again with ptxas {other['release']} ({other['path']}, {other['found_by']}):")
                lines.extend(describe(v) for v in result["system_ptxas_variants"])
            lines.extend(f"GATE FAILS: {failure}" for failure in result["gate_failures"])
            _emit("\n".join(lines))
        # The gate's own verdict: compiled, no spills, shared memory within a block, and every fast
        # variant on SM12x with block-scaled fp8 MMAs at the plan's CTAs per SM, under both ptxas builds.
        ok = result["gate_passed"]
    elif args.dsv4:
        from .tools import bench_dsv4

        result = bench_dsv4.run(device=args.device or "cuda")
        text = json.dumps(result, indent=2)
        ok = True
    else:
        from .tools import bench

        result = bench.run_gpu_benchmarks(device=args.device or "cuda", quick=args.quick)
        text = json.dumps(result, indent=2)
        ok = True
    if args.json or not args.compile_only:
        _emit(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.plot and not args.compile_only:
        bench.plot(result, args.plot)  # after the JSON is out: a missing matplotlib loses no numbers
    return EXIT_OK if ok else EXIT_UNSERVABLE


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; pass a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; pass 1 or more")
    return value


def _own_version() -> str:
    from . import __version__

    return _version("mla-sm120-plugin") or __version__


def build_parser() -> argparse.ArgumentParser:
    from .engines import ENGINES, SGLANG, VLLM

    parser = argparse.ArgumentParser(prog="mla-sm120", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mla-sm120 {_own_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="decide the kernels for a model/GPU/KV dtype, before any weight loads")
    check.add_argument("--model", required=True, help="profile name (glm-5, deepseek-v3.2), model directory or config.json")
    check.add_argument("--sm", help="plan for this GPU instead of this machine's: 12.0, 12.1, sm_121, 9.0, cpu, rocm")
    check.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (divides the heads)")
    check.add_argument("--decode-context-parallel-size", "--dcp", "--dcp-size", type=_positive_int, default=1,
                       help="decode context parallel size (vLLM's flag; SGLang's --dcp-size; divides --tp): each GPU "
                            "keeps 1/N of the cache")
    check.add_argument("--cp-kv-cache-interleave-size", type=_positive_int, default=1,
                       help="under DCP: consecutive tokens a rank owns (vLLM's flag; GLM-5.3-Flash needs a multiple of 4)")
    check.add_argument("--engine", choices=tuple(ENGINES), default="vllm",
                       help="the engine you will serve with: its --kv-cache-dtype spellings and how its cache "
                            "writer stores fp8 scales (SGLang: amax/448 for every model) (default vllm)")
    check.add_argument("--engine-version",
                       help="the engine release you will serve with (vLLM 0.33.0 or 0.34.0; default: the one "
                            "installed here, else the newest supported)")
    check.add_argument("--kv-cache-dtype",
                       help="what you pass the engine: vLLM fp8_ds_mla (default) or auto/bfloat16; SGLang fp8_e4m3 "
                            "(default), bfloat16, or auto (SGLang's fp8 on SM >= 10)")
    check.add_argument("--prefill-kernel", help="force a prefill kernel (auto or a kernel name)")
    check.add_argument("--decode-kernel", help="force a decode kernel (auto or a kernel name)")
    check.add_argument("--precision", choices=("fast", "exact"),
                       help="fast (default): kernels with fp8 q/p MMAs may serve; exact: only bf16/fp32 operands")
    check.add_argument("--config", help=f"plugin config TOML (else {envs.CONFIG})")
    check.add_argument("--max-decode-tokens", type=_positive_int,
                       help=f"most tokens a decode call sees (vLLM: {VLLM.decode_bound}; SGLang: {SGLANG.decode_bound}); "
                            "<= 64 lets FlashInfer's decode kernel take few heads per GPU")
    check.add_argument("--max-prefill-tokens", type=_positive_int,
                       help="most tokens a prefill call sees (vLLM: max_num_batched_tokens)")
    check.add_argument("--num-speculative-tokens", type=int, default=0,
                       help="DeepSeek-V4: draft tokens a step (with --dspark, vLLM widens decode window rows)")
    check.add_argument("--dspark", action="store_true", help="DeepSeek-V4: the draft model is DSpark")
    check.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (allows the torch reference for decode)")
    check.add_argument("--engine-feature", action="append", metavar="NAME",
                       help="an engine setting you will turn on (repeatable): vLLM hisparse, pcp; SGLang hisparse, "
                            "skip_softmax, and hicache, pd_disaggregation, eagle_topk (--speculative-eagle-topk > 1), "
                            "which SGLang refuses under --dcp-size > 1")
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
    bench.add_argument("--json", action="store_true", help="JSON instead of a table (--compile-only, --traffic; "
                       "a GPU run prints JSON either way)")
    bench.add_argument("--quick", action="store_true", help="timings: three shapes, smaller matmul ceiling")
    bench.add_argument("--device", help="timings: cuda or cuda:N (default cuda)")
    bench.add_argument("--plot", help="timings: also draw GB/s and TFLOP/s against the ceilings (matplotlib)")
    bench.add_argument("--output", help="also write the JSON here")
    bench.add_argument("--dsv4", action="store_true",
                       help="timings of the DeepSeek-V4 kernels instead: the Triton kernel on its plan and unsplit, "
                            "and FlashInfer's, at T 1/6/64 x heads 8-128 x C4A / C128A x both records")
    bench.add_argument("--traffic", nargs="?", const="sm120", choices=("sm120", "sm121", "sm90"),
                       help="print the bytes each launch plan moves against the minimum, and the split table the "
                            "Triton kernels use (no GPU, no torch)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A last resort for text printable() does not cover (argparse's own messages): escape,
        # never raise, whatever the locale's encoding.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, --version, usage errors: argparse printed and exits
        _flush(sys.stdout)
        raise
    try:
        return args.func(args)
    except MlaSm120Error as exc:
        if getattr(args, "json", False):
            _emit(_json({"servable": False, "error": type(exc).__name__, "message": str(exc)}))
        _emit(f"mla-sm120 {args.command}: {type(exc).__name__}: {exc}", sys.stderr)
        return EXIT_UNSERVABLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
