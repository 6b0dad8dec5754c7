"""What operators do to a running system: plain synchronous Redis (and output) reads and writes that
the CLI and the monitor's web page share; workers pick the changes up within about a second."""


class Refused(Exception):
    """What the operator asked cannot be done (an unknown job or id, a change that changes nothing):
    the message says why and what to do; the CLI prints it in one line and exits 1."""
