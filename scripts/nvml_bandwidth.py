"""On a GPU machine: each GPU's memory bandwidth as genq reads it from NVML (bus width x maximum
memory clock x 2) beside the rated figure of genq's table (worker/telemetry.py SPECS), and the decode
bound a model of --model-bytes would have at --running requests.

    python scripts/nvml_bandwidth.py [--model-bytes 54e9] [--running 37]

Exits 1 when a GPU's NVML figure is more than 15 % off its rated one (or there is no GPU).
"""

from __future__ import annotations

import argparse
import sys

from genq.worker.telemetry import SPEC_AGREES, GpuProbe, spec_bandwidth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-bytes", type=float, default=None, help="weight bytes, e.g. 54e9")
    parser.add_argument("--running", type=int, default=1, help="running requests for the bound")
    args = parser.parse_args()
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
        if probe.bandwidth and args.model_bytes:
            bound = args.running * probe.bandwidth / args.model_bytes
            print(f"  decode bound at {args.running} running (weights only): {bound:,.0f} tok/s")
    return 1 if bad or not count else 0


if __name__ == "__main__":
    sys.exit(main())
