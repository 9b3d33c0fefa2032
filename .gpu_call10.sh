R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src:/tmp/site
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
mkdir -p $NANOQWEN_CACHE
pip install --no-index --no-deps --target /tmp/site .whl/gguf-*.whl >/dev/null 2>&1
echo "gguf sha256: $(sha256sum /tmp/nq-model/q.gguf | cut -c1-16)"
RN=$NANOQWEN_CACHE/qwen2.5-coder-1.5b-instruct.nanoqwen
( timeout 120 python3 packages/nanoqwen-kernels/bench/precompile.py 1.5b 7b -j 12 >/dev/null 2>&1 ) &
timeout 200 python3 -c "from nanoqwen_format import convert; print(convert('/tmp/nq-model/q.gguf', '$RN', progress=False))" 2>&1 | tail -1
wait
echo "== real 1.5B tier, prefill_weights=int4 (the fused GEMMs)"
NANOQWEN_PREFILL_WEIGHTS=int4 timeout 300 python3 scripts/real_vs_transformers.py $RN --prompts 40 --tokens 32 --windows 4 2>&1 | grep -vE "^\s*$" | tail -6
for mode in int4 fp16; do echo "real 1.5b $mode 512: $(NANOQWEN_PREFILL_WEIGHTS=$mode timeout 100 python3 -m nanoqwen_cli bench --model $RN --prompt-tokens 512 --gen-tokens 4 --runs 5 --format csv 2>/dev/null | tail -1 | cut -d, -f6,9)"; done
( cd packages/nanoqwen-kernels && timeout 120 python3 -m pytest -m gpu tests/test_prefill_gemm.py -q -n 8 2>&1 | tail -1 )
