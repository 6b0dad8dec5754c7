#!/usr/bin/env bash
# genq against real vLLM and real SGLang on a GPU machine, in one call:
#
#     scripts/vllm/gpu_check.sh            (from the repository root)
#
# For each engine, scripts/vllm/bench.py runs the checks of `make test-vllm` against the
# engine's OpenAI server on the GPU: exactly once, the over-context prompts dead-lettered as
# bad_request with the engine's message, the capacity (vLLM: learned, --max-num-seqs; SGLang:
# told, --max-running-requests) at 128 and at 16 slots, n > 1 and logprobs in the record, the
# monitor's ETA within +-15 % at 25/50/75 %, and genq defaults vs a bare streaming client in
# paired rounds by the server's occupancy. Figures are printed as markdown tables and written
# to gpu-vllm.json and gpu-sglang.json; the exit status is 1 if any check failed.
#
# Never run so far: no GPU machine was lent to the session that wrote it (docs/vllm.md).
#
# What it needs (nothing is downloaded when all of it is given):
#   GENQ_GPU_VLLM_PY    a Python with vllm installed (default: a venv made under the cache,
#                       `pip install vllm`: needs PyPI and some minutes)
#   GENQ_GPU_SGLANG_PY  a Python with sglang installed (default: likewise, `pip install sglang==0.5.23`, the version tried on CPU)
#   GENQ_GPU_MODEL      a local model directory (HF layout), e.g. Qwen2.5-0.5B-Instruct; default:
#                       the tiny random Qwen2 of make_model.py (needs the Qwen2 vocab file of the
#                       llama-cpp-python sdist: pip download, or already in the cache)
#   GENQ_GPU_ENGINES    which engines, default "vllm sglang"
#   GENQ_GPU_CACHE      default ~/.cache/genq-gpu
#   GENQ_GPU_BENCH_ARGS appended to bench.py's arguments (the last of a repeated option wins)
# A GPU runs the tiny model so fast that 200 prompts end in a second or two, too short to see
# a server full for long: the jobs here are ten times those of the CPU run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${GENQ_GPU_CACHE:-$HOME/.cache/genq-gpu}
ENGINES=${GENQ_GPU_ENGINES:-vllm sglang}
PY=${PYTHON:-python3}
LLAMA_PY=0.3.36
mkdir -p "$CACHE"
cd "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU (nvidia-smi)" >&2; exit 2; }
make --no-print-directory .venv/bin/genq

engine_python() {  # $1 engine, $2 pip requirement, $3 the variable that may name one
    local given=$3
    if [ -n "$given" ]; then echo "$given"; return; fi
    if [ ! -x "$CACHE/$1/bin/python" ]; then
        "$PY" -m venv "$CACHE/$1" >&2
        "$CACHE/$1/bin/pip" install --quiet "$2" gguf >&2
    fi
    echo "$CACHE/$1/bin/python"
}

first_python=""
for engine in $ENGINES; do
    case $engine in
        vllm) py=$(engine_python vllm vllm "${GENQ_GPU_VLLM_PY:-}") ;;
        sglang) py=$(engine_python sglang "sglang==0.5.23" "${GENQ_GPU_SGLANG_PY:-}") ;;
        *) echo "unknown engine $engine" >&2; exit 2 ;;
    esac
    first_python=${first_python:-$py}
    eval "PY_$engine=\$py"
done

MODEL=${GENQ_GPU_MODEL:-}
if [ -z "$MODEL" ]; then
    MODEL=$CACHE/model
    VOCAB=$CACHE/src/llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf
    if [ ! -f "$VOCAB" ]; then
        mkdir -p "$CACHE/src"
        "$first_python" -m pip download --quiet --no-binary :all: --no-deps -d "$CACHE/src" "llama-cpp-python==$LLAMA_PY"
        tar -xzf "$CACHE/src/llama_cpp_python-$LLAMA_PY.tar.gz" -C "$CACHE/src" \
            "llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
    fi
    if [ ! -d "$MODEL" ]; then
        "$first_python" scripts/vllm/make_model.py "$VOCAB" "$MODEL.tmp" && mv "$MODEL.tmp" "$MODEL"
    fi
fi

status=0
for engine in $ENGINES; do
    eval "py=\$PY_$engine"
    echo "== $engine ($py), model $MODEL"
    .venv/bin/python scripts/vllm/bench.py --engine "$engine" --gpu --python "$py" --model "$MODEL" \
        --seqs 128,16 --capacity-runs 3 --capacity-n 2000 --eta-n 6000 --round-n 2000 --rounds 4 \
        --max-tokens 256 --out "gpu-$engine.json" ${GENQ_GPU_BENCH_ARGS:-} || status=1
done
exit $status
