#!/usr/bin/env bash
# One device call for the kernels package: the GPU tests (in parallel: numpy references are the slow part),
# the GEMV benchmark at batch 1, 8, 32, 64 (B = 1 on every variant), then compute-sanitizer memcheck and
# racecheck on the tiny build of the GEMV / norm / embed tests. Logs under $OUT (or ./gpu-out); a short
# summary last. $NANOQWEN_TEST_KERNEL_CACHE may name a cache of cubins compiled beforehand with the
# device's NVRTC version (no compile on the device then). Each step's limit: TEST_S, SAN_S, RACE_S,
# BENCH_S (seconds); the GPU test files in $TESTS (default: every kernels test), extra pytest arguments in
# $TEST_ARGS, pytest-xdist workers in $WORKERS, the benchmark's batch sizes in $BATCHES and its GEMV
# variants (every B) in $VARIANTS (default: the default variant; e.g. VARIANTS=default,tiles).
#   bash packages/nanoqwen-kernels/bench/gpu_kernels.sh
set -u -o pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src
export PYTHONUNBUFFERED=1
export NANOQWEN_KERNEL_CACHE=${NANOQWEN_TEST_KERNEL_CACHE:-/tmp/nq-kcache}
T=packages/nanoqwen-kernels/tests
TESTS=${TESTS:-$T}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

timeout ${TEST_S:-240} $PY -m pytest $TESTS -m gpu -q -p no:cacheprovider -n ${WORKERS:-8} ${TEST_ARGS:-} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -40
tests_rc=$?
timeout ${BENCH_S:-120} $PY packages/nanoqwen-kernels/bench/bench_gemv.py --batch ${BATCHES:-1,8,32,64} --sweep \
  --variant ${VARIANTS:-default} \
  --json "$OUT/bench_gemv.json" 2>&1 | tee "$OUT/bench_gemv.log"
bench_rc=$?
SAN_TESTS="$T/test_gemv_gpu.py $T/test_norm_embed_gpu.py"
timeout ${SAN_S:-60} "$CS" --tool memcheck --leak-check no --error-exitcode 99 $PY -m pytest $SAN_TESTS -m gpu -q -x \
  -p no:cacheprovider -k "tiny" >"$OUT/memcheck.log" 2>&1
mem_rc=$?
timeout ${RACE_S:-60} "$CS" --tool racecheck --error-exitcode 99 $PY -m pytest $SAN_TESTS -m gpu -q -x \
  -p no:cacheprovider -k "tiny and (9 or 33)" >"$OUT/racecheck.log" 2>&1
race_rc=$?

echo "=== summary ==="
cat "$OUT/device.txt"
echo "gpu tests rc=$tests_rc: $(tail -1 "$OUT/gpu_tests.log")"
echo "memcheck rc=$mem_rc: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/memcheck.log" | tail -2 | tr '\n' ' ')"
echo "racecheck rc=$race_rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed|failed' "$OUT/racecheck.log" | tail -2 | tr '\n' ' ')"
echo "bench rc=$bench_rc"
