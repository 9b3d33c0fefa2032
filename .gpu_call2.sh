R=$(pwd); export PYTHONPATH=$R/packages/nanoqwen-format/src:$R/packages/nanoqwen-kernels/src:$R/packages/nanoqwen-engine/src:$R/packages/nanoqwen-cli/src
export NANOQWEN_KERNEL_CACHE=/tmp/nq-gpu-all/kcache NANOQWEN_CACHE=/tmp/nq-gpu-all/cache
cd packages/nanoqwen-kernels/bench
for cfg in "NQ_GW_STAGES=4" "NQ_GW_STAGES=6" "NQ_GW_DEPTH=2,NQ_GW_STAGES=6"; do
  echo "== $cfg"
  NANOQWEN_KERNEL_DEFINES=$cfg NANOQWEN_GEMM_TILE=256 timeout 100 python3 bench_prefill_gemm.py 7b --m 2048 --only gate_up,down,o 2>&1 | grep "M=2048"
done
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
for _ in range(4): pk.gemm_int4_wg(qw, sc, x, out, tile=256)
cp.cuda.Device().synchronize()
PY
timeout 200 ncu --clock-control none -k regex:nq_gemm_int4_wg_n256 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis python3 /tmp/one.py 2>&1 | grep -v "^==PROF==" | grep -E "Duration|Throughput|Pipe|Issue|Eligible|Stall|stall|Active|Warp Cycles|Executed Ipc|SM Busy|Bank|L2|L1|Shared" | head -60
