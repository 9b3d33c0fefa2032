#!/usr/bin/env bash
# A/B of kernel build knobs and launch switches on the 7B-shaped model, one GPU call:
#
#   bash scripts/ab_kernels.sh MODEL "label|NQ_A=1,NQ_B=0|ENV=1 ENV2=x" ...
#
# Per variant: the kernels compiled with those -D knobs ($NANOQWEN_KERNEL_DEFINES, loader.py; in parallel,
# bench/precompile.py), then `nanoqwen-cli bench` with a 1-token prompt (decode at depth 0) and
# the same with a 512-token prompt (prefill time, decode at depth 512; AB_P512=0 skips it) and
# scripts/bench_batch.py at $AB_BATCH (default 1,8,32,64; AB_BATCH= skips it), each under the variant's
# environment. Records in $AB_DIR (default /tmp/nq-ab): <label>-{d0,p512,batch}.json; a table printed last.
# AB_DIMS: the dims preset the variants are precompiled for (default 7b; 1.5b for the 1.5B's dims).
# Against an older revision: scripts/ab_base.sh REV prints a variant spec that runs REV's packages.
# One bench per variant cannot see a change below the run-to-run noise (~+-0.05 ms/token on the 7B):
# scripts/ab_decode.sh repeats the decode protocol in interleaved rounds, from a bare machine.
set -u -o pipefail
cd "$(dirname "$0")/.."
MODEL=$1; shift
PY=${PYTHON:-python3}
AB_DIR=${AB_DIR:-/tmp/nq-ab}
mkdir -p "$AB_DIR"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src${PYTHONPATH:+:$PYTHONPATH}
labels=()
for spec in "$@"; do
  IFS='|' read -r label defines envs <<<"$spec"
  labels+=("$label")
  echo "=== $label: defines [$defines] env [$envs] $(date -u +%H:%M:%S)"
  env NANOQWEN_KERNEL_DEFINES="$defines" $envs $PY packages/nanoqwen-kernels/bench/precompile.py "${AB_DIMS:-7b}" -j 14 \
    >"$AB_DIR/$label-compile.log" 2>&1 || tail -5 "$AB_DIR/$label-compile.log"
  env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 120 $PY -m nanoqwen_cli bench --model "$MODEL" \
    --prompt-tokens 1 --json >"$AB_DIR/$label-d0.json" 2>"$AB_DIR/$label-d0.err" || tail -5 "$AB_DIR/$label-d0.err"
  [ "${AB_P512:-1}" = 1 ] && { env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 120 $PY -m nanoqwen_cli bench \
    --model "$MODEL" --prompt-tokens 512 --json >"$AB_DIR/$label-p512.json" 2>"$AB_DIR/$label-p512.err" \
    || tail -5 "$AB_DIR/$label-p512.err"; }
  [ -n "${AB_BATCH-x}" ] && env NANOQWEN_KERNEL_DEFINES="$defines" $envs timeout 240 $PY scripts/bench_batch.py "$MODEL" \
    --batch "${AB_BATCH:-1,8,32,64}" --json "$AB_DIR/$label-batch.json" >"$AB_DIR/$label-batch.log" 2>&1 \
    || tail -5 "$AB_DIR/$label-batch.log"
done
$PY - "$AB_DIR" "${labels[@]}" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
print(f"{'variant':12s} {'d0 ms/tok':>9s} {'d512':>6s} {'pf512':>6s} {'pf1':>6s}  batch: step ms (tok/s)")
for label in sys.argv[2:]:
    def get(kind, key):
        try:
            return f"{json.load(open(d / f'{label}-{kind}.json'))[key]:.3f}"
        except Exception:
            return "-"
    ms = f"{get('d0', 'decode_ms_per_token'):>9s} {get('p512', 'decode_ms_per_token'):>6s} " \
         f"{get('p512', 'prefill_ms'):>6s} {get('d0', 'prefill_ms'):>6s}"
    try:
        rows = json.load(open(d / f"{label}-batch.json"))["results"]
        b = "  ".join(f"B={r['batch']}: {r['step_ms_mean']:.2f} ({r['decode_tok_s']:.0f})" for r in rows)
    except Exception as e:
        b = f"- ({type(e).__name__})"
    print(f"{label:12s} {ms}  {b}")
PYEOF
