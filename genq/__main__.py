"""`python -m genq`. Started in a folder that holds genq's sources (the Docker image's /app), Python puts the folder
first on sys.path, and its genq/ lacks the worker, producer and monitor mapped in at install: genq then starts again
with -P (the folder left out), so the installed package runs, as `genq` and genq's own children (genq.PYTHON) do."""

import importlib.util
import os
import sys

if not sys.flags.safe_path and importlib.util.find_spec("genq.worker") is None:
    os.execv(sys.executable, [sys.executable, "-P", "-m", "genq", *sys.argv[1:]])

from genq.cli import main  # noqa: E402

main()
