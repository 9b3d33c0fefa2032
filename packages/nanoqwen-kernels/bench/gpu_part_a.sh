#!/usr/bin/env bash
# One device call for kernels part A (issue 4): GPU tests, compute-sanitizer memcheck + racecheck on the
# tiny build, then the GEMV benchmark with the tensor-core variants (--sweep). Logs under $OUT (or
# ./gpu-out); a short summary last. Budget: ~3-6 min (run 2 took 104 s with one GEMV variant; the tests
# now build three). Each step's limit can be set: TEST_S, SAN_S, RACE_S, BENCH_S (seconds).
#   bash packages/nanoqwen-kernels/bench/gpu_part_a.sh
set -u -o pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src
export PYTHONUNBUFFERED=1 NANOQWEN_KERNEL_CACHE=/tmp/nq-kcache
T=packages/nanoqwen-kernels/tests
TESTS="$T/test_gemv_gpu.py $T/test_norm_embed_gpu.py $T/test_sampling_gpu.py"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"

timeout ${TEST_S:-150} $PY -m pytest $TESTS -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
# sanitizers: tiny build only (instrumented kernels run 10-100x slower), sampler distribution excluded
SEL="tiny and not distribution"
timeout ${SAN_S:-45} "$CS" --tool memcheck --leak-check no --error-exitcode 99 $PY -m pytest $TESTS -m gpu -q -x \
  -p no:cacheprovider -k "$SEL" >"$OUT/memcheck.log" 2>&1
mem_rc=$?
# racecheck instruments every shared-memory access: the sampler tests that draw hundreds of times are
# left to memcheck; one draw-heavy test (repetition penalty, 105 draws) still covers nq_sample
RSEL="tiny and not distribution and not masks and not seeded"
timeout ${RACE_S:-75} "$CS" --tool racecheck --error-exitcode 99 $PY -m pytest $TESTS -m gpu -q -x \
  -p no:cacheprovider -k "$RSEL" >"$OUT/racecheck.log" 2>&1
race_rc=$?
timeout ${BENCH_S:-90} $PY packages/nanoqwen-kernels/bench/bench_gemv.py --reps 30 --sweep --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log"
bench_rc=$?

echo "=== summary (part A) ==="
cat "$OUT/device.txt"
echo "gpu tests rc=$tests_rc: $(tail -1 "$OUT/gpu_tests.log")"
echo "memcheck rc=$mem_rc: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/memcheck.log" | tail -2 | tr '\n' ' ')"
echo "racecheck rc=$race_rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed|failed' "$OUT/racecheck.log" | tail -2 | tr '\n' ' ')"
echo "bench rc=$bench_rc"
grep -E "^(gemv|qkv|gate|cuBLAS)" "$OUT/bench.log"
