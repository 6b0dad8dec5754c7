"""The `genq` command: one click group; each subcommand lives beside the code it drives.

Subcommands are imported lazily so `genq --help` and small commands start fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from genq.core.redisconn import ENV_VAR, mask_url, resolve_url

# name -> "module:attribute" of a click command
COMMANDS: dict[str, str] = {
    "enqueue": "genq.cli.enqueue:enqueue",
    "worker": "genq.cli.worker:worker",
    "monitor": "genq.cli.monitor:monitor",
    "sim": "genq.cli.sim:sim_command",
    "demo": "genq.cli.demo:demo",
    "dlq": "genq.cli.dlq:dlq",
    "pause": "genq.cli.control:pause",
    "resume": "genq.cli.control:resume",
    "drain": "genq.cli.control:drain",
    "workers": "genq.cli.control:workers",
    "concurrency": "genq.cli.control:concurrency",
    "export": "genq.cli.export:export",
    "jobs": "genq.cli.control:jobs",
    "recover": "genq.cli.recover:recover",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _available(name))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                return None
            raise


def _available(name: str) -> bool:
    module = COMMANDS[name].split(":")[0]
    return importlib.util.find_spec(module) is not None


class Concurrency(click.ParamType):
    """Requests in flight: 'auto' (None) or a whole number; `genq concurrency` also takes 0
    for auto, as the Control record stores it."""

    name = "auto|N"

    def __init__(self, *, zero_is_auto: bool = False) -> None:
        self.zero_is_auto = zero_is_auto

    def convert(self, value, param, ctx):
        if value is None or str(value).lower() == "auto":
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)
        if number < (0 if self.zero_is_auto else 1):
            self.fail("must be a positive number (or auto)" if self.zero_is_auto else "must be at least 1", param, ctx)
        return number or None


class Settings:
    """What the group's options give every subcommand (ctx.obj)."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    @property
    def redis_display(self) -> str:
        return mask_url(self.redis_url)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--redis",
    "redis_url",
    envvar=ENV_VAR,
    default=None,
    metavar="URL",
    help=f"Redis URL (redis:// or rediss://; env {ENV_VAR}; default redis://127.0.0.1:6379/0). "
    "Passwords are masked in all output.",
)
@click.version_option(package_name="genq")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None) -> None:
    """genq: batch LLM generation over a fleet of SGLang/vLLM servers, queued in Redis.

    \b
    Typical run:
      genq sim --port 30000 &                 # or a real SGLang server per GPU
      genq enqueue prompts.jsonl --job expansion --output ./out
      genq worker --server http://127.0.0.1:30000 --burst
      genq monitor --job expansion

    \b
    Exit status (every command):
      0    done
      1    error: the message on stderr says what (unreachable Redis, missing input, ...)
      2    bad usage: unknown option, missing argument, value out of range
      3    partly done: some input lines or DLQ entries were skipped (each one named)
      130  interrupted (Ctrl-C)
    """
    ctx.obj = Settings(resolve_url(redis_url))


def settings(ctx: click.Context) -> Settings:
    obj = ctx.find_object(Settings)
    if obj is None:  # a subcommand invoked on its own (tests, python -m)
        obj = Settings(resolve_url(None))
    return obj


def main() -> None:
    try:
        cli(prog_name="genq")
    except KeyboardInterrupt:
        sys.exit(130)
