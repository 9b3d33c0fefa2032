#!/usr/bin/env bash
# one-off GPU call (not kept in the repo): validation of the run-ahead and prefill changes + A/B
set -u
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src:packages/nanoqwen-engine/src:packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache PYTHONUNBUFFERED=1
M=/tmp/nq-gpu-all/cache/synthetic-7b-seed0.nanoqwen; S15=/tmp/nq-gpu-all/cache/synthetic-1.5b-dims-seed0.nanoqwen
mkdir -p /tmp/nq-gpu-all/cache
echo "commit $(git rev-parse --short HEAD) $(date -u)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 packages/nanoqwen-kernels/bench/precompile.py 7b 1.5b tiny -j 15 > /tmp/pc.log 2>&1 & PC=$!
[ -f $M ] || python3 -c "from nanoqwen_format.synthetic import qwen7b_config, write_synthetic; write_synthetic('$M', qwen7b_config(), seed=0)"
[ -f $S15 ] || python3 scripts/write_synthetic_1p5b.py $S15 > /dev/null
wait $PC; tail -1 /tmp/pc.log
echo "=== kernel GPU tests (prefill)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider packages/nanoqwen-kernels/tests/test_attention_prefill.py packages/nanoqwen-kernels/tests/test_prefill_rope_kv.py 2>&1 | tail -4
echo "=== engine GPU tests"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider packages/nanoqwen-engine/tests 2>&1 | tail -4
echo "=== bench_prefill 7b"; timeout 120 python3 packages/nanoqwen-kernels/bench/bench_prefill.py 7b --attention-only 2>&1 | tail -12
echo "=== bench_prefill 1.5b"; timeout 100 python3 packages/nanoqwen-kernels/bench/bench_prefill.py 1.5b --attention-only 2>&1 | tail -12
echo "=== A/B 7B"
AB_BATCH= AB_DIR=$OUT/ab7 timeout 200 bash scripts/ab_kernels.sh $M "old||NANOQWEN_PREFILL_ATTENTION=mma NANOQWEN_ROPE_PREFILL=scalar" "rope||NANOQWEN_PREFILL_ATTENTION=mma" "new||" "old2||NANOQWEN_PREFILL_ATTENTION=mma NANOQWEN_ROPE_PREFILL=scalar" "new2||" 2>&1 | tail -7
echo "=== A/B 1.5B dims"
AB_DIMS=1.5b AB_BATCH= AB_DIR=$OUT/ab15 timeout 150 bash scripts/ab_kernels.sh $S15 "old||NANOQWEN_PREFILL_ATTENTION=mma NANOQWEN_ROPE_PREFILL=scalar" "new||" "old2||NANOQWEN_PREFILL_ATTENTION=mma NANOQWEN_ROPE_PREFILL=scalar" "new2||" 2>&1 | tail -6
echo "=== CLI concurrency (run-ahead across pages)"
timeout 150 python3 -m nanoqwen_cli bench --synthetic 7b --prompt-tokens 128 --gen-tokens 256 --concurrency 1,8,32,64 --runs 2 --warmup 1 --json > $OUT/cli_concurrency_7b.json; tail -c 2500 $OUT/cli_concurrency_7b.json | python3 -c "
import json,sys; d=json.load(open('$OUT/cli_concurrency_7b.json'))
for lv in d['levels']: print(lv['concurrency'], round(lv['aggregate_tok_s']), lv.get('decode_tok_s') and round(lv['decode_tok_s']), 'ttft', round(lv['ttft_ms_p50'],1), round(lv['ttft_ms_p99'],1), 'itl', round(lv['itl_ms_p50'],3), round(lv['itl_ms_p99'],3))
print('ahead', d['engine_info'].get('ahead_steps'), 'discarded', d['engine_info'].get('ahead_discarded'))"
echo "=== bench_batch"; timeout 120 python3 scripts/bench_batch.py $M --json $OUT/bench_batch_7b.json 2>&1 | tail -5
