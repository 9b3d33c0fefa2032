R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
mkdir -p $NANOQWEN_CACHE
M=$NANOQWEN_CACHE/synthetic-7b-seed0.nanoqwen; S15=$NANOQWEN_CACHE/synthetic-1p5b.nanoqwen
( [ -f $M ] || python3 -c "from nanoqwen_format.synthetic import write_synthetic, qwen7b_config; write_synthetic('$M', qwen7b_config(), seed=0)" >/dev/null 2>&1 ) &
( [ -f $S15 ] || python3 scripts/write_synthetic_1p5b.py $S15 >/dev/null 2>&1 ) &
( cd packages/nanoqwen-kernels && timeout 200 python3 -m pytest -m gpu tests/test_prefill_gemm.py -q -n 8 2>&1 | grep -E "passed|failed|^E " | head -8 )
wait
echo "== engine GPU tests with int4"
( cd packages/nanoqwen-engine && NANOQWEN_PREFILL_WEIGHTS=int4 timeout 200 python3 -m pytest -m gpu tests -q -n 8 2>&1 | grep -E "passed|failed|^E " | head -8 )
echo "== ladder quick with int4"
NANOQWEN_PREFILL_WEIGHTS=int4 GPU_ALL_QUICK=1 GPU_ALL_SECTIONS="ladder" OUT=/tmp/o timeout 200 bash scripts/gpu_all.sh 2>&1 | grep -E "graph tiny|layer 7b|graph 7b|passed|failed"
for p in 512 2048 8192; do for mode in int4 fp16; do
  echo "7b $mode $p: $(NANOQWEN_PREFILL_WEIGHTS=$mode timeout 120 python3 -m nanoqwen_cli bench --model $M --prompt-tokens $p --gen-tokens 4 --runs 5 --format csv 2>/dev/null | tail -1 | cut -d, -f6,9)"
done; done
for p in 512 2048; do for mode in int4 fp16; do
  echo "1.5b $mode $p: $(NANOQWEN_PREFILL_WEIGHTS=$mode timeout 100 python3 -m nanoqwen_cli bench --model $S15 --prompt-tokens $p --gen-tokens 4 --runs 5 --format csv 2>/dev/null | tail -1 | cut -d, -f6,9)"
done; done
