#!/usr/bin/env bash
# Kernel-level A/B of tile GEMM build knobs, one GPU call: bench_gemv.py's batched rows under each variant.
#
#   bash scripts/ab_gemv_knobs.sh "label|NQ_A=1,NQ_B=0|ENV=1" ...
#
# Per variant: precompile the 7B build with those -D knobs ($NANOQWEN_KERNEL_DEFINES), then bench_gemv.py
# --variant tiles at $KB_BATCH (default 8,16,32,64) under the variant's environment. Output: the INT4 rows
# and the step line of each, to stdout and $KB_DIR/<label>.txt (default /tmp/nq-kb).
# KB_TESTS=1 also runs, under each variant, scripts/tile_probe.py and test_gemv_gpu.py (-x), so a knob is
# checked in the call that measures it; KB_TESTS=probe runs only the probe (seconds, not minutes).
# KB_NCU="kernel_regex:B ..." also profiles those kernels once under each variant with Nsight Compute
# (SpeedOfLight, SchedulerStats, WarpStateStats sections), to $KB_DIR/<label>-ncu-<B>.txt.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KB_DIR=${KB_DIR:-/tmp/nq-kb}
mkdir -p "$KB_DIR"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in "$@"; do
  IFS='|' read -r label defines envs <<<"$spec"
  echo "=== $label: defines [$defines] env [$envs] $(date -u +%H:%M:%S)"
  env NANOQWEN_KERNEL_DEFINES="$defines" $envs $PY packages/nanoqwen-kernels/bench/precompile.py 7b -j 15 \
    >"$KB_DIR/$label-compile.log" 2>&1 || tail -5 "$KB_DIR/$label-compile.log"
  env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 180 $PY packages/nanoqwen-kernels/bench/bench_gemv.py \
    --batch "${KB_BATCH:-8,16,32,64}" --variant tiles --no-peer 2>&1 | grep -E "int4|qkv|gate_up|step|Error|error" \
    | tee "$KB_DIR/$label.txt"
  if [ "${KB_TESTS:-0}" != 0 ]; then
    env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 60 $PY scripts/tile_probe.py 2>&1 | tail -7
  fi
  if [ "${KB_TESTS:-0}" = 1 ]; then
    env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 240 $PY -m pytest -q -x -m gpu -p no:cacheprovider \
      packages/nanoqwen-kernels/tests/test_gemv_gpu.py 2>&1 | tail -2
  fi
  for target in ${KB_NCU:-}; do
    [ -n "$NCU" ] || { echo "no ncu on this machine"; break; }
    kern=${target%%:*} b=${target##*:}
    env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 180 "$NCU" --kernel-name "regex:$kern" --launch-skip 3 \
      --launch-count 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
      $PY packages/nanoqwen-kernels/bench/bench_gemv.py --batch "$b" --variant tiles --no-peer --reps 2 \
      >"$KB_DIR/$label-ncu-$b.txt" 2>&1
    grep -iE "Duration|Issued Ipc|Eligible Warps|No Eligible|stall|Memory Throughput|Compute \(SM\)|ERR|Cycles Per" \
      "$KB_DIR/$label-ncu-$b.txt" | cut -c1-400 | head -40
  done
done
