#!/usr/bin/env bash
# Build what scripts/vllm/gpu_offline.sh needs on a GPU machine that reaches no registry
# (the device tool's nvidia-h200: torch 2.11.0+cu130 and Python 3.12 in its image, nothing
# can be installed there), on this machine, which reaches PyPI:
#
#     scripts/vllm/gpu_bundle.sh            (from the repository root; ~5 minutes on 2 cores)
#
# then two calls of the device tool, back to back (the machine stays warm 30 s between them,
# and what the first leaves in /tmp is there for the second):
#
#     run  carry [".gpu/a"]  "mkdir -p /tmp/genqA && cp .gpu/a/part-* /tmp/genqA/"
#     run  carry [".gpu/b"]  "VLLM_USE_FLASHINFER_SAMPLER=0 bash scripts/vllm/gpu_offline.sh"
#
# A call carries at most 64 MiB, and the bundle is ~102 MB: vLLM 0.26.0 (the last release
# built for torch 2.11 and CUDA 13, the image's), slimmed to what a dense model on Hopper runs
# (no FlashAttention 2, no MoE kernels, no Rust front end, no C++ headers), the packages of
# gpu-bundle.txt (what vLLM and genq need that the image lacks; xgrammar without its static
# library), the tokenizer and config of make_model.py's tiny Qwen2 (its weights are vLLM's
# --load-format dummy), and Debian's redis-server with its libraries. xz, split at 60 MiB.
# SGLang is not bundled: its kernels (sglang-kernel, ~350 MB) pin torch 2.14.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/vllm
VLLM=0.26.0
LLAMA_PY=0.3.36
WORK=${GENQ_GPU_BUNDLE_WORK:-$HOME/.cache/genq-gpu-bundle}
PLATFORMS=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
command -v redis-server >/dev/null || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 2; }
mkdir -p "$WORK/wheels" "$WORK/src"
cd "$WORK"
python3 -m pip download -q --no-deps "${TARGET[@]}" -d wheels "vllm==$VLLM" -r "$HERE/gpu-bundle.txt"
rm -rf bundle && mkdir -p bundle/gmodel
python3 -m pip install -q --no-deps --no-compile "${TARGET[@]}" --target bundle/site312 wheels/*.whl
(   # what a dense model served on one Hopper GPU never loads
    cd bundle/site312
    rm -rf vllm/vllm-rs vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so \
        xgrammar/lib mistral_common/data pycountry/locales zstandard/_cffi.*.so bin
    find vllm/third_party -name include -type d -prune -exec rm -rf {} +
    find vllm/third_party -name '*.so' ! -name '*cpython-312*' -delete
    find . -name __pycache__ -prune -exec rm -rf {} +
)
# The tiny model's tokenizer and config (make_model.py, here with its own venv): no weights.
VOCAB=src/llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf
if [ ! -f "$VOCAB" ]; then
    python3 -m pip download -q --no-binary :all: --no-deps -d src "llama-cpp-python==$LLAMA_PY"
    tar -xzf "src/llama_cpp_python-$LLAMA_PY.tar.gz" -C src \
        "llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
fi
if [ ! -d model ]; then
    [ -x venv/bin/python ] || { python3 -m venv venv && venv/bin/pip install -q torch==2.13.0 transformers==5.17.0 gguf; }
    venv/bin/python "$HERE/make_model.py" "$VOCAB" model.tmp && mv model.tmp model
fi
cp model/*.json model/*.jinja bundle/gmodel/
tar -cf - -C bundle site312 gmodel | xz -9 -T0 > bundle.tar.xz
rm -rf "$ROOT/.gpu" && mkdir -p "$ROOT/.gpu/a" "$ROOT/.gpu/b/redis/lib"
split -b 60M -a 2 bundle.tar.xz "$ROOT/.gpu/part-"
mv "$ROOT/.gpu/part-aa" "$ROOT/.gpu/a/" && mv "$ROOT"/.gpu/part-* "$ROOT/.gpu/b/"
server=$(readlink -f "$(command -v redis-server)")
cp "$server" "$ROOT/.gpu/b/redis/redis-server"
for lib in $(ldd "$server" | awk '/=> \//{print $3}'); do
    case $(basename "$lib") in libc.so*|libm.so*|libstdc++*|libgcc_s*) ;; *) cp -L "$lib" "$ROOT/.gpu/b/redis/lib/" ;; esac
done
grep -qx '/.gpu/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$ROOT/.git/info/exclude"
du -sh "$ROOT/.gpu/a" "$ROOT/.gpu/b"
