"""`python -m sim`: the same as `genq sim`."""

from sim.cli import sim_command

sim_command(prog_name="python -m sim")
