#!/usr/bin/env bash
# genq against real vLLM on a GPU machine that reaches no registry: the second of the two
# device calls of scripts/vllm/gpu_bundle.sh (the first left /tmp/genqA/part-aa):
#
#     VLLM_USE_FLASHINFER_SAMPLER=0 bash scripts/vllm/gpu_offline.sh
#
# (FlashInfer is not bundled: without that setting vLLM 0.26's sampler imports it and the
# engine does not start.) Unpacks the bundle into /tmp, installs genq (editable, no index),
# checks genq's GPU figures (NVML) on GPU 0 and its clean note for a GPU that is not there,
# then runs scripts/vllm/bench.py with vLLM --enforce-eager and --load-format dummy at 128 and
# 16 slots. Everything it prints, the bench's JSON and vLLM's logs land in $OUT (the device
# tool brings them back). Its working draft ran in 448 s on an H200 on 2026-12-04 (docs/vllm.md);
# this file differs from it in small ways (croniter and pytz come in the bundle, not as wheels
# beside it; it stops at a failed import), and has not itself run on a GPU.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
el start
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
parts=$(ls /tmp/genqA/part-* 2>/dev/null || ls .gpu/a/part-* 2>/dev/null)
# shellcheck disable=SC2086
cat $parts .gpu/b/part-* | python3 -c "
import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp', filter='fully_trusted')" \
    || { el "the bundle did not unpack (was the first call's part-aa left in /tmp/genqA?)"; exit 3; }
el "unpacked"
mkdir -p /tmp/gbin /tmp/redislib
cp .gpu/b/redis/redis-server .gpu/b/redis/lib/* /tmp/redislib/ 2>/dev/null
printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/redislib exec /tmp/redislib/redis-server "$@"\n' > /tmp/gbin/redis-server
chmod +x /tmp/gbin/redis-server /tmp/redislib/redis-server
export PATH=/tmp/gbin:$PATH PYTHONPATH=/tmp/site312 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
redis-server --version || { el "redis-server does not run"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "
import vllm, torch, genq.worker.intake, msgspec, rq
print('vllm', vllm.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'msgspec', msgspec.__version__, 'rq', rq.__version__)
from genq.worker.controller import GpuProbe
for index in (0, 7):
    probe = GpuProbe(index)
    print(f'GpuProbe({index}):', probe.note, probe.sample())" || { el "imports failed"; exit 3; }
extra=(--engine-arg=--enforce-eager --engine-arg=--load-format --engine-arg=dummy)
if ! python3 -c "import torch, vllm.vllm_flash_attn._vllm_fa3_C" 2>/dev/null; then
    el "FlashAttention 3 does not load: Triton attention"
    extra+=(--engine-arg=--attention-backend --engine-arg=TRITON_ATTN)
fi
el "bench"
timeout "${GENQ_GPU_BENCH_S:-480}" python3 -u scripts/vllm/bench.py --engine vllm --gpu --python python3 \
    --model /tmp/gmodel --seqs 128,16 --capacity-runs 1 --capacity-n 1000 --eta-n 8000 --round-n 2000 --rounds 2 \
    --max-tokens 128 "${extra[@]}" --out "$OUT/gpu-vllm.json"
el "bench exit $?"
for f in /tmp/genq-vllm-*/vllm-*.log; do tail -c 400000 "$f" > "$OUT/$(basename "$f")"; done
el "done"
