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


def _check_layout():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts" / "check_layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _graph(layout) -> tuple[dict, dict[str, set[str]]]:
    modules = layout.genq_files()
    graph = {name: {d for i in layout.imports_of(path, name) if (d := layout.resolve(i, modules)) and d != name}
             for name, path in modules.items()}
    return modules, graph


def test_only_the_ledger_builds_keys_and_the_exceptions_only_shrink() -> None:
    # issue #23: a module outside the ledger that starts building keys again (imports genq.core.keys)
    # fails `make check`; an exception no longer needed must leave KEYED_YET.
    layout = _check_layout()
    modules, graph = _graph(layout)
    breaches, keyed = layout.boundary(modules, graph)
    assert breaches == []
    assert sorted(keyed) == sorted(layout.KEYED_YET)
    assert all(reason.strip() for reason in layout.KEYED_YET.values())
    assert {n for n in modules if n.startswith("genq.core.ledger.")} and not any(
        layout.in_ledger(n) for n in keyed)
    for name in ("genq.monitor.progress", "genq.worker.heartbeat", "genq.cli.status", "genq.ops.dlq"):
        again = {**graph, name: graph[name] | {"genq.core.keys"}}
        breaches, _ = layout.boundary(modules, again)
        assert breaches == [f"ledger: {name} builds Redis keys (imports genq.core.keys): ask the ledger "
                            "(genq/core/ledger/) instead, or add a function there"]
    stale = {**layout.KEYED_YET, "genq.cli.status": "no longer true"}
    breaches, _ = layout.boundary(modules, graph, stale)
    assert breaches == ["ledger: genq.cli.status no longer builds keys: take it off check_layout.KEYED_YET"]


def test_the_layout_check_passes_on_the_tree() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_layout.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "layout: ok" in done.stdout
