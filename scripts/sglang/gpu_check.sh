#!/usr/bin/env bash
# genq against real SGLang on a GPU machine with a small model: the checks of `make test-sglang`
# (scripts/sglang/test.sh) on the GPU, in one call from the repository root:
#
#     scripts/sglang/gpu_check.sh
#
# scripts/vllm/gpu_check.sh with SGLang alone, i.e. scripts/vllm/bench.py --engine sglang --gpu:
# capacity told at 128 and 16 running requests, the over-context prompts dead-lettered with
# SGLang's 400, the brake, n > 1 with logprobs, scripts/sglang/checks.py (logprobs streamed and not
# with EOS first, stop strings, stop_token_ids, tools, regex, pause and drain, a worker killed
# mid-batch, every prompt exactly once), the monitor's ETA and 2 paired throughput rounds; exit 1
# if any check failed. Figures to $OUT/gpu-sglang.json ($OUT: the device tool's folder, else .).
# The checks force end-of-sequence with a logit bias on token 151645 (<|im_end|>): the model must
# be a Qwen2-family one (Qwen2.5-0.5B-Instruct, or the tiny random Qwen2 of
# scripts/vllm/make_model.py, the default).
#
# Sizes: jobs of 1,000 prompts of 128 tokens, one capacity run a server (SGLang tells its
# capacity; nothing is learnt): about 1.3 M tokens on the 128-slot server and 0.13 M on the
# 16-slot one, sized to end within the device tool's 10 minutes a call. Not measured: no GPU was
# lent to the session that wrote it.
#
# What it needs (docs/engines.md, "On a GPU"):
#   GENQ_GPU_SGLANG_PY  a Python with sglang 0.5.23 and its CUDA requirements (`pip install
#                       sglang==0.5.23`: a CUDA torch 2.14.1, sglang-kernel 0.4.10, flashinfer
#                       0.7.2; several GB). Default: a venv made under the cache by pip (needs PyPI).
#   genq's .venv        `make .venv/bin/genq` (needs PyPI unless .venv is there already).
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
GENQ_GPU_ENGINES=sglang GENQ_GPU_SGLANG_PY=${GENQ_GPU_SGLANG_PY:-} \
    GENQ_GPU_BENCH_ARGS="--capacity-runs 1 --capacity-n 1000 --eta-n 3000 --round-n 1000 --rounds 2 --max-tokens 128 --out $OUT/gpu-sglang.json" \
    exec scripts/vllm/gpu_check.sh
