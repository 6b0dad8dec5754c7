"""What `genq workers` shows in a terminal of 80, 120 and 200 columns, and what its --json says,
for a fleet as a first week meets it: long host names, real model names, an idle worker, a
lost one, a capped one (rich's Console at fixed widths; no Redis, no process).
"""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from genq.cli.control import print_workers
from genq.core.records import BatchRef, WorkerStatus
from genq.ops.control import WorkerRow

NOW = 1_800_000_000.0
MODEL = "Qwen/Qwen3-235B-A22B-Thinking-2507"


def status(name: str, state: str, beat_ago: float, **fields: object) -> WorkerStatus:
    host = name.rsplit(".", 1)[0]
    return WorkerStatus(name=name, host=host, pid=4242, server=f"http://{host}.internal.example.com:30000",
                        state=state, started_at=NOW - 3600, heartbeat_at=NOW - beat_ago, gpu=name[-1],
                        model=MODEL, **fields)  # type: ignore[arg-type]


def fleet() -> tuple[list[WorkerRow], dict[str, list[str]]]:
    busy = status("vm-a100-node-17.gpu3", "busy", 0.4, concurrency_target=128, server_capacity=128, in_flight=127,
                  queued=900, tok_per_s=5123.0, done=20_000,
                  batches=[BatchRef(job="thinking-20k", batch=f"b{i:07d}") for i in range(4)])
    idle = status("vm-a100-node-18.gpu0", "idle", 16.2, concurrency_target=128, server_capacity=128)
    capped = status("vm-a100-node-18.gpu1", "busy", 0.9, concurrency_target=4, concurrency_limit=4,
                    server_capacity=128, in_flight=4, tok_per_s=700.0, done=311,
                    note="concurrency cap 4 below server capacity 128")
    rows = [WorkerRow(s.name, s, NOW) for s in (busy, idle, capped)] + [WorkerRow("vm-a100-node-19.gpu7", None, NOW)]
    return rows, {s.name: ["thinking-20k", "another-long-job-name"] for s in (busy, idle, capped)}


def shown(width: int) -> str:
    out = Console(width=width, record=True, no_color=True, file=open("/dev/null", "w"))
    print_workers(out, *fleet())
    return out.export_text()


def line_of(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip().startswith(name))


@pytest.mark.parametrize("width", [80, 120, 200])
def test_genq_workers_is_readable_at_every_width(width):
    text = shown(width)
    assert all(len(line) <= width for line in text.splitlines()), text
    assert "…" not in "".join(line.split("│")[0] for line in text.splitlines()), f"a name was cut:\n{text}"
    header = text.splitlines()[0]
    for column in ("worker", "state", "tok/s"):
        assert column in header, f"{column!r} dropped at {width} columns:\n{text}"
    for name, state, toks in (("vm-a100-node-17.gpu3", "busy", "5,123"), ("vm-a100-node-18.gpu0", "idle", "0"),
                              ("vm-a100-node-18.gpu1", "busy", "700"), ("vm-a100-node-19.gpu7", "lost", None)):
        line = line_of(text, name)
        assert re.search(rf"\b{state}\b", line), f"{name} not shown {state}:\n{text}"
        if toks is not None:
            assert toks in line, f"{name}'s tok/s not shown:\n{text}"
    # Which worker is lost, said in words under the table whatever fits in it.
    assert re.search(r"lost: vm-a100-node-19\.gpu7\s+\(no\s+heartbeat\s+for\s+15\s+s", text), text
    # Columns left out are named, never silently dropped.
    if width < 200:
        assert f"not shown at {width} columns:" in text and "--json" in text, text


def test_an_idle_workers_heartbeat_does_not_read_as_lost():
    """An idle worker beats every 20 s: 16 s ago is on time, and the table says how often it beats."""
    line = line_of(shown(200), "vm-a100-node-18.gpu0")
    assert "16s (every 20s)" in line, line
    busy = line_of(shown(200), "vm-a100-node-17.gpu3")
    assert re.search(r"\b0s\b", busy) and "every" not in busy, busy


def test_the_servers_capacity_has_a_column_and_a_json_field():
    text = shown(120)
    header = text.splitlines()[0]
    assert "capacity" in header, text
    assert re.search(r"\b128\b", line_of(text, "vm-a100-node-17.gpu3")), text
    capped = line_of(text, "vm-a100-node-18.gpu1")
    assert "4/4 limit 4" in capped and re.search(r"\b128\b", capped), text
    rows, _ = fleet()
    busy, idle, capped_row, lost = (r.to_json() for r in rows)
    assert busy["server_capacity"] == 128 and busy["concurrency_limit"] is None, busy
    assert capped_row["server_capacity"] == 128 and capped_row["concurrency_limit"] == 4, capped_row
    assert capped_row["cap"] == 4 and busy["cap"] is None  # the first name, kept for scripts
    assert lost["server_capacity"] is None and lost["state"] == "lost"


def test_a_worker_whose_beats_stopped_is_not_shown_busy_until_its_record_expires():
    """A SIGKILLed worker's record says "busy" for 15 s (60 s if it was idle): once its next beat is more than
    3 s late (due every second while it holds work, else every 20 s) the views say "silent"."""
    from genq.core.ledger.figures import WorkerView
    from genq.monitor.progress import worker_report

    killed = status("vm-a100-node-20.gpu0", "busy", 4.5, in_flight=64, tok_per_s=900.0, server_running=64.0,
                    server_capacity=64, batches=[BatchRef(job="thinking-20k", batch="b0000099")])
    killed_idle = status("vm-a100-node-20.gpu1", "idle", 23.5)
    rows, serves = fleet()
    rows += [WorkerRow(s.name, s, NOW) for s in (killed, killed_idle)]
    out = Console(width=200, record=True, no_color=True, file=open("/dev/null", "w"))
    print_workers(out, rows, serves)
    text = out.export_text()
    for name, beat in (("vm-a100-node-20.gpu0", "4s (overdue)"), ("vm-a100-node-20.gpu1", "24s (overdue)")):
        assert re.search(r"\bsilent\b", line_of(text, name)) and beat in line_of(text, name), text
    wide = Console(width=400, record=True, no_color=True, file=open("/dev/null", "w"))  # the batches column too
    print_workers(wide, rows, serves)
    batches = wide.export_text()  # a busy worker's batches, none of a silent one's: it holds nothing (monitoring.md)
    assert "thinking-20k/b0000000" in batches and "b0000099" not in batches, batches
    assert "2 busy, 1 idle, 1 lost, 2 silent" in text and "5,823 tok/s in all" in text, text  # not the killed one's
    assert "vm-a100-node-20.gpu0:" not in text, text  # no verdict on its decode from its last figures
    assert [r.to_json()["state"] for r in rows[-2:]] == ["silent", "silent"]
    assert worker_report(WorkerView(killed.name, killed), NOW).state == "silent"
    assert worker_report(WorkerView("on-time", status("on-time.gpu0", "busy", 3.5)), NOW).state == "busy"
