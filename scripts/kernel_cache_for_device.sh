#!/usr/bin/env bash
# Compile every kernel build the launchers load, here on the CPU, into .kc/ (git-ignored), so a GPU call that
# carries it (the device tool's `run` with carry [".kc"]) spends no device time compiling: scripts/ab_decode.sh
# and scripts/gpu_all.sh seed their kernel caches from .kc/ when it is there.
#
#   bash scripts/kernel_cache_for_device.sh [7b 1.5b tiny]      # ~30 s on 2 cores, ~5 MB for 7b + 1.5b
#
# The cache key holds NVRTC's major.minor, so the builds must come from the GPU machine's NVRTC (13.0 on the
# H200 here, docs/PERF.md); this machine's kernels venv has 12.9, so a venv with cupy-cuda13x and NVRTC 13.0
# is made under /tmp ($NVRTC13_VENV) on first use. A build whose key the GPU machine computes differently
# (another NVRTC there) is simply compiled there as before.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NVRTC13_VENV:-/tmp/nq-nvrtc13}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "cupy-cuda13x==14.2.0" "nvidia-cuda-nvrtc==13.0.88" numpy
fi
mkdir -p .git/info
grep -qx '/.kc/' .git/info/exclude 2>/dev/null || echo '/.kc/' >>.git/info/exclude
dims=("$@")
[ ${#dims[@]} -gt 0 ] || dims=(7b 1.5b tiny)
NANOQWEN_KERNEL_CACHE=$PWD/.kc PYTHONPATH=packages/nanoqwen-kernels/src \
  "$VENV/bin/python" packages/nanoqwen-kernels/bench/precompile.py "${dims[@]}" -j 2
du -sh .kc
