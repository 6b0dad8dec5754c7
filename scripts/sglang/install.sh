#!/usr/bin/env bash
# Install SGLang for CPU (the sglang wheel from PyPI, which has no CPU extra) into a venv
# and make the tiny random-weight Qwen2 of scripts/vllm/make_model.py, once: both are
# cached under $GENQ_SGLANG_CACHE (default ~/.cache/genq-sglang; ~3 GB, about 6 minutes on
# 2 cores) and reused while they exist. Recipe: /work/shared/notes/real-engines.md.
# - The wheel pins a CUDA torch and CUDA kernels: it goes in with --no-deps, then its
#   other requirements (read from its METADATA) with torch==2.13.0+cpu, which pip finds
#   where it is configured to look (find-links), as on these machines.
# - torchvision (imported by `import sglang`) is PyPI's CUDA build: patched by
#   torchvision_no_ops.py to import without its C++ ops.
# - sgl_kernel (SGLang's CPU kernel module, not on PyPI) is stood in for by the pure-torch
#   sgl_kernel/ beside this script: run the server with this folder first on PYTHONPATH
#   (scripts/vllm/stack.py does) and SGLANG_USE_CPU_ENGINE=1.
set -euo pipefail
CACHE=${GENQ_SGLANG_CACHE:-$HOME/.cache/genq-sglang}
VERSION=${GENQ_SGLANG_VERSION:-0.5.23}
TORCH=${GENQ_SGLANG_TORCH:-2.13.0+cpu}
LLAMA_PY=${GENQ_LLAMACPP_PY_VERSION:-0.3.36}
PY=${PYTHON311:-python3.11}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$CACHE/venv
VOCAB=$CACHE/src/llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf
# Requirements left out: CUDA-only builds and kernels (none is imported on the CPU path),
# and torch/torchvision/torchaudio/torchcodec, installed (or not) below.
CUDA_ONLY='^(cuda-python|flash-attn-4|flashinfer.python|humming-kernels|nvidia-.*|nvshmem4py-cu13|quack-kernels|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|sglang-kernel|tilelang|torch|torch.memory.saver|torchaudio|torchcodec|torchvision)$'
mkdir -p "$CACHE/src"
exec 9>"$CACHE/.install.lock"
if ! flock -n 9; then
    echo "an install is already running in $CACHE (log $CACHE/install.log): waiting for it" >&2
    flock 9
fi
if [ ! -f "$VENV/.installed-$VERSION" ]; then
    rm -rf "$VENV"
    echo "installing sglang $VERSION (CPU) into $VENV (about 6 minutes; log $CACHE/install.log)"
    "$PY" -m venv "$VENV"
    log=$CACHE/install.log
    : >"$log"
    pip="nice -n 10 $VENV/bin/pip"
    $pip download --quiet --no-deps -d "$CACHE/src" "sglang==$VERSION" >>"$log" 2>&1
    wheel=$(ls "$CACHE"/src/sglang-"$VERSION"-*.whl | head -1)
    "$VENV/bin/python" - "$wheel" "$CUDA_ONLY" >"$CACHE/requirements.txt" <<'PY'
import re, sys, zipfile
from email.parser import Parser
wheel, skip = sys.argv[1], re.compile(sys.argv[2], re.I)
z = zipfile.ZipFile(wheel)
meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
for req in meta.get_all("Requires-Dist"):
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    if "extra ==" not in req and not skip.match(name):
        print(req)
PY
    echo "torch==$TORCH" >"$CACHE/constraints.txt"
    { $pip install --no-deps "$wheel" \
        && $pip install "torch==$TORCH" dill -r "$CACHE/requirements.txt" -c "$CACHE/constraints.txt" \
        && $pip install --no-deps torchvision -c "$CACHE/constraints.txt" \
        && "$VENV/bin/python" "$HERE/torchvision_no_ops.py"; } >>"$log" 2>&1 \
        || { tail -20 "$log" >&2; exit 1; }
    touch "$VENV/.installed-$VERSION"
fi
echo "sglang: $VENV (sglang $VERSION, torch $TORCH)"
. "$HERE/../vllm/tiny_model.sh"
