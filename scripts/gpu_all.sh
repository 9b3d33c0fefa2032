#!/usr/bin/env bash
# Every GPU test and benchmark of nanoqwen in one call, on a bare GPU machine (no installs): run from the
# repo root or anywhere; logs under $OUT (default ./gpu-out); a summary table printed last.
#
#   bash scripts/gpu_all.sh                       # everything. Measured on the H200 (2026-11-30): info +
#                                                 #   model7b + engine + the full ladder = 82 s; the kernels'
#                                                 #   tests, their benches and the CLI bench come on top
#   GPU_ALL_QUICK=1 bash scripts/gpu_all.sh       # a reduced ladder (30 prompts x 32 tokens, 7B 1 x 4)
#   GPU_ALL_SECTIONS="kernels ladder" bash ...    # some sections only (clibench_graph: graph mode only;
#                                                 #   kernels_decode / kernels_prefill: half the kernels' suite)
#
# Sections (real, serve, llamacpp and peers need $NQ_REAL_GGUF / the carried .whl and .peer; see their comments):
# info, model7b (writes the 7B-shaped synthetic file once, shared by the ladder and the bench),
# kernels / engine / ladder / cli (pytest -m gpu of each suite; cli = tests/test_cli_gpu.py), kbench (packages/nanoqwen-kernels/bench/*.py),
# gemvvariants (bench_gemv.py: the GEMV variants "tiles" (the default), "default" and "a8" at B = 1 .. 64),
# clibench (nanoqwen-cli bench --synthetic 7b --json, graph, eager, then --decode-activations fp16), batchbench (scripts/bench_batch.py:
# batched decode throughput, B = 1, 8, 32, 64 requests of 128 + 256 tokens at once, then the same levels
# through `nanoqwen-cli bench --concurrency`), breakdown
# pdl (NANOQWEN_PDL=0/1 A/B), prefill (prefill graphs A/B, 7B and the 1.5B's dims),
# (scripts/decode_breakdown.py: the decode step's time per kernel family vs its byte floor, batch 1 at
# context 640, then batch 32 at context 384, then the step timeline of a stamped build, then the read floor of
# one launch: scripts/read_floor_probe.py, then the down_proj -> q/k/v hand-off as two launches or one kernel:
# scripts/handoff_probe.py), peer (scripts/peer_transformers.py: HF transformers bf16
# eager, same shape and protocol, then its prefill at 512 / 2k / 8k / 32k tokens; needs torch), real (the real 1.5B: conversion, tier, bench), serve,
# llamacpp (llama.cpp on the real 1.5B only), and, not in the default set, peers (issue 18: nanoqwen beside
# llama.cpp and transformers on the 7B-shaped model and the real 1.5B, the same shapes on both sides, and
# scripts/peer_tables.py's markdown tables; after `peer_llamacpp.sh build` and `prep7b` earlier in the
# lease: GPU_ALL_SECTIONS="info model7b peers"), and ncu (Nsight Compute counters of the batch-1 GEMVs).
# Each section runs under its own
# timeout (SECTION_TIMEOUT_<name>, seconds), so one hang costs one section, not the call.
# Files back from $OUT (the device tool returns at most 8): gpu_all.log (everything), summary.txt,
# bench_7b_graph.json, bench_7b_eager.json, bench_batch_7b.json, breakdown_7b.json, peer_transformers.json,
# details.tar.gz (per-section logs, ladder JSON reports, the batch-32 breakdown JSON); peers adds
# peer_tables.md and peers.tar.gz (its JSON records).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
WORK=${GPU_ALL_WORK:-/tmp/nq-gpu-all}
mkdir -p "$WORK/logs" "$WORK/ladder"
PY=${PYTHON:-python3}
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export NANOQWEN_KERNEL_CACHE=${NANOQWEN_KERNEL_CACHE:-$WORK/kcache}
# builds compiled beforehand on the CPU machine (scripts/kernel_cache_for_device.sh), when the call carries .kc;
# the kernels test suite reads the same cache (packages/nanoqwen-kernels/tests/conftest.py:
# $NANOQWEN_TEST_KERNEL_CACHE), so what one section compiles the next one finds
export NANOQWEN_TEST_KERNEL_CACHE=${NANOQWEN_TEST_KERNEL_CACHE:-$NANOQWEN_KERNEL_CACHE}
mkdir -p "$NANOQWEN_KERNEL_CACHE"
[ -d .kc ] && { cp -n .kc/*.cubin "$NANOQWEN_KERNEL_CACHE"/ 2>/dev/null || true; }
export NANOQWEN_CACHE=${NANOQWEN_CACHE:-$WORK/cache}
export NANOQWEN_LADDER_MODELS=${NANOQWEN_LADDER_MODELS:-$WORK/models}
export NANOQWEN_LADDER_OUT=$WORK/ladder
export NANOQWEN_GRAPH_DOT=$WORK/ladder/decode_graph.dot
# the bench's synthetic 7B (seed 0) is the ladder's 7B too: written once
export NANOQWEN_LADDER_7B=${NANOQWEN_LADDER_7B:-$NANOQWEN_CACHE/synthetic-7b-seed0.nanoqwen}
if [ "${GPU_ALL_QUICK:-0}" = 1 ]; then
  export NANOQWEN_LADDER_PROMPTS=${NANOQWEN_LADDER_PROMPTS:-30} NANOQWEN_LADDER_TOKENS=${NANOQWEN_LADDER_TOKENS:-32}
  export NANOQWEN_LADDER_7B_PROMPTS=${NANOQWEN_LADDER_7B_PROMPTS:-1} NANOQWEN_LADDER_7B_TOKENS=${NANOQWEN_LADDER_7B_TOKENS:-4}
fi
SECTIONS=${GPU_ALL_SECTIONS:-info model7b kernels engine ladder cli kbench gemvvariants clibench batchbench pdl prefill breakdown peer real serve llamacpp}
TABLE=$WORK/sections.tsv
: >"$TABLE"
LOG=$OUT/gpu_all.log
: >"$LOG"

want() { [[ " $SECTIONS " == *" $1 "* ]]; }

# run NAME TIMEOUT CMD...: log to $WORK/logs/NAME.log and gpu_all.log; one row of the table
run() {
  local name=$1 limit=$2; shift 2
  local var="SECTION_TIMEOUT_$name"
  limit=${!var:-$limit}
  echo "=== [$name] $* (timeout ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$WORK/logs/$name.log" >>"$TABLE"
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

if want info; then
  run info 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; \
    echo commit=${NQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; \
    $PY -c 'import cupy, sys; from cupy_backends.cuda.libs import nvrtc; \
print(\"python\", sys.version.split()[0], \"cupy\", cupy.__version__, \"nvrtc\", nvrtc.getVersion())'"
fi
if want model7b; then
  run model7b 90 $PY -c "
import os, time
from pathlib import Path
from nanoqwen_format.synthetic import qwen7b_config, write_synthetic
p = Path(os.environ['NANOQWEN_LADDER_7B'])
if p.exists():
    print('exists', p)
else:
    p.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter(); tmp = p.with_suffix('.tmp')
    write_synthetic(tmp, qwen7b_config(), seed=0); os.replace(tmp, p)
    print(f'wrote {p} ({p.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s')
"
fi
PYTEST="$PY -m pytest -q -m gpu -p no:cacheprovider -rfEs"
# The kernels' GPU suite (642 tests) in two halves, each its own section and timeout: it does not fit one device
# call (600 s). 2026-12-04 (docs/VALIDATION.md, thirty-third session), with the launchers' builds carried in .kc
# (the tests' own builds, their defines, compile on the device): its first 342 tests (decode and prefill
# attention, most of test_gemv_gpu.py) took ~440 s, and head_i8, norms/embed, PDL and sampling (68) 158 s on a
# fresh machine; neither half has been timed whole yet. `kernels` runs both; kernels_decode / kernels_prefill one.
KT=packages/nanoqwen-kernels/tests
# the prefill kernels' files; every other file (a new one included) runs in kernels_decode
PREFILL_TESTS="$KT/test_attention_prefill.py $KT/test_prefill_gemm.py $KT/test_prefill_gemm_fp8.py $KT/test_prefill_rope_kv.py"
if want kernels || want kernels_decode; then
  run kernels_decode 560 $PYTEST $KT $(printf -- '--ignore=%s ' $PREFILL_TESTS)
fi
if want kernels || want kernels_prefill; then
  run kernels_prefill 560 $PYTEST $PREFILL_TESTS
fi
# which x element each tile-GEMM output read (scripts/tile_probe.py: a layout bug shows as a pattern)
want kernels && run tile_probe 60 $PY scripts/tile_probe.py
# 180 s: its 39 tests take ~13 s once their kernel builds are cached, but a call without `kernels` before it
# compiles the engine's builds here first, and 60 s was too short for that (twenty-seventh lease)
want engine && run engine 180 $PYTEST packages/nanoqwen-engine/tests
# GPU_ALL_LADDER_K: a pytest -k expression to run part of the ladder (e.g. "not 7b")
want ladder && run ladder 240 $PYTEST -s ${GPU_ALL_LADDER_K:+-k "$GPU_ALL_LADDER_K"} tests/test_ladder_layer.py \
  tests/test_ladder_graph.py
want cli && run cli 120 $PYTEST tests/test_cli_gpu.py
if want kbench; then
  for b in packages/nanoqwen-kernels/bench/*.py; do
    [ -f "$b" ] || continue
    run "kbench_$(basename "$b" .py)" 90 $PY "$b"
  done
fi
# The batched GEMV bodies side by side (issue 13/15): the default ("tiles": half2 loop at B = 1, tile GEMM
# beyond), the tensor-core core's passes at B > 1 ("default") and the int8-activation loop at B = 1 ("a8");
# the lm_head rows add its other B > 1 body (gemv_mma).
want gemvvariants && run gemvvariants 240 $PY packages/nanoqwen-kernels/bench/bench_gemv.py --batch 1,8,16,32,64 \
  --variant tiles,default,a8 --no-peer --json "$WORK/logs/bench_gemv_variants.json"
if want clibench || want clibench_graph; then
  if [ -d packages/nanoqwen-cli/src/nanoqwen_cli ]; then
    # the bench finds the 7B file the model7b section wrote in $NANOQWEN_CACHE
    run clibench_graph 120 bash -c "$PY -m nanoqwen_cli bench --synthetic 7b --json > '$OUT/bench_7b_graph.json'; \
      rc=\$?; cat '$OUT/bench_7b_graph.json'; exit \$rc"
    want clibench && run clibench_eager 120 bash -c "$PY -m nanoqwen_cli bench --synthetic 7b --eager --json > '$OUT/bench_7b_eager.json'; \
      rc=\$?; cat '$OUT/bench_7b_eager.json'; exit \$rc"
    # fp16 decode activations (int8 is the default since the twenty-first lease; recorded beside it)
    want clibench && run clibench_fp16 120 $PY -m nanoqwen_cli bench --synthetic 7b --decode-activations fp16
  else
    echo "no nanoqwen_cli package: clibench skipped" | tee -a "$LOG"
  fi
fi

# Issue 13's protocol at the backend level (aggregate tok/s, inter-token latency, TTFT per batch size).
want batchbench && run batchbench 300 $PY scripts/bench_batch.py "$NANOQWEN_LADDER_7B" --json "$OUT/bench_batch_7b.json"
# ... and through the engine's batched API as a user runs it (the CLI: scheduler, chunked prefill, streaming
# handles), 128-token prompts + 256 generated per request, 2 timed runs per level; the record lands in
# $WORK/logs/cli_concurrency_7b.json (details.tar.gz) and is printed
want batchbench && run cli_concurrency 400 bash -c "$PY -m nanoqwen_cli bench --synthetic 7b --prompt-tokens 128 \
  --gen-tokens 256 --concurrency 1,8,32,64 --runs 2 --warmup 1 --json > '$WORK/logs/cli_concurrency_7b.json'; \
  rc=\$?; cat '$WORK/logs/cli_concurrency_7b.json'; exit \$rc"
# Programmatic dependent launch A/B (issue 15): the same benches with NANOQWEN_PDL=0 (plain launches) and
# =1 (the default), each in its own process: the 7B decode (512 + 128, and a 1-token prompt for depth 0),
# bench_batch at 1 / 8 / 32 / 64, and the real 1.5B's decode where its conversion exists. Records in
# $WORK/logs/pdl{0,1}-*.json (back in details.tar.gz).
if want pdl; then
  for v in 0 1; do
    run "pdl${v}_bench" 120 bash -c "NANOQWEN_PDL=$v $PY -m nanoqwen_cli bench --synthetic 7b --json \
      >'$WORK/logs/pdl$v-7b.json'; rc=\$?; cat '$WORK/logs/pdl$v-7b.json'; exit \$rc"
    run "pdl${v}_bench_d0" 90 bash -c "NANOQWEN_PDL=$v $PY -m nanoqwen_cli bench --synthetic 7b --prompt-tokens 1 \
      --json >'$WORK/logs/pdl$v-7b-d0.json'; rc=\$?; cat '$WORK/logs/pdl$v-7b-d0.json'; exit \$rc"
    if [ -f "$NANOQWEN_CACHE/qwen2.5-coder-1.5b-instruct.nanoqwen" ]; then
      run "pdl${v}_real" 90 bash -c "NANOQWEN_PDL=$v $PY -m nanoqwen_cli bench \
        --model '$NANOQWEN_CACHE/qwen2.5-coder-1.5b-instruct.nanoqwen' --json >'$WORK/logs/pdl$v-real.json'; \
        rc=\$?; cat '$WORK/logs/pdl$v-real.json'; exit \$rc"
    fi
    run "pdl${v}_batch" 240 env NANOQWEN_PDL=$v $PY scripts/bench_batch.py "$NANOQWEN_LADDER_7B" \
      --json "$WORK/logs/pdl$v-batch-7b.json"
  done
fi
# Prefill graphs A/B (issue 16): nanoqwen-cli bench with a 512- and a 1-token prompt, NANOQWEN_PREFILL_GRAPHS=1
# (the default) and =0, on the 7B and on a synthetic model of the real 1.5B's dims (written once), and
# bench_batch on the 1.5B dims both ways (TTFT with several prompts per prefill pass); then the long
# prompts' breakdown and time to first token. Records in $WORK/logs/prefill-*.json.
if want prefill; then
  S15=$NANOQWEN_CACHE/synthetic-1.5b-dims-seed0.nanoqwen
  [ -f "$S15" ] || run prefill_s15 90 $PY scripts/write_synthetic_1p5b.py "$S15"
  for g in 1 0; do
    for m in 7b:"$NANOQWEN_LADDER_7B" 1.5b:"$S15"; do
      for p in 512 1; do
        run "prefill_g${g}_${m%%:*}_p$p" 90 bash -c "NANOQWEN_PREFILL_GRAPHS=$g $PY -m nanoqwen_cli bench \
          --model '${m#*:}' --prompt-tokens $p --json >'$WORK/logs/prefill-g$g-${m%%:*}-p$p.json'; \
          rc=\$?; cat '$WORK/logs/prefill-g$g-${m%%:*}-p$p.json'; exit \$rc"
      done
    done
    run "prefill_g${g}_batch_1.5b" 150 env NANOQWEN_PREFILL_GRAPHS=$g $PY scripts/bench_batch.py "$S15" \
      --json "$WORK/logs/prefill-g$g-batch-1.5b.json"
  done
  # where a long prompt's time goes (scripts/prefill_breakdown.py: every launch timed, per kernel and
  # matrix), and the time to first token at 8k / 32k through the scheduler (its idle budget, then 512-token
  # steps as a busy server gives them)
  run prefill_breakdown_7b 240 $PY scripts/prefill_breakdown.py "$NANOQWEN_LADDER_7B" --tokens 512,8192,32768 \
    --json "$WORK/logs/prefill-breakdown-7b.json"
  for idle in 8192 512; do
    run "prefill_long_idle$idle" 240 $PY -m nanoqwen_cli bench --model "$NANOQWEN_LADDER_7B" \
      --prompt-tokens 8192,32000 --gen-tokens 4 --runs 3 --prefill-chunk-idle $idle --format csv
  done
  # the opt-in FP8 prefill (prefill_weights="fp8"): its GEMMs against cuBLAS fp16, the time to first token
  # with it (512 in 5 runs: a 3-run median would include the graph capture) and where an 8k prompt's time goes
  run prefill_fp8_gemm 200 $PY packages/nanoqwen-kernels/bench/bench_prefill_gemm.py 7b 1.5b --fp8 --m 512,2048,8192
  run prefill_fp8_512 120 $PY -m nanoqwen_cli bench --model "$NANOQWEN_LADDER_7B" --prompt-tokens 512 \
    --gen-tokens 4 --runs 5 --prefill-weights fp8 --format csv
  run prefill_fp8_long 240 $PY -m nanoqwen_cli bench --model "$NANOQWEN_LADDER_7B" --prompt-tokens 2048,8192,32000 \
    --gen-tokens 4 --runs 3 --prefill-weights fp8 --format csv
  run prefill_fp8_breakdown 200 $PY scripts/prefill_breakdown.py "$NANOQWEN_LADDER_7B" --tokens 512,8192 \
    --prefill-weights fp8 --json "$WORK/logs/prefill-breakdown-7b-fp8.json"
fi
# The tile GEMM's prepared knobs (docs/PERF.md "Prepared for the next lease"; default off): the tile-GEMM GPU
# tests under both knobs, then scripts/ab_kernels.sh on the 7B (decode at depth 0, bench_batch 1 / 8 / 32 /
# 64) for the default, each knob and both; its table is in the section's log (records in $WORK/logs/ab-tile).
# The per-step breakdown by kernel family (batch 1, and batch 32: where a batched step's time goes), and the
# transformers peer in the same call.
if want breakdown; then
  run breakdown 120 $PY scripts/decode_breakdown.py "$NANOQWEN_LADDER_7B" --json "$OUT/breakdown_7b.json"
  run breakdown_b32 180 $PY scripts/decode_breakdown.py "$NANOQWEN_LADDER_7B" --batch 32 --context 384 \
    --json "$WORK/logs/breakdown_7b_b32.json"
  # the step timeline (a stamped build, NQ_STAMPS=1: each launch's span, placement and hand-off inside the step)
  run timeline 120 env NANOQWEN_KERNEL_DEFINES=NQ_STAMPS=1 $PY scripts/decode_breakdown.py "$NANOQWEN_LADDER_7B" \
    --reps 10 --timeline 5 --json "$WORK/logs/timeline_7b.json"
  # the read floor of one launch of each family's bytes, plain and in each 7B family's own shape (read_floor_probe.py)
  run read_floor 120 $PY scripts/read_floor_probe.py --down \
    --shape "8.257:288:3:7.168;6.423:224:3:7.168;67.9:395:3:7.168;33.95:224:2:18.944" \
    --json "$WORK/logs/read_floor.json"
  # the down_proj -> q/k/v hand-off as two launches or as one kernel with a grid barrier (handoff_probe.py)
  run handoff 90 $PY scripts/handoff_probe.py --json "$WORK/logs/handoff.json"
fi
# Hardware counters of the batch-1 GEMVs (not in the default set: GPU_ALL_SECTIONS="info ncu"): Nsight
# Compute on each half2-loop entry at the 7B's shapes, one launch each after warm-up, the lines that say
# whether a kernel is bound by DRAM, by issue or by latency (first used 2026-12-01 on o_proj: 20% of the
# warps active, 0.31 instructions per scheduler per cycle). Needs ncu reading counters (Firecracker
# machines; KINDS.md); --clock-control none leaves the clocks as the benchmarks run them.
if want ncu; then
  for k in nq_gate_up_silu nq_gemv_int4_i nq_qkv_rope_kv nq_gemv_int4_h; do
    run "ncu_$k" 150 bash -c "ncu --clock-control none -k regex:'^$k\$' --launch-skip 10 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats $PY packages/nanoqwen-kernels/bench/bench_gemv.py --batch 1 \
      --no-peer --reps 2 | grep -E '^  nq_|Duration|DRAM Throughput|Issued Warp Per|No Eligible|Eligible Warps|\
Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Grid Size|stalled|Theoretical Occ'"
  done
fi
want peer && run peer 180 $PY scripts/peer_transformers.py --out "$OUT/peer_transformers.json"
# the prefill peer (issue 16): one forward pass per prompt length, sdpa attention, bf16
want peer && run peer_prefill 300 $PY scripts/peer_transformers.py --prefill-lengths 512,2048,8192,32768 \
  --out "$WORK/logs/peer_transformers_prefill.json"

# The real Qwen2.5-Coder-1.5B-Instruct (issue 12): $NQ_REAL_GGUF is the GGUF moved over in pieces (see
# docs/VALIDATION.md); converted here once, then the real tier against transformers fp32, our bench and the
# perplexity of the interpreter's own standard library source.
REAL_NQ=$NANOQWEN_CACHE/qwen2.5-coder-1.5b-instruct.nanoqwen
if want real && [ -n "${NQ_REAL_GGUF:-}" ]; then
  [ -f "$REAL_NQ" ] || run real_convert 240 $PY -c "import sys; from nanoqwen_format import convert; \
print(convert(sys.argv[1], sys.argv[2], progress=False))" "$NQ_REAL_GGUF" "$REAL_NQ"
  run real_tier 420 $PY scripts/real_vs_transformers.py "$REAL_NQ" --out "$OUT/real_vs_transformers.json"
  # each prompt alone (batch-1 decode, int8 activations: the default): the tier the default must pass
  # (twentieth and twenty-first leases: 13 of 4,800 positions, worst gap 0.044, as fp16's)
  run real_tier_b1_int8 420 $PY scripts/real_vs_transformers.py "$REAL_NQ" --one-at-a-time --decode-activations int8 \
    --windows 2 --out "$WORK/logs/real_vs_transformers_b1_int8.json"
  # the same tier with the opt-in FP8 prefill: its numbers, not a gate (e4m3 activations move the prompt
  # positions' logits past the tier's bounds by design; docs/VALIDATION.md)
  run real_tier_fp8 420 env NANOQWEN_PREFILL_WEIGHTS=fp8 $PY scripts/real_vs_transformers.py "$REAL_NQ" \
    --prompts 40 --tokens 32 --windows 4 --out "$WORK/logs/real_vs_transformers_fp8.json"
  run real_bench 120 bash -c "$PY -m nanoqwen_cli bench --model '$REAL_NQ' --json > '$WORK/logs/bench_real_1.5b.json'; \
    rc=\$?; cat '$WORK/logs/bench_real_1.5b.json'; exit \$rc"
  # where the real model's batch-1 step goes (issue 15 keeps this breakdown for the 7B and the real 1.5B)
  run real_breakdown 120 $PY scripts/decode_breakdown.py "$REAL_NQ" --json "$WORK/logs/breakdown_real_1.5b.json"
fi
# The OpenAI-compatible server under load (issue 14): needs the wheels in .whl (starlette, uvicorn, openai).
if want serve; then
  SERVE_MODEL=${SERVE_MODEL:-$NANOQWEN_LADDER_7B}
  run serve_load 300 bash -c "$PY -m nanoqwen_cli serve --model '$SERVE_MODEL' --port 8765 >'$WORK/logs/serve_server.log' 2>&1 & \
    pid=\$!; for i in \$(seq 120); do $PY -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8765/health\", timeout=2)' 2>/dev/null && break; sleep 1; done; \
    $PY scripts/load_openai.py --base-url http://127.0.0.1:8765/v1 --concurrency 1,8,32,64 --requests 64 \
      --out '$OUT/serve_load.json'; rc=\$?; \
    $PY scripts/load_openai.py --base-url http://127.0.0.1:8765/v1 --concurrency 1 --requests 4 --prompt-tokens 512 \
      --max-tokens 128 --out '$WORK/logs/serve_c1_protocol.json'; kill -TERM \$pid; wait \$pid; exit \$rc"
fi
# llama.cpp in the same call (issue 18), the real 1.5B only: scripts/peer_llamacpp.sh build must have run
# earlier in the lease. Superseded by `peers` (both models, ours beside it, the tables made).
if want llamacpp && [ -n "${NQ_REAL_GGUF:-}" ]; then
  run llamacpp_wait 540 bash scripts/peer_llamacpp.sh wait 530
  run llamacpp_real 240 env OUT="$OUT" bash scripts/peer_llamacpp.sh bench real-1.5b "$NQ_REAL_GGUF"
fi
# nanoqwen beside llama.cpp (and transformers) on both models, one call (issue 18; docs/PERF.md, "How the
# llama.cpp comparison is run"). Earlier calls of the lease must have started `peer_llamacpp.sh build` and
# `peer_llamacpp.sh prep7b TOK.gguf`; this waits for them at most $PEERS_WAIT seconds each (default 60)
# and benches the llama.cpp side only where they are done. Per model (the 7B-shaped: our
# $NANOQWEN_LADDER_7B, from section model7b, vs the Q4_K_M 7B-shaped GGUF; the real 1.5B: our conversion
# of $NQ_REAL_GGUF vs that GGUF): our bench on the decode protocol (512 + 128: decode at depth 512..640)
# and with a 1-token prompt (decode at depth 0), scripts/bench_batch.py (128 + 256 at 1 / 8 / 32 / 64),
# transformers on the 7B where torch is importable, then llama-bench / llama-batched-bench. The records go
# to $WORK/peers and back as $OUT/peers.tar.gz; scripts/peer_tables.py's tables as $OUT/peer_tables.md
# (both rewritten after each model, so a call cut short still returns the first). PEERS_MODELS="7b" or
# "real-1.5b" runs one model (default both; the records of an earlier call of the lease stay in $WORK/peers
# and come back with the next).
if want peers; then
  peers_models=" ${PEERS_MODELS:-7b real-1.5b} "
  PEERS=$WORK/peers
  LLAMA_W=${LLAMA_WORK:-/tmp/nq-llama}
  mkdir -p "$PEERS"
  peers_commit=${NQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  peers_tables() {
    $PY scripts/peer_tables.py --dir "$PEERS" --commit "$peers_commit" --date "$(date -u +%F)" \
      >"$OUT/peer_tables.md" 2>>"$LOG"
    tar -czf "$OUT/peers.tar.gz" -C "$WORK" peers
  }
  # peers_ours NAME MODEL: our three benches of one model (sections peers_TAG_*: TAG is NAME as a variable name)
  peers_ours() {
    local tag=${1//[^A-Za-z0-9_]/_}
    run "peers_${tag}_bench" 150 bash -c "$PY -m nanoqwen_cli bench --model '$2' --json >'$PEERS/bench-$1.json'; \
      rc=\$?; cat '$PEERS/bench-$1.json'; exit \$rc"
    run "peers_${tag}_bench_d0" 90 bash -c "$PY -m nanoqwen_cli bench --model '$2' --prompt-tokens 1 --json \
      >'$PEERS/bench-$1-d0.json'; rc=\$?; cat '$PEERS/bench-$1-d0.json'; exit \$rc"
    run "peers_${tag}_batch" 180 $PY scripts/bench_batch.py "$2" --json "$PEERS/bench-batch-$1.json"
  }
  llama_built=0
  if [ -e "$LLAMA_W/build.log" ]; then
    run peers_llama_wait $((${PEERS_WAIT:-60} + 20)) bash scripts/peer_llamacpp.sh wait "${PEERS_WAIT:-60}"
    [ -e "$LLAMA_W/build.done" ] && llama_built=1
    [ -e "$LLAMA_W/prep7b.log" ] && run peers_7b_gguf_wait $((${PEERS_WAIT:-60} + 20)) \
      bash scripts/peer_llamacpp.sh wait7b "${PEERS_WAIT:-60}"
  else
    echo "peers: no llama.cpp build in $LLAMA_W (run scripts/peer_llamacpp.sh build earlier in the lease): llama.cpp skipped" | tee -a "$LOG"
  fi
  if [[ "$peers_models" != *" 7b "* ]]; then
    :
  elif [ -f "$NANOQWEN_LADDER_7B" ]; then
    peers_ours 7b "$NANOQWEN_LADDER_7B"
    if $PY -c "import torch, transformers" 2>/dev/null; then
      run peers_7b_transformers 180 $PY scripts/peer_transformers.py --out "$PEERS/peer-transformers-7b.json"
    else
      echo "peers: no torch/transformers here: the transformers peer skipped" | tee -a "$LOG"
    fi
    GGUF_7B=$LLAMA_W/qwen2-7b-shaped-q4_k_m.gguf
    if [ "$llama_built" = 1 ] && [ -s "$GGUF_7B" ]; then
      run peers_7b_llama 240 env OUT="$PEERS" bash scripts/peer_llamacpp.sh bench 7b "$GGUF_7B"
    else
      echo "peers: no llama.cpp build or no $GGUF_7B: llama.cpp on the 7B skipped" | tee -a "$LOG"
    fi
    peers_tables
  else
    echo "peers: no $NANOQWEN_LADDER_7B (add section model7b before peers): the 7B skipped" | tee -a "$LOG"
  fi
  if [[ "$peers_models" != *" real-1.5b "* ]]; then
    :
  elif [ -n "${NQ_REAL_GGUF:-}" ] && [ -s "$NQ_REAL_GGUF" ]; then
    [ -f "$REAL_NQ" ] || run real_convert 240 $PY -c "import sys; from nanoqwen_format import convert; \
print(convert(sys.argv[1], sys.argv[2], progress=False))" "$NQ_REAL_GGUF" "$REAL_NQ"
    if [ -f "$REAL_NQ" ]; then
      peers_ours real-1.5b "$REAL_NQ"
    fi
    if [ "$llama_built" = 1 ]; then
      run peers_real_llama 180 env OUT="$PEERS" bash scripts/peer_llamacpp.sh bench real-1.5b "$NQ_REAL_GGUF"
    fi
    peers_tables
  else
    echo "peers: \$NQ_REAL_GGUF unset or missing: the real 1.5B skipped" | tee -a "$LOG"
  fi
  cat "$OUT/peer_tables.md" 2>/dev/null | tee -a "$LOG"
fi

tar -czf "$OUT/details.tar.gz" -C "$WORK" logs ladder 2>/dev/null
$PY scripts/gpu_summary.py "$TABLE" "$NANOQWEN_LADDER_OUT" "$OUT" | tee "$OUT/summary.txt"
