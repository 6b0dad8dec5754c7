#!/usr/bin/env bash
# genq against real SGLang on a GPU machine with a small model: the checks of `make test-sglang`
# (scripts/sglang/test.sh) on the GPU, in one call from the repository root:
#
#     scripts/sglang/gpu_check.sh
#     GENQ_GPU_BOUND_ONLY=1 scripts/sglang/gpu_check.sh    # the decode bound alone: a few minutes
#
# First scripts/vllm/gpu_check.sh with SGLang alone, i.e. scripts/vllm/bench.py --engine sglang
# --gpu: capacity told at 128 and 16 running requests, the over-context prompts dead-lettered with
# SGLang's 400, the brake, n > 1 with logprobs, scripts/sglang/checks.py (logprobs streamed and not
# with EOS first, stop strings, stop_token_ids, tools, regex, pause and drain, a worker killed
# mid-batch, every prompt exactly once), the monitor's ETA and 2 paired throughput rounds; figures
# to $OUT/gpu-sglang.json ($OUT: the device tool's folder, else .). The checks force
# end-of-sequence with a logit bias on token 151645 (<|im_end|>): the model must be a Qwen2-family
# one (Qwen2.5-0.5B-Instruct, or the tiny random Qwen2 of scripts/vllm/make_model.py, the default).
#
# Then the decode bound: scripts/nvml_bandwidth.py reads each GPU's memory bandwidth from NVML
# and sets it against genq's table of rated figures, with the bound of the model's weights at 16
# running; then scripts/sglang/bound_check.py --gpu serves the model on SGLang (16 running) and
# sets its measured decode (SGLang's own counter, through a genq worker reading NVML with --gpu 0)
# against that bound, and checks what genq workers, the monitor and /metrics say of it. A tiny
# model's steps are launch-bound, far below the bound; Qwen2.5-0.5B-Instruct comes nearer.
# Exit 1 if any check failed.
#
# Sizes: the bench's jobs are 1,000 prompts of 128 tokens, one capacity run a server (SGLang tells
# its capacity; nothing is learnt): about 1.3 M tokens on the 128-slot server and 0.13 M on the
# 16-slot one, sized for the device tool's 10 minutes a call; the bound is a few minutes more (a
# call of its own: GENQ_GPU_BOUND_ONLY=1). Not measured: no GPU was lent to the sessions that
# wrote it.
#
# What it needs (docs/engines.md, "On a GPU"):
#   an NVIDIA driver, and genq's .venv (`make .venv/bin/genq`: needs PyPI unless it is there;
#                       nvidia-ml-py is one of genq's requirements)
#   GENQ_GPU_SGLANG_PY  a Python with sglang 0.5.23 and its CUDA requirements (`pip install
#                       sglang==0.5.23`: a CUDA torch 2.14.1, sglang-kernel 0.4.10, flashinfer
#                       0.7.2; several GB). Default: a venv made under the cache by pip (needs PyPI).
#   GENQ_GPU_MODEL      a local Qwen2-family model directory; default: the tiny random Qwen2
#                       (needs the Qwen2 vocab file of the llama-cpp-python sdist, or the cache).
#   GENQ_GPU_CACHE      default ~/.cache/genq-gpu
# The device tool's machines reach no registry and carry 64 MiB a call, with torch 2.11.0+cu130
# in their image: none of the above can be brought there as vLLM's bundle is
# (scripts/vllm/gpu_bundle.sh), so such a machine needs SGLang preinstalled.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-.}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU (nvidia-smi)" >&2; exit 2; }
make --no-print-directory .venv/bin/genq
CACHE=${GENQ_GPU_CACHE:-$HOME/.cache/genq-gpu}
PY=${GENQ_GPU_SGLANG_PY:-$CACHE/sglang/bin/python}
MODEL=${GENQ_GPU_MODEL:-$CACHE/model}
status=0
bound() {
    .venv/bin/python scripts/nvml_bandwidth.py --running 16 $([ -d "$MODEL" ] && echo --model "$MODEL") || status=1
    if [ -x "$PY" ] && [ -d "$MODEL" ]; then
        .venv/bin/python scripts/sglang/bound_check.py --gpu --python "$PY" --model "$MODEL" --seqs 16 \
            --prompts 20000 --max-tokens 256 || status=1
    else
        echo "bound check: no SGLang Python ($PY) or model ($MODEL): give GENQ_GPU_SGLANG_PY and GENQ_GPU_MODEL" >&2
        status=1
    fi
}
if [ "${GENQ_GPU_BOUND_ONLY:-}" = 1 ]; then
    bound
    exit $status
fi
# The vLLM script makes the engine's venv and the model when they are not given; SGLang alone here.
GENQ_GPU_ENGINES=sglang GENQ_GPU_SGLANG_PY=${GENQ_GPU_SGLANG_PY:-} \
    GENQ_GPU_BENCH_ARGS="--capacity-runs 1 --capacity-n 1000 --eta-n 3000 --round-n 1000 --rounds 2 --max-tokens 128 --out $OUT/gpu-sglang.json" \
    scripts/vllm/gpu_check.sh || status=1
bound
exit $status
