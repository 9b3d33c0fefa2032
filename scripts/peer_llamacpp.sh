#!/usr/bin/env bash
# llama.cpp beside nanoqwen on the GPU machine: build llama-bench / llama-batched-bench / llama-quantize
# with CUDA for sm_90 from the packed source (scripts/peer_llamacpp_pack.sh -> .peer/llama.cpp.tar.xz,
# carried with the call), make the 7B-shaped Q4_K_M GGUF, and run the issue's protocol on both models.
#
#   bash scripts/peer_llamacpp.sh build              # unpack + configure + build in the background (setsid);
#                                                     #   ~5 min with 16 jobs; log in $LLAMA_WORK/build.log
#   bash scripts/peer_llamacpp.sh wait [SECONDS]     # block until the build is done (or failed)
#   bash scripts/peer_llamacpp.sh make7b REAL.gguf   # 7B-shaped F16 GGUF (write_gguf_7b.py) -> Q4_K_M; REAL.gguf
#                                                    # only lends its tokenizer fields: the ~6 MB file of
#                                                    # scripts/peer_tokenizer_gguf.py (carried in .peer/) will do
#   bash scripts/peer_llamacpp.sh bench NAME MODEL.gguf   # llama-bench + llama-batched-bench -> $OUT/llamacpp-NAME.json
#
# Protocol (the same prompt lengths and batch sizes as nanoqwen's bench): llama-bench -p 512 -n 128 -fa 1
# -r 5 (and -d 512 for decode at depth 512), llama-batched-bench -npp 128 -ntg 256 -npl 1,8,32,64 -fa on.
# The machine has no network: the source and the gguf wheel (for write_gguf_7b.py) travel with the call.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${LLAMA_WORK:-/tmp/nq-llama}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
BIN=$W/llama.cpp/build/bin
case "${1:-}" in
build)
  rm -rf "$W/llama.cpp"
  tar -C "$W" -xJf .peer/llama.cpp.tar.xz
  rm -f "$W/build.done" "$W/build.failed"
  setsid bash -c "cd '$W/llama.cpp' && { cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      && cmake --build build -j \$(nproc) --target llama-bench llama-batched-bench llama-quantize; } \
      >'$W/build.log' 2>&1 && touch '$W/build.done' || touch '$W/build.failed'" </dev/null >/dev/null 2>&1 &
  echo "llama.cpp build started in the background ($(cat "$W/llama.cpp/NANOQWEN_LLAMACPP_COMMIT" | tr '\n' ' '))"
  ;;
wait)
  limit=${2:-540}
  for ((i = 0; i < limit; i += 5)); do
    [ -e "$W/build.done" ] && { echo "build done"; ls "$BIN"; exit 0; }
    [ -e "$W/build.failed" ] && { echo "build FAILED"; tail -40 "$W/build.log"; exit 1; }
    sleep 5
  done
  echo "build still running after ${limit}s"; tail -3 "$W/build.log"; exit 2
  ;;
make7b)
  real=$2
  python3 scripts/write_gguf_7b.py --tokenizer-from "$real" "$W/qwen2-7b-shaped-f16.gguf"
  "$BIN/llama-quantize" "$W/qwen2-7b-shaped-f16.gguf" "$W/qwen2-7b-shaped-q4_k_m.gguf" Q4_K_M $(nproc) | tail -3
  rm -f "$W/qwen2-7b-shaped-f16.gguf"
  ls -la "$W/qwen2-7b-shaped-q4_k_m.gguf"
  ;;
bench)
  name=$2 model=$3
  "$BIN/llama-bench" -m "$model" -p 512 -n 128 -fa 1 -r 5 -o json >"$W/bench-$name.json"
  "$BIN/llama-bench" -m "$model" -p 0 -n 128 -d 512 -fa 1 -r 5 -o json >"$W/bench-depth-$name.json"
  "$BIN/llama-batched-bench" -m "$model" -c 32768 -b 2048 -ub 512 -npp 128 -ntg 256 -npl 1,8,32,64 -fa on \
      --output-format jsonl >"$W/batched-$name.jsonl" 2>"$W/batched-$name.log"
  python3 - "$name" "$W" "$OUT" <<'PY'
import json, sys
name, w, out = sys.argv[1:]
rec = {"model": name, "commit": open(f"{w}/llama.cpp/NANOQWEN_LLAMACPP_COMMIT").read().split(),
       "bench": json.load(open(f"{w}/bench-{name}.json")),
       "bench_depth512": json.load(open(f"{w}/bench-depth-{name}.json")),
       "batched": [json.loads(l) for f in ("jsonl", "log") for l in open(f"{w}/batched-{name}.{f}")
                   if l.startswith("{")]}
json.dump(rec, open(f"{out}/llamacpp-{name}.json", "w"), indent=1)
for b in rec["bench"] + rec["bench_depth512"]:
    print(f"llama-bench {name}: pp{b['n_prompt']} tg{b['n_gen']} depth{b.get('n_depth', 0)}: {b['avg_ts']:.1f} tok/s")
for b in rec["batched"]:
    print(f"batched {name}: pl{b.get('pl')} S_TG {b.get('speed_tg', 0):.1f} tok/s  S_PP {b.get('speed_pp', 0):.1f}")
PY
  ;;
*)
  sed -n 2,13p "$0"; exit 2 ;;
esac
