"""The two test tiers (`make test-fast`, `make test`), a pytest plugin loaded by tests/conftest.py.

A test is end-to-end when it starts a process (a sim, a worker, the CLI, a second Redis); every other
test is fast: genq's own code against the private Redis, in this process. The guard fails a fast test
that starts a process anyway, so a test cannot be in the wrong tier without anyone noticing: mark it
`@pytest.mark.e2e`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

PROCESS_FIXTURES = {"procs", "sim", "worker"}
DURATIONS = Path(__file__).with_name("durations.txt")
# Files whose tests mostly run the CLI or a second Redis without those fixtures.
E2E_FILES = {
    "test_control.py", "test_dlq.py", "test_export.py", "test_fidelity.py", "test_first_day_cli.py",
    "test_first_day_figures.py", "test_first_day_urls.py", "test_first_hour.py", "test_fleet.py",
    "test_harness.py", "test_inputs.py", "test_layout.py", "test_monitor.py", "test_producer.py",
    "test_recover_output.py", "test_s3.py", "test_security.py", "test_sentinel.py", "test_worker.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        spawns = item.path.name in E2E_FILES or not PROCESS_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("e2e") is None and not spawns:
            item.add_marker(pytest.mark.fast)
        else:
            item.add_marker(pytest.mark.e2e)
    # End-to-end tests first, longest first (tests/durations.txt, measured), the fast ones last: xdist
    # hands tests out in this order as processes free up, so no long test starts near the end, the many
    # short tests fill in while the last long ones end, and the processes finish together.
    took = _durations()
    items.sort(key=lambda item: (item.get_closest_marker("e2e") is None, -took.get(item.nodeid, 10.0)))


def _durations() -> dict[str, float]:
    if not DURATIONS.exists():
        return {}
    return {nodeid: float(s) for s, nodeid in (line.split(" ", 1) for line in DURATIONS.read_text().splitlines())}


# GENQ_RECORD_DURATIONS=1 make test: write tests/durations.txt from this run (setup, call and teardown).
_took: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("GENQ_RECORD_DURATIONS") == "1":
        _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _took and not hasattr(session.config, "workerinput"):  # the controller, which saw every report
        DURATIONS.write_text("".join(f"{s:.1f} {nodeid}\n" for nodeid, s in sorted(_took.items(), key=lambda x: -x[1])))


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("fast") is None:
        return

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.e2e (tests/tiers.py)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
