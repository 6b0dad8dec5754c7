#!/usr/bin/env bash
# Build llama.cpp's llama-server from the tree the llama-cpp-python sdist vendors
# (no internet needed beyond PyPI; see /work/shared/notes/real-engines.md), once:
# the build is cached under $GENQ_LLAMACPP_CACHE (default ~/.cache/genq-llamacpp)
# and reused while build/bin/llama-server exists. GGML_NATIVE=ON ties the binary
# to this CPU: delete the cache to rebuild on another machine.
set -euo pipefail
CACHE=${GENQ_LLAMACPP_CACHE:-$HOME/.cache/genq-llamacpp}
VERSION=${GENQ_LLAMACPP_PY_VERSION:-0.3.36}
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
BIN=$CACHE/build/bin/llama-server
PY=${PYTHON:-python3}
mkdir -p "$CACHE"
if [ -x "$BIN" ]; then
    echo "llama-server: $BIN (cached)"
    exit 0
fi
if pgrep -f "cmake --build $CACHE/build" >/dev/null 2>&1; then
    echo "a build is already running in $CACHE/build (log $CACHE/build.log): wait for it" >&2
    exit 1
fi
if [ ! -d "$SRC" ]; then
    "$PY" -m pip download --no-binary :all: --no-deps -d "$CACHE" "llama-cpp-python==$VERSION"
    tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
# The two UI flags: without them the build tries to download the web UI.
cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >"$CACHE/build.log" 2>&1
nice -n 19 cmake --build "$CACHE/build" --target llama-server -j"$(nproc)" >>"$CACHE/build.log" 2>&1
echo "llama-server: $BIN"
