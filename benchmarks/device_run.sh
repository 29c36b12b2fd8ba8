#!/usr/bin/env bash
# One short run on a lent GPU machine (<= 10 minutes on an H200, <= 7 with SKIP_DSV4=1; see the device tool's README):
#   1. the kernel tests on the GPU, compiled (the exact and fast Triton kernels against the torch
#      reference; the compile gate, which needs no GPU, runs on the CPU machine instead),
#   2. the traffic model and configuration table (pure Python) for the record,
#   3. the sweep: exact vs fast, each with the table's config and its neighbours, at T=1/64/2048 x
#      heads 4/8/16/64/128, top-k 2048, eager and CUDA graph and host us, with the copy and matmul
#      ceilings measured in the same run (JSON rewritten after every shape, PNG at the end),
#   4. DeepSeek-V4: the Triton kernel on its plan and unsplit, and FlashInfer's where it runs, at
#      T=1/6/64 x heads 8/16/64/128 x C4A (128 + 512) / C128A (128 + 8,192) x both records, eager and
#      CUDA graph, on 512 MiB caches (DRAM, not L2), the copy bandwidth beside it (dsv4.json),
#   5. the init self-check of every kernel that runs there (FlashInfer's on an SM12x GPU), decode as a
#      decode-context-parallel rank calls it: output and LSE (both forms, sinks, empty and -1 rows) against
#      float64 (selfcheck.json, `mla-sm120 doctor --self-check --json`).
# On sm_90 the fast kernel's fp8 dots are emulated (no fp8 mma.sync there): bench.json says so
# beside its numbers ("note", "fast_kernel_note"). Needs only torch, triton (3.6 works), pytest and
# pluggy; everything lands under $OUT:
#   run: PYTHONPATH=. bash benchmarks/device_run.sh      (timeout_s ~600; or without step 4: SKIP_DSV4=1)
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" \
    > "$OUT/versions.txt" 2>&1
# The kernels and what binds them (the compile gate and the bench test, tests/tools, are left out:
# the gate needs no GPU, and the GPU quick report repeats what step 3 measures).
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels tests/dispatch > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.txt"
python benchmarks/bench_kernels.py --traffic sm90 > "$OUT/plan_sm90.txt" 2>&1
python benchmarks/bench_kernels.py --traffic sm120 > "$OUT/plan_sm120.txt" 2>&1
timeout 180 python benchmarks/bench_kernels.py --device cuda --sweep --output "$OUT/bench.json" \
    --plot "$OUT/bench.png" > /dev/null 2> "$OUT/bench.err"
echo "bench rc=$?"; tail -3 "$OUT/bench.err"
if [ "${SKIP_DSV4:-0}" != 1 ]; then
    timeout 200 python benchmarks/bench_kernels.py --device cuda --dsv4 --output "$OUT/dsv4.json" 2> "$OUT/dsv4.err"
    echo "dsv4 rc=$?"; tail -3 "$OUT/dsv4.err"
fi
timeout 120 python -m mla_sm120_plugin.cli doctor --self-check --json > "$OUT/selfcheck.json" 2> "$OUT/selfcheck.err"
echo "self-check rc=$?"; tail -3 "$OUT/selfcheck.err"
python - "$OUT/selfcheck.json" <<'PY' 2>/dev/null || true
import json, sys
for c in json.load(open(sys.argv[1]))["self_check"]:
    lse = "-" if c.get("lse_error") is None else f"{c['lse_error']:.1e}"
    print(f"{c['kernel']} {c['phase']} {c['kv_layout']}: {'ok' if c['passed'] else 'FAILED'} relRMS "
          f"{c['rel_rms'] if c['rel_rms'] is None else format(c['rel_rms'], '.3%')} LSE {lse}")
PY
python - "$OUT/bench.json" <<'PY' 2>/dev/null || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"{report['device']} triton {report['triton']} shapes {len(report['results'])}", report.get("fast_kernel_note") or "")
for row in report["results"]:
    cells = []
    for kernel, configs in row["kernels"].items():
        for label, e in configs.items():
            cells.append(f"{kernel.replace('triton_sparse_mla', 'tr')}/{label}="
                         + (f"{e['graph_us']:.0f}us" if "graph_us" in e else "err"))
    print(f"T={row['num_tokens']} H={row['num_heads']}: " + " ".join(cells))
PY
python - "$OUT/dsv4.json" <<'PY' 2>/dev/null || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"dsv4: {report['device']} copy {report['copy_gbps']:.0f} GB/s, shapes {len(report['results'])}")
for row in report["results"]:
    cells = [f"{label}=" + (f"{e['graph_us']:.1f}us" if "graph_us" in e else "err") for label, e in row["kernels"].items()]
    print(f"{row['record']} {row['kind']} T={row['num_tokens']} H={row['num_heads']} splits={row['num_splits']}: "
          + " ".join(cells))
PY
