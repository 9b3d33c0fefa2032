R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
mkdir -p $NANOQWEN_CACHE
M=$NANOQWEN_CACHE/synthetic-7b-seed0.nanoqwen; S15=$NANOQWEN_CACHE/synthetic-1p5b.nanoqwen
( [ -f $M ] || python3 -c "from nanoqwen_format.synthetic import write_synthetic, qwen7b_config; write_synthetic('$M', qwen7b_config(), seed=0)" >/dev/null 2>&1 ) &
( [ -f $S15 ] || python3 scripts/write_synthetic_1p5b.py $S15 >/dev/null 2>&1 ) &
( cd packages/nanoqwen-kernels && timeout 300 python3 -m pytest -m gpu tests/test_prefill_gemm.py -q -x -n 6 2>&1 | tail -4 ) 
wait
( cd packages/nanoqwen-engine && timeout 200 python3 -m pytest -m gpu tests/test_cuda_prefill.py -q -x 2>&1 | tail -3 )
( cd packages/nanoqwen-kernels/bench && timeout 200 python3 bench_prefill_gemm.py 7b 1.5b --m 512,2048 2>&1 | tail -20 )
for mode in int4 fp16; do for p in 512 2048 8192; do
  echo "$mode $p: $(NANOQWEN_PREFILL_WEIGHTS=$mode timeout 150 python3 -m nanoqwen_cli bench --model $M --prompt-tokens $p --gen-tokens 4 --runs 3 --format csv 2>/dev/null | tail -1 | cut -d, -f6,9)"
done; done
for p in 512 2048; do echo "1.5b int4 $p: $(NANOQWEN_PREFILL_WEIGHTS=int4 timeout 100 python3 -m nanoqwen_cli bench --model $S15 --prompt-tokens $p --gen-tokens 4 --runs 3 --format csv 2>/dev/null | tail -1 | cut -d, -f6,9)"; done
cat > /tmp/one.py <<'PY'
import cupy as cp, numpy as np
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.loader import load_module
from nanoqwen_kernels.prefill import PrefillKernels
pk = PrefillKernels(PRESETS["7b"], load_module)
n, k, m = 37888, 3584, 2048
rng = np.random.default_rng(0)
qw = cp.asarray(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
sc = cp.asarray(rng.uniform(1e-3, 5e-2, size=(n, k // 128)).astype(np.float16))
x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
out = cp.empty((m, n), cp.float16)
for _ in range(4): pk.gemm_int4_wg(qw, sc, x, out, tile=256, splits=1)
cp.cuda.Device().synchronize()
PY
timeout 120 ncu --clock-control none -k regex:nq_gemm_int4_wg_n256 --launch-skip 2 --launch-count 1 --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio python3 /tmp/one.py 2>&1 | grep -v "^==PROF==" | tail -24
