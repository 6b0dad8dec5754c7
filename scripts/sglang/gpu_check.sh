#!/usr/bin/env bash
# genq against real SGLang on a GPU machine with a small model: the checks of `make test-sglang`
# (scripts/sglang/test.sh) on the GPU, in one call from the repository root:
#
#     scripts/sglang/gpu_check.sh
#
# scripts/vllm/bench.py --engine sglang --gpu: capacity told at 128 and 16 running requests, the
# over-context prompts dead-lettered with SGLang's 400, the brake, n > 1 with logprobs,
# scripts/sglang/checks.py (logprobs streamed and not with EOS first, stop strings,
# stop_token_ids, tools, regex, pause and drain, a worker killed mid-batch, every prompt exactly
# once), the monitor's ETA and the paired throughput rounds; figures to gpu-sglang.json, exit 1
# if any check failed. The checks force end-of-sequence with a logit bias on token 151645
# (<|im_end|>): the model must be a Qwen2-family one (Qwen2.5-0.5B-Instruct, or the tiny random
# Qwen2 of scripts/vllm/make_model.py, the default).
#
# Never run: no GPU was lent to the session that wrote it. What it needs (docs/engines.md):
#   GENQ_GPU_SGLANG_PY  a Python with sglang 0.5.23 and its CUDA requirements installed
#                       (`pip install sglang==0.5.23`: a CUDA torch 2.14.1, sglang-kernel,
#                       flashinfer; several GB). The device machines reach no registry and
#                       carry 64 MiB: this cannot be brought there, so such a machine needs it
#                       preinstalled. Default: a venv made under the cache by pip (needs PyPI).
#   GENQ_GPU_MODEL      a local Qwen2-family model directory; default: the tiny random Qwen2
#                       (needs the Qwen2 vocab file of the llama-cpp-python sdist, or the cache).
#   GENQ_GPU_CACHE      default ~/.cache/genq-gpu
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU (nvidia-smi)" >&2; exit 2; }
# The vLLM script makes the engine's venv and the model when they are not given; SGLang alone here.
GENQ_GPU_ENGINES=sglang GENQ_GPU_SGLANG_PY=${GENQ_GPU_SGLANG_PY:-} exec scripts/vllm/gpu_check.sh
