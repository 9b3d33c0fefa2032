"""One FP8 prefill GEMM launch of a 7B shape, for ncu (scripts/profile_fp8_gemm.py [gate_up|down|qkv|o] [M]):
the weight's e4m3 copy and X quantized first, then three launches of the GEMM (profile the last one:
ncu --kernel-name regex:nq_gemm_fp8 --launch-skip 2 --launch-count 1)."""

import sys

import cupy as cp
from nanoqwen_kernels.dims import QWEN25_7B as D
from nanoqwen_kernels.loader import load_module
from nanoqwen_kernels.prefill import PrefillKernels

proj = sys.argv[1] if len(sys.argv) > 1 else "gate_up"
m = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
n, k = {"qkv": (D.qkv_rows, D.hidden), "o": (D.hidden, D.hidden), "gate_up": (2 * D.intermediate, D.hidden),
        "down": (D.hidden, D.intermediate)}[proj]
kern = PrefillKernels(D, load_module).fp8
qw = cp.random.randint(0, 2**31, size=(n, k // 8), dtype=cp.int64).astype(cp.uint32)
sc = cp.random.uniform(1e-3, 5e-2, size=(n, k // 128)).astype(cp.float16)
w8, sw = kern.int4_to_e4m3(qw, sc)
x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
xq, sx = cp.empty((m, k), cp.uint8), cp.empty(m, cp.float32)
kern.quantize_e4m3(x, xq, sx)
out = cp.empty((m, n), cp.float16)
for _ in range(3):
    kern.gemm_fp8(w8, sw, xq, sx, out, splits=1)
cp.cuda.runtime.deviceSynchronize()
print("done", proj, m, n, k)
