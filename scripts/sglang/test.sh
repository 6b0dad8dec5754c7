#!/usr/bin/env bash
# make test-sglang: genq against real SGLang 0.5.23 on CPU, from a fresh clone of this repository's
# committed HEAD (its own .venv), so what is checked is what is committed. Installs SGLang once
# (scripts/sglang/install.sh, cached in ~/.cache/genq-sglang), then scripts/vllm/bench.py --engine
# sglang with one server as the notes start it (16 running requests, a 2,048-token context): the
# capacity and context learnt, over-context prompts dead-lettered with SGLang's 400, the brake
# (scripts/llamacpp/brakes.py; SGLang refuses prompt + max_tokens over the context where the
# others cut the answer), n > 1 with logprobs, scripts/sglang/checks.py (logprobs streamed and
# not with EOS first, stop strings, stop_token_ids, tools, regex, pause and drain, a worker killed
# mid-batch, every prompt exactly once) and genq's throughput against a bare client's by the
# server's own occupancy. Sizes fit SGLang's 2-6 requests/s on 2 shared cores; more via ARGS.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
"$ROOT/scripts/sglang/install.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/genq-test-sglang.XXXXXX")
git clone --quiet "$ROOT" "$WORK/genq"
cd "$WORK/genq"
make --quiet install >/dev/null
echo "fresh clone of $(git rev-parse --short HEAD) in $WORK/genq"
exec .venv/bin/python scripts/vllm/bench.py --engine sglang --seqs 16 --capacity-runs 1 --capacity-n 64 --long 2 \
    --max-tokens 32 --skip eta --rounds 2 --round-n 64 --out "$ROOT/sglang-bench.json" "$@"
