"""The package as installed: worker/, monitor/ and producer/ are genq.worker, .monitor and .producer,
with no links in the tree and nothing else of the repository importable (issue #23)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_the_tree_has_no_links() -> None:
    # A clone made with core.symlinks=false (Windows, some CI checkouts) turns a link into a text file.
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t")[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []


def test_only_genq_is_importable_from_outside_the_repository(tmp_path) -> None:
    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)

    found = run("import genq.worker.engine, genq.monitor.view, genq.producer.enqueue as p; print(p.__file__)")
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(ROOT / "producer" / "enqueue.py")
    for name in ("worker", "monitor", "producer", "bench", "scripts"):
        stray = run(f"import {name}")
        assert stray.returncode != 0 and f"No module named '{name}'" in stray.stderr, (name, stray.stderr)
    # One copy of each module: the worker's records are the same class by either route.
    same = run("import genq.worker.held as a, importlib; print(a is importlib.import_module('genq.worker.held'))")
    assert same.stdout.strip() == "True", same.stderr
