"""genq: a Redis-backed job system that drives a fleet of LLM servers as one batch-generation machine."""

import sys

# How genq starts a genq process of its own (a fleet's workers, the demo's sims and workers):
# `-P` keeps the current folder off sys.path, so the installed package is loaded even when
# the folder is a source tree whose genq/ lacks the worker, producer and monitor mapped in at install.
PYTHON = (sys.executable, "-P")
