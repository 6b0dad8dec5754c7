"""`genq sim`: run the simulator of one GPU inference server (SGLang, vLLM or llama.cpp)."""

from __future__ import annotations

import typing
from typing import Any

import click
import msgspec

from genq.cli import Finite
from genq.sim.config import SimConfig
from genq.sim.serve import FLAVORS, run


def sim(**options: Any) -> None:
    """Serve a simulator of one GPU inference server (SGLang, vLLM or llama.cpp).

    Continuous batching in compressed time, deterministic output lengths, the flavor's endpoints, errors and
    /metrics, and /sim/stats, /sim/reset, /sim/faults. Stops on SIGINT/SIGTERM (llamacpp: the first SIGTERM stops
    listening, leaving open requests hanging as llama-server does; it exits once none is open or on a second one).
    """
    config = SimConfig(**options)
    shown = ("flavor", "max_running_requests", "max_total_num_tokens", "step_ms_base", "step_ms_per_req",
             "tokens_per_step", "mean_output_tokens")
    summary = ", ".join(f"{name}={getattr(config, name)}" for name in shown)
    run(config, on_ready=lambda url: click.echo(f"genq sim: listening on {url} ({summary})"))


# One option per SimConfig field, in its order: the field's type (the rates 0..1; no nan or inf) and its help.
_DEFAULTS = msgspec.to_builtins(SimConfig())
for _name, _hint in reversed(typing.get_type_hints(SimConfig, include_extras=True).items()):
    _type, _help = typing.get_args(_hint)
    _type = typing.get_args(_type)[0] if _DEFAULTS[_name] is None else _type
    _flags = ["--" + _name.replace("_", "-")] + (["--max-context"] if _name == "context_length" else [])
    sim = click.option(
        *_flags, _name, default=_DEFAULTS[_name], help=_help,
        type=click.Choice(FLAVORS) if _name == "flavor" else Finite(0, 1) if _name.endswith("_rate")
        else click.IntRange(0, 65535) if _name == "port" else Finite() if _type is float else _type,
        metavar={"crash_marker": "TEXT", "tool_call_parser": "NAME"}.get(_name))(sim)
sim = click.command("sim", short_help="Simulate one SGLang, vLLM or llama.cpp server (no GPU needed).",
                    context_settings={"show_default": True, "max_content_width": 100})(sim)
