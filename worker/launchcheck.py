"""Before a fleet launches anything: can its --launch command run on this machine at all?

A program that is not on PATH, or `python -m PACKAGE...` where that python has no PACKAGE (SGLang
or vLLM not installed here, a CPU box without them), would otherwise start, exit with status 1
and be restarted --max-restarts times per GPU before the fleet gives up. Said once, at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess

HAS_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
STAND_IN = "without the server installed here, `--launch \"genq sim --port {port}\"` stands in for one (docs/fleet.md)"


def launch_problem(argv: list[str]) -> str | None:
    """Why argv cannot run here, or None. Looks the package up without importing it (no CUDA is touched)."""
    program = argv[0]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None:
        return None if os.sep in program else (f"--launch: {program!r} is not a command on this machine's PATH; "
                                               f"{STAND_IN}")
    if not os.path.basename(found).startswith("python") or len(argv) < 3 or argv[1] != "-m":
        return None
    package = argv[2].split(".")[0]
    try:
        rc = subprocess.run([found, "-c", HAS_MODULE, package], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None  # the launch itself will say what is wrong
    if rc != 3:
        return None
    return (f"--launch: {found} has no module {package!r} (`{' '.join(argv[:3])}` cannot start): install it into "
            f"that python, or name the python that has it (--launch \"/path/to/venv/bin/python -m {argv[2]} ...\"); "
            f"{STAND_IN}")
