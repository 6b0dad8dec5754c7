#!/usr/bin/env python3
"""mypy over the whole `genq` package, whose worker, monitor and producer live in top-level folders.

pyproject.toml's package-dir installs worker/ as genq.worker (and monitor/, producer/ likewise); the
editable install finds them through setuptools' import hook, which mypy cannot follow. So this copies
the package as it is installed (mtimes kept, so mypy's cache stays warm) into .genq-typecheck/, runs
mypy there, and prints each error under the file's real path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIEW = ROOT / ".genq-typecheck"


def package_folders() -> dict[str, Path]:
    """Installed folder (genq/worker) -> real folder (worker/), from pyproject.toml: one definition."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name.replace(".", "/"): ROOT / folder for name, folder in config["package-dir"].items()}
    return {"genq": ROOT / "genq", **mapped}


def build_view(folders: dict[str, Path]) -> None:
    wanted: set[Path] = set()
    for installed, real in folders.items():
        for source in real.rglob("*.py"):
            target = VIEW / installed / source.relative_to(real)
            wanted.add(target)
            if not target.exists() or target.stat().st_mtime_ns != source.stat().st_mtime_ns:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    for stale in VIEW.rglob("*.py"):
        if stale not in wanted:
            stale.unlink()


def main() -> int:
    folders = package_folders()
    build_view(folders)
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "genq"]
    run = subprocess.run(command, cwd=VIEW, capture_output=True, text=True)
    # Longest installed prefix first, so genq/worker/x.py maps to worker/x.py, not genq/...
    prefixes = sorted(folders.items(), key=lambda item: -len(item[0]))
    for line in (run.stdout + run.stderr).splitlines():
        for installed, real in prefixes:
            if line.startswith(installed + "/"):
                line = str(real.relative_to(ROOT)) + line[len(installed):]
                break
        print(line)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
