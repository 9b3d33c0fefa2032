R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
mkdir -p $NANOQWEN_CACHE
date -u; git log --oneline -1; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
( timeout 150 python3 packages/nanoqwen-kernels/bench/precompile.py 7b 1.5b tiny -j 12 >/dev/null 2>&1 )
echo "== kernels GPU tests (prefill)"
( cd packages/nanoqwen-kernels && timeout 300 python3 -m pytest -m gpu tests/test_prefill_gemm.py tests/test_attention_prefill.py tests/test_prefill_rope_kv.py -q -n 8 2>&1 | tail -1 )
echo "== engine GPU tests, prefill_weights=int4"
( cd packages/nanoqwen-engine && NANOQWEN_PREFILL_WEIGHTS=int4 timeout 300 python3 -m pytest -m gpu tests -q -n 8 2>&1 | tail -1 )
echo "== engine GPU tests, default"
( cd packages/nanoqwen-engine && timeout 300 python3 -m pytest -m gpu tests/test_cuda_prefill.py -q -n 4 2>&1 | tail -1 )
echo "== GEMM table"
( cd packages/nanoqwen-kernels/bench && timeout 300 python3 bench_prefill_gemm.py 7b 1.5b --m 512,2048,4096 2>&1 | grep "^|" )
echo "== transformers prefill peer"
timeout 240 python3 scripts/peer_transformers.py --prefill-lengths 512,2048,8192,32768 --runs 3 2>&1 | grep -E "prefill [0-9]+ tokens|attn_impl|transformers_version|torch_version|peak"
