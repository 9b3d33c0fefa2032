#!/usr/bin/env bash
# llama.cpp beside nanoqwen on the GPU machine: build llama-bench / llama-batched-bench / llama-quantize
# with CUDA for sm_90 from the packed source (scripts/peer_llamacpp_pack.sh -> .peer/llama.cpp.tar.xz,
# carried with the call), make the 7B-shaped Q4_K_M GGUF, and run the issue's protocol on both models.
#
#   bash scripts/peer_llamacpp.sh build              # unpack + configure + build in the background (setsid,
#                                                    #   nice); ~4-5 min with 16 jobs; log $LLAMA_WORK/build.log
#   bash scripts/peer_llamacpp.sh wait [SECONDS]     # block until the build is done (or failed)
#   bash scripts/peer_llamacpp.sh prep7b TOK.gguf    # the 7B-shaped Q4_K_M GGUF in the background (setsid,
#                                                    #   nice): writes the 15 GB F16 GGUF at once (beside the
#                                                    #   build), waits for the build, llama-quantize Q4_K_M,
#                                                    #   deletes the F16; log $LLAMA_WORK/prep7b.log
#   bash scripts/peer_llamacpp.sh wait7b [SECONDS]   # block until prep7b is done (or failed)
#   bash scripts/peer_llamacpp.sh make7b TOK.gguf    # what prep7b does, in the foreground
#   bash scripts/peer_llamacpp.sh progress           # where the build and prep7b are (never blocks)
#   bash scripts/peer_llamacpp.sh bench NAME MODEL.gguf   # llama-bench + llama-batched-bench -> $OUT/llamacpp-NAME.json
#
# TOK.gguf only lends its tokenizer fields to the 7B-shaped file (write_gguf_7b.py --tokenizer-from): the
# ~6 MB .peer/qwen2.5-tokenizer.gguf of scripts/peer_tokenizer_gguf.py will do, or the real 1.5B GGUF. The
# result is $LLAMA_WORK/qwen2-7b-shaped-q4_k_m.gguf (~4.7 GB; the F16 takes 15.2 GB more until quantized).
# prep7b first copies write_gguf_7b.py, the 7B config and TOK.gguf into $LLAMA_WORK/prep7b-src, so the job
# reads nothing from the repo's tree while later calls replace it. It needs the `gguf` package: importable
# already, or unpacked from the carried .whl/gguf-*.whl into $LLAMA_WORK/site; PyYAML, which gguf imports at
# the top but this never uses, is stubbed where it is missing. Each job marks $LLAMA_WORK/NAME.done or
# NAME.failed; the jobs (setsid) outlive the call, but the machine only lives while calls keep coming.
# PREP7B_LAYERS=N makes an N-layer file instead (a check of the steps, not for benchmarks).
#
# Protocol (the same prompt lengths and batch sizes as nanoqwen's bench): llama-bench -p 512 -n 128 -fa 1
# -r 5 (and -d 512 for decode at depth 512), llama-batched-bench -npp 128 -ntg 256 -npl 1,8,32,64 -fa on.
# The machine has no network: the source and the gguf wheel (for write_gguf_7b.py) travel with the call.
# scripts/gpu_all.sh's section `peers` runs `bench` on both models beside nanoqwen's own benches, and
# scripts/peer_tables.py makes docs/PERF.md's tables of the records.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${LLAMA_WORK:-/tmp/nq-llama}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
BIN=$W/llama.cpp/build/bin
Q4_7B=$W/qwen2-7b-shaped-q4_k_m.gguf

# wait_for JOB LIMIT: poll $W/JOB.done / JOB.failed every 5 s for up to LIMIT seconds
wait_for() {
  local job=$1 limit=$2 i
  for ((i = 0; i < limit; i += 5)); do
    [ -e "$W/$job.done" ] && { echo "$job done"; return 0; }
    [ -e "$W/$job.failed" ] && { echo "$job FAILED"; tail -40 "$W/$job.log"; return 1; }
    sleep 5
  done
  echo "$job still running after ${limit}s"
  tail -3 "$W/$job.log" 2>/dev/null || true
  return 2
}

# prep_job TOK.gguf: copy what the 7B job reads into $W/prep7b-src and write the job, $W/prep7b.sh
prep_job() {
  local tok snap=$W/prep7b-src pp=${PYTHONPATH:-} whl
  tok=$(readlink -f "$1")
  [ -s "$tok" ] || { echo "no tokenizer GGUF at $1"; exit 1; }
  rm -rf "$snap"
  mkdir -p "$snap"
  cp scripts/write_gguf_7b.py "$snap/"
  cp packages/nanoqwen-format/src/nanoqwen_format/data/qwen2.5-coder-7b-instruct/config.json "$snap/"
  cp "$tok" "$snap/tokenizer.gguf"
  if ! PYTHONPATH=$pp python3 -c "import gguf" 2>/dev/null; then
    whl=$(ls .whl/gguf-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || { echo "no gguf package and no .whl/gguf-*.whl"; exit 1; }
    rm -rf "$W/site"
    python3 -m zipfile -e "$whl" "$W/site"
    pp=$W/site${pp:+:$pp}
  fi
  if ! PYTHONPATH=$pp python3 -c "import yaml" 2>/dev/null; then
    mkdir -p "$W/stub"
    printf '"""A stand-in: gguf/metadata.py imports yaml at the top, only reads model cards with it."""\n' \
      >"$W/stub/yaml.py"
    pp=$pp${pp:+:}$W/stub
  fi
  # write_gguf_7b's main() with the copied config (its CONFIG is a path inside the repo)
  cat >"$snap/run.py" <<'PY'
import os
import sys
from pathlib import Path

snap = Path(__file__).resolve().parent
sys.path.insert(0, str(snap))
import write_gguf_7b as m  # noqa: E402

m.CONFIG = snap / "config.json"
layers = ["--layers", os.environ["PREP7B_LAYERS"]] if os.environ.get("PREP7B_LAYERS") else []
sys.argv = ["write_gguf_7b.py", "--tokenizer-from", str(snap / "tokenizer.gguf"), *layers, sys.argv[1]]
sys.exit(m.main())
PY
  cat >"$W/prep7b.sh" <<EOF
set -o pipefail
cd '$W'
echo "prep7b \$(date -u +%T): writing the F16 GGUF; disk: \$(df -h . | tail -1)"
rm -f qwen2-7b-shaped-f16.gguf qwen2-7b-shaped-q4_k_m.tmp
PYTHONPATH='$pp' python3 '$snap/run.py' '$W/qwen2-7b-shaped-f16.gguf' || exit 1
echo "prep7b \$(date -u +%T): waiting for the llama.cpp build"
for ((i = 0; i < 1800; i += 5)); do
  [ -e build.done ] && break
  [ -e build.failed ] && { echo "prep7b: the llama.cpp build failed"; exit 1; }
  sleep 5
done
[ -e build.done ] || { echo "prep7b: no llama.cpp build after 1800 s"; exit 1; }
echo "prep7b \$(date -u +%T): llama-quantize Q4_K_M"
'$BIN/llama-quantize' qwen2-7b-shaped-f16.gguf qwen2-7b-shaped-q4_k_m.tmp Q4_K_M \$(nproc) 2>&1 || exit 1
mv qwen2-7b-shaped-q4_k_m.tmp '$Q4_7B' && rm -f qwen2-7b-shaped-f16.gguf || exit 1
ls -la '$Q4_7B'
echo "prep7b \$(date -u +%T): done"
EOF
}

case "${1:-}" in
build)
  rm -rf "$W/llama.cpp"
  tar -C "$W" -xJf .peer/llama.cpp.tar.xz
  rm -f "$W/build.done" "$W/build.failed"
  setsid nice -n 10 bash -c "cd '$W/llama.cpp' && { cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      && cmake --build build -j \$(nproc) --target llama-bench llama-batched-bench llama-quantize; } \
      >'$W/build.log' 2>&1 && touch '$W/build.done' || touch '$W/build.failed'" </dev/null >/dev/null 2>&1 &
  echo "llama.cpp build started in the background ($(cat "$W/llama.cpp/NANOQWEN_LLAMACPP_COMMIT" | tr '\n' ' '))"
  ;;
wait)
  wait_for build "${2:-540}"
  ls "$BIN"
  ;;
prep7b)
  rm -f "$W/prep7b.done" "$W/prep7b.failed"
  if [ -s "$Q4_7B" ]; then
    echo "$Q4_7B exists"
    touch "$W/prep7b.done"
    exit 0
  fi
  prep_job "${2:?usage: peer_llamacpp.sh prep7b TOKENIZER.gguf}"
  setsid nice -n 10 bash -c "bash '$W/prep7b.sh' && touch '$W/prep7b.done' || touch '$W/prep7b.failed'" \
    >"$W/prep7b.log" 2>&1 </dev/null &
  echo "7B-shaped GGUF job started in the background (log $W/prep7b.log)"
  ;;
wait7b)
  wait_for prep7b "${2:-540}"
  ls -la "$Q4_7B"
  ;;
make7b)
  if [ ! -s "$Q4_7B" ]; then
    prep_job "${2:?usage: peer_llamacpp.sh make7b TOKENIZER.gguf}"
    bash "$W/prep7b.sh"
  fi
  ls -la "$Q4_7B"
  ;;
progress)
  for job in build prep7b; do
    if [ -e "$W/$job.done" ]; then state=done; elif [ -e "$W/$job.failed" ]; then state=FAILED; else state=running; fi
    [ -e "$W/$job.log" ] || state="not started"
    echo "$job: $state: $(tail -1 "$W/$job.log" 2>/dev/null)"
  done
  ls -la "$W"/*.gguf 2>/dev/null || true
  df -h "$W" | tail -1
  ;;
bench)
  name=$2 model=$3
  [ -x "$BIN/llama-bench" ] || { echo "no llama.cpp build in $BIN"; exit 1; }
  [ -s "$model" ] || { echo "no model at $model"; exit 1; }
  rc=0
  rm -f "$W/bench-$name.json" "$W/bench-depth-$name.json" "$W/batched-$name.jsonl" "$W/batched-$name.log"
  "$BIN/llama-bench" -m "$model" -p 512 -n 128 -fa 1 -r 5 -o json >"$W/bench-$name.json" || rc=1
  "$BIN/llama-bench" -m "$model" -p 0 -n 128 -d 512 -fa 1 -r 5 -o json >"$W/bench-depth-$name.json" || rc=1
  "$BIN/llama-batched-bench" -m "$model" -c 32768 -b 2048 -ub 512 -npp 128 -ntg 256 -npl 1,8,32,64 -fa on \
      --output-format jsonl >"$W/batched-$name.jsonl" 2>"$W/batched-$name.log" || { rc=1; tail -5 "$W/batched-$name.log"; }
  python3 - "$name" "$W" "$OUT" <<'PY'
import json, sys
name, w, out = sys.argv[1:]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        return []
def lines(path):  # the jsonl lines of llama-batched-bench, on stdout or stderr by version
    try:
        return [json.loads(l) for l in open(path) if l.startswith("{")]
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        return []
rec = {"model": name, "commit": open(f"{w}/llama.cpp/NANOQWEN_LLAMACPP_COMMIT").read().split(),
       "bench": load(f"{w}/bench-{name}.json"),
       "bench_depth512": load(f"{w}/bench-depth-{name}.json"),
       "batched": lines(f"{w}/batched-{name}.jsonl") + lines(f"{w}/batched-{name}.log")}
json.dump(rec, open(f"{out}/llamacpp-{name}.json", "w"), indent=1)
for b in rec["bench"] + rec["bench_depth512"]:
    print(f"llama-bench {name}: pp{b['n_prompt']} tg{b['n_gen']} depth{b.get('n_depth', 0)}: {b['avg_ts']:.1f} tok/s")
for b in rec["batched"]:
    print(f"batched {name}: pl{b.get('pl')} S_TG {b.get('speed_tg', 0):.1f} tok/s  S_PP {b.get('speed_pp', 0):.1f}")
PY
  exit $rc
  ;;
*)
  sed -n 2,16p "$0"
  exit 2
  ;;
esac
