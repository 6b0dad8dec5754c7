"""A child process that dies with its parent (Linux's PR_SET_PDEATHSIG; elsewhere nothing happens)."""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1


def ask_for_signal_on_parent_death(sig: int) -> None:
    """From now on this process gets `sig` when the thread that forked it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass  # not Linux: the callers say what notices a lost parent there
