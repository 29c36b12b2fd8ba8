#!/usr/bin/env bash
# One short run on a lent GPU machine (see the device tool's README): the kernel tests on the GPU,
# the compile gate for that GPU's architecture, then the benchmark (JSON, and a picture where
# matplotlib exists). Everything lands under $OUT. Needs only torch, triton, pytest and pluggy:
#   run: PYTHONPATH=. bash benchmarks/device_run.sh      (timeout_s ~420 leaves room for a rerun)
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 240 python -m pytest -q -p no:cacheprovider tests/kernels > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.txt"
timeout 240 python -m mla_sm120_plugin.cli bench --output "$OUT/bench.json" --plot "$OUT/bench.png" \
    > /dev/null 2> "$OUT/bench.err"
echo "bench rc=$?"; tail -3 "$OUT/bench.err"
