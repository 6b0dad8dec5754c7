"""Nothing `genq worker --gpus --launch` started outlives its fleet, however it was started and however
the fleet died: a server under a shell is the shell's child, out of reach of the shell's parent-death signal."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.test_fleet import GENQ, SIM_ARGS, free_ports, health, read_pid, start_fleet

pytestmark = pytest.mark.e2e


def group_members(pgid: int) -> list[int]:
    """The live processes of process group pgid (zombies are gone: they hold nothing)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def test_a_server_under_a_shell_dies_with_a_fleet_killed_outright(tmp_path, redis_url, procs):
    base = free_ports(1)
    url = f"http://127.0.0.1:{base}"
    logs = tmp_path / "logs"
    fleet = start_fleet(procs, "--gpus", "0", "--base-port", str(base), "--log-dir", str(logs),
                        "--launch", f"bash -c '{GENQ} sim --port {{port}} {SIM_ARGS}; echo exited'")
    wait_until(lambda: health(url) == 200, what="the launched server healthy")
    group = read_pid(logs / "server-gpu0.pid")  # the shell, leader of the server's own process group
    assert group and len(group_members(group)) >= 2, group_members(group or 0)  # the shell and the sim
    try:
        os.kill(fleet.pid, signal.SIGKILL)
        left = wait_until(lambda: not group_members(group) or None, timeout=45, interval=0.5,
                          what=f"every process of the server's group {group} to end")
        assert left is True
        assert health(url) is None  # its port is free
    finally:
        for pid in group_members(group):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
