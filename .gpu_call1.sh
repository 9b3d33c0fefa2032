R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
cd packages/nanoqwen-kernels
timeout 250 python3 -m pytest -m gpu tests/test_prefill_gemm.py -q -x -k "wg" 2>&1 | tail -15
cd bench
timeout 200 python3 bench_prefill_gemm.py 7b 1.5b --m 512,2048,4096 --widths 2>&1 | tail -40
