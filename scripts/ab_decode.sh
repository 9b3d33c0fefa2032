#!/usr/bin/env bash
# Interleaved A/B of decode variants on the decode protocol, one GPU call from a bare machine:
#
#   MODELS="7b 1.5b" ROUNDS="1 2 3" RUNS=5 bash scripts/ab_decode.sh "label|DEFINES|ENV=.. ENV2=.." ...
#
# e.g. "base||NANOQWEN_DECODE_ACTIVATIONS=int8" "knob|NQ_SOME_KNOB=1|NANOQWEN_DECODE_ACTIVATIONS=int8".
# Setup first: the kernel caches seeded from .kc/ when the call carries it (scripts/kernel_cache_for_device.sh:
# the builds compiled on the CPU machine), the synthetic models (MODELS: 7b = the 7B-shaped file, 1.5b = the
# real 1.5B's dims; written once under /tmp), every kernel build precompiled for each model with no defines and with each of
# $PRE_DEFS (space-separated define sets, e.g. "NQ_SOME_KNOB=1"), and, when $TESTS is set, pytest on it
# (groups separated by ';', each its own pytest process: the packages' tests have their own conftests).
# Then per round, per model, per variant: `nanoqwen-cli bench` (a 512-token prompt + 128 generated,
# $RUNS runs, median) in its own process, under the variant's -D defines ($NANOQWEN_KERNEL_DEFINES) and
# environment; one line each: model, label, round, prompt tokens, prefill ms, decode ms/token.
# $PROMPT, $BENCH_ARGS (more bench options, e.g. "--device cpu --gen-tokens 4" for a CPU smoke run on a
# small model path) change the protocol. Why rounds: run-to-run noise on the H200 is about +-0.05 ms/token on the 7B (docs/PERF.md, sixteenth
# lease), so a variant counts as better only if it wins in every round. Records: $OUT/<model>-<label>-r<N>.csv.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ab-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src${PYTHONPATH:+:$PYTHONPATH}
# one kernel cache for the precompile, the tests and the benches (the loader writes a cubin by rename, so
# the background precompile and the tests may fill it at once): a build is compiled once per call
export NANOQWEN_KERNEL_CACHE=${NANOQWEN_KERNEL_CACHE:-/tmp/nq-ab-kc}
export NANOQWEN_TEST_KERNEL_CACHE=${NANOQWEN_TEST_KERNEL_CACHE:-$NANOQWEN_KERNEL_CACHE}
export NANOQWEN_CACHE=${NANOQWEN_CACHE:-/tmp/nq-ab-cache} PYTHONUNBUFFERED=1
mkdir -p "$NANOQWEN_CACHE" "$NANOQWEN_KERNEL_CACHE"
# builds compiled beforehand on the CPU machine (scripts/kernel_cache_for_device.sh; carried as .kc)
[ -d .kc ] && { cp -n .kc/*.cubin "$NANOQWEN_KERNEL_CACHE"/ 2>/dev/null || true; }
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
MODELS=${MODELS:-7b}
model_file() { case $1 in 7b) echo "$NANOQWEN_CACHE/ab-7b.nanoqwen";; 1.5b) echo "$NANOQWEN_CACHE/ab-1.5b-dims.nanoqwen";;
  *) echo "$1";; esac; }  # anything else: a .nanoqwen path

for m in $MODELS; do
  [ "$m" = 7b ] || [ "$m" = 1.5b ] || continue
  for d in "" ${PRE_DEFS:-}; do
    NANOQWEN_KERNEL_DEFINES=$d $PY packages/nanoqwen-kernels/bench/precompile.py "$m" -j 4 >>"$OUT/precompile.log" 2>&1 &
  done
done
for m in $MODELS; do
  f=$(model_file "$m")
  [ -f "$f" ] && continue
  case $m in
    7b) $PY -c "import sys; from nanoqwen_format.synthetic import qwen7b_config, write_synthetic
write_synthetic(sys.argv[1], qwen7b_config(), seed=0)" "$f" >/dev/null ;;
    1.5b) $PY scripts/write_synthetic_1p5b.py "$f" >/dev/null ;;
  esac
done
t models ready
if [ -n "${TESTS:-}" ]; then
  IFS=';' read -ra groups <<<"$TESTS"
  for i in "${!groups[@]}"; do
    timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -rfEs ${groups[$i]} >"$OUT/tests$i.log" 2>&1
    t "tests group $i rc=$?: $(tail -1 "$OUT/tests$i.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests$i.log" | head
  done
fi
wait
t precompiled
for r in ${ROUNDS:-1 2}; do
  for m in $MODELS; do
    f=$(model_file "$m")
    name=$(basename "$m" .nanoqwen)
    for spec in "$@"; do
      IFS='|' read -r label defs envs <<<"$spec"
      rec="$OUT/$name-$label-r$r"
      env NANOQWEN_KERNEL_DEFINES="$defs" $envs timeout 120 $PY -m nanoqwen_cli bench --model "$f" --no-verify \
        --prompt-tokens "${PROMPT:-512}" --runs "${RUNS:-3}" --format csv ${BENCH_ARGS:-} >"$rec.csv" 2>"$rec.err" \
        || tail -3 "$rec.err"
      echo "$name $label r$r $(tail -1 "$rec.csv" | cut -d, -f6,9,13)"
    done
  done
  t "round $r"
done
