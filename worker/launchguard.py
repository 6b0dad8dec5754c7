"""The guard of one launched server's process group: the group dies with the fleet, however the fleet dies.

PR_SET_PDEATHSIG reaches only the process the fleet started, not a server started through a
shell (`bash -c 'server ...; echo exited'`). The guard runs beside each server in a session of
its own, reading a pipe from the fleet: "done" means the group is gone; the pipe ending without
it means the fleet died, and the guard sends SIGTERM to the group, SIGKILL after the stop timeout.

    python -m genq.worker.launchguard PGID STOP_SECONDS
"""

from __future__ import annotations

import os
import signal
import sys
import time


def end_group(pgid: int, stop_s: float) -> None:
    """SIGTERM to the group, SIGKILL to what is left after stop_s."""
    deadline = time.monotonic() + stop_s
    try:
        os.killpg(pgid, signal.SIGTERM)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(pgid, 0)  # ProcessLookupError once the group is gone
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    pgid, stop_s = int(argv[0]), float(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # only the pipe ends the guard
        signal.signal(sig, signal.SIG_IGN)
    said = b""
    while chunk := os.read(sys.stdin.fileno(), 64):
        said += chunk
    if said != b"done\n":
        print(f"genq: the fleet is gone; stopping the server's process group {pgid}", file=sys.stderr, flush=True)
        end_group(pgid, stop_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
