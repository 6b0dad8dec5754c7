"""On a GPU machine: each GPU's memory bandwidth as genq reads it from NVML (bus width x maximum
memory clock x 2) beside the rated figure of genq's table (worker/controller.py SPECS), and the decode
bound a model's weights would have at --running requests.

    python scripts/nvml_bandwidth.py [--model DIR | --model-bytes 54e9] [--running 37]

--model takes a local model directory's weight files (*.safetensors, *.bin, *.gguf) as its bytes.
scripts/sglang/gpu_check.sh runs it before scripts/sglang/bound_check.py --gpu, which sets a small
model's measured decode on SGLang against the same bound.

Needs: an NVIDIA driver (libnvidia-ml) and a Python with genq's requirements (nvidia-ml-py,
msgspec). Exits 1 when a GPU's NVML figure is more than 15 % off its rated one (or there is no GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from genq.worker.controller import SPEC_AGREES, GpuProbe, spec_bandwidth

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")


def model_bytes(folder: Path) -> int:
    """The bytes of a model directory's weight files: what each decode step reads of the weights."""
    return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in folder.glob(pattern))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a local model directory: its weight files' bytes")
    parser.add_argument("--model-bytes", type=float, default=None, help="weight bytes, e.g. 54e9")
    parser.add_argument("--running", type=int, default=1, help="running requests for the bound")
    args = parser.parse_args(argv)
    weights = args.model_bytes if args.model is None else model_bytes(args.model)
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # no driver: the clean "no GPU" of the worker
        print(f"no GPU: {type(exc).__name__}: {exc}")
        return 1
    bad = 0
    for index in range(count):
        probe = GpuProbe(index)
        sample = probe.sample()
        name = sample.name if sample else f"GPU {index}"
        print(f"GPU {index} {name}: {probe.bandwidth_from or probe.note}")
        spec = spec_bandwidth(name)
        if probe.bandwidth is None or (spec and abs(probe.bandwidth - spec[1]) > SPEC_AGREES * spec[1]):
            bad += 1
        if probe.bandwidth and weights:
            bound = args.running * probe.bandwidth / weights
            print(f"  decode bound of {weights / 1e9:.3f} GB of weights at {args.running} running "
                  f"(weights only, a ceiling): {bound:,.0f} tok/s")
    return 1 if bad or not count else 0


if __name__ == "__main__":
    sys.exit(main())
