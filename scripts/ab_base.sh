#!/usr/bin/env bash
# Prepare an A/B against a base revision for scripts/ab_kernels.sh (the device gets the working tree, not
# the git history): REV's packages/ are unpacked into .ab/base (git-ignored; carry it: run's carry=[".ab"]),
# and the variant spec that runs them is printed:
#
#   bash scripts/ab_base.sh ea176a5          # prints: base||PYTHONPATH=.ab/base/packages/...
#   # on the device:  bash scripts/ab_kernels.sh MODEL "base||PYTHONPATH=..." "new||"
#
# The base's kernels compile from its own sources (the kernel cache key holds them), so both builds can
# share $NANOQWEN_KERNEL_CACHE. ~7 MB; the 64 MiB a device call carries leaves room.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: ab_base.sh REV}
rm -rf .ab/base
mkdir -p .ab/base
git archive "$REV" packages | tar -x -C .ab/base
B=.ab/base/packages
echo "base||PYTHONPATH=$B/nanoqwen-format/src:$B/nanoqwen-kernels/src:$B/nanoqwen-engine/src:$B/nanoqwen-cli/src"
