R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
mkdir -p $NANOQWEN_CACHE
M=$NANOQWEN_CACHE/synthetic-7b-seed0.nanoqwen; S15=$NANOQWEN_CACHE/synthetic-1p5b.nanoqwen
( [ -f $M ] || python3 -c "from nanoqwen_format.synthetic import write_synthetic, qwen7b_config; write_synthetic('$M', qwen7b_config(), seed=0)" >/dev/null 2>&1 ) &
( [ -f $S15 ] || python3 scripts/write_synthetic_1p5b.py $S15 >/dev/null 2>&1 ) &
( cd packages/nanoqwen-kernels && timeout 300 python3 -m pytest -m gpu tests/test_prefill_gemm.py -q -n 6 2>&1 | grep -E "passed|failed|Error|assert" | head -12 )
cd packages/nanoqwen-kernels/bench
for cfg in "NQ_GW_PRODUCER_FENCE=0" "NQ_GW_PRODUCER_FENCE=1" "NQ_GW_PRODUCER_FENCE=1,NQ_GW_STAGES=6" "NQ_GW_PRODUCER_FENCE=1,NQ_GW_STAGES=4"; do
  echo "== $cfg"
  NANOQWEN_KERNEL_DEFINES=$cfg NANOQWEN_GEMM_TILE=256 NANOQWEN_GEMM_SPLITS=1 timeout 100 python3 bench_prefill_gemm.py 7b --m 2048 --only gate_up,down,o 2>&1 | grep "M=2048" | cut -c1-75
done
cd $R
wait
