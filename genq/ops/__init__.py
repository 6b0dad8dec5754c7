"""What operators do to a running system: plain synchronous Redis (and output) reads and writes that
the CLI and the monitor's web page share; workers pick the changes up within about a second."""
