#!/usr/bin/env bash
# Pack llama.cpp's source for the GPU machine (it has nvcc, CMake and ninja but no network).
# Here (with PyPI reachable): the llama-cpp-python source distribution carries llama.cpp under
# vendor/llama.cpp; we keep what llama-bench, llama-batched-bench and llama-quantize need to build with
# CUDA (drop docs, models, tests, examples and the non-CUDA GPU backends) and pack it with xz into
# .peer/llama.cpp.tar.xz (git-ignored; ~4 MB, it travels with a device call via `carry`).
#
#   bash scripts/peer_llamacpp_pack.sh [VERSION]      # default: the pinned version below
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.3.36}   # llama-cpp-python 0.3.36 vendors llama.cpp commit 0c1e570 (recorded by the build)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$TMP"
tar xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
SRC="$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp"
COMMIT=$(cd "$SRC" && (git log -1 --format=%H 2>/dev/null || echo unknown))
echo "$COMMIT" >"$SRC/NANOQWEN_LLAMACPP_COMMIT"
echo "llama-cpp-python==$VERSION" >>"$SRC/NANOQWEN_LLAMACPP_COMMIT"
rm -rf "$SRC"/{docs,models,tests,examples,pocs,media,ci,benches,gguf-py,conversion,.git,.github,tools/server/public*,tools/ui}
for b in "$SRC"/ggml/src/ggml-*/; do
  case "$(basename "$b")" in ggml-cpu|ggml-cuda) ;; *) rm -rf "$b" ;; esac
done
mkdir -p .peer
tar -C "$(dirname "$SRC")" -cJf .peer/llama.cpp.tar.xz llama.cpp
ls -la .peer/llama.cpp.tar.xz
cat "$SRC/NANOQWEN_LLAMACPP_COMMIT"
