R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
cd packages/nanoqwen-kernels/bench
for cfg in "NQ_GW_EXPERIMENT=0" "NQ_GW_EXPERIMENT=1" "NQ_GW_EXPERIMENT=2" "NQ_GW_EXPERIMENT=0"; do
  echo "== $cfg"
  NANOQWEN_KERNEL_DEFINES=$cfg NANOQWEN_GEMM_TILE=256 NANOQWEN_GEMM_SPLITS=1 timeout 100 python3 bench_prefill_gemm.py 7b --m 2048 --only gate_up,down 2>&1 | grep "M=2048" | cut -c1-100
done
ncu --query-metrics 2>/dev/null | grep -iE "gmma|tensor" | head -20
