"""The `genq` command: one click group; each subcommand lives beside the code it drives.

Subcommands are imported lazily so `genq --help` and small commands start fast.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
import redis
from rich.console import Console

from genq.core.redisconn import ENV_VAR, FORMS, BadRedisURL, connect, describe_error, mask_url, parse, resolve_url

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
    "drain": "genq.cli.fleet:drain",
    "workers": "genq.cli.fleet:workers",
    "concurrency": "genq.cli.fleet:concurrency",
    "export": "genq.cli.export:export",
    "jobs": "genq.cli.control:jobs",
    "status": "genq.cli.status:status",
    "recover": "genq.cli.recover:recover",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _available(name))

    def invoke(self, ctx: click.Context) -> Any:
        """Ctrl-C: exit 130, as the README says (click itself prints "Aborted!" and exits 1)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                return None
            raise
        return _with_global_options(command)


def _set_redis(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:  # given after the subcommand: it overrides the group's (and the env's)
        ctx.ensure_object(Settings).redis_url = checked_url(value)


def _with_global_options(command: click.Command) -> click.Command:
    """The group's --redis, accepted after the subcommand too (`genq worker ... --redis URL`),
    on the subcommand and on every subcommand of a subgroup (`genq dlq list --redis URL`)."""
    if not any(p.name == "subcommand_redis" for p in command.params):
        command.params.append(click.Option(["--redis", "subcommand_redis"], metavar="URL", expose_value=False,
                                           is_eager=True, callback=_set_redis,
                                           help="Redis URL: the same as genq --redis URL (see genq --help)."))
    for sub in getattr(command, "commands", {}).values():
        _with_global_options(sub)
    return command


class BadURL(click.ClickException):
    """A Redis URL genq cannot use: bad usage (exit 2), said in one line."""

    exit_code = 2


def checked_url(url: str) -> str:
    try:
        parse(url)
    except BadRedisURL as exc:
        raise BadURL(str(exc)) from None
    return url


def _available(name: str) -> bool:
    module = COMMANDS[name].split(":")[0]
    return importlib.util.find_spec(module) is not None


class Concurrency(click.ParamType):
    """Requests in flight: 'auto' (None) or a whole number of at least 1 (0 would mean
    nothing: no request could be sent; auto is asked for by name)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or str(value).lower() == "auto":
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)
        if number < 1:
            self.fail(f"{number} is not a cap: give at least 1, or auto to follow the server", param, ctx)
        return number


class JobName(click.ParamType):
    """A job name as the ledger's check_job_name allows it: a bad one is bad usage (exit 2)."""

    name = "NAME"

    def convert(self, value, param, ctx):
        from genq.core.ledger.jobs import check_job_name

        try:
            return check_job_name(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Option(click.Option):
    """An option whose earlier names (`old`) still work but are left out of --help: scripts
    written against them keep running, the help shows one name."""

    def __init__(self, param_decls: Sequence[str], *, old: Sequence[str] = (), **attrs: Any) -> None:
        super().__init__([*param_decls, *old], **attrs)
        self.old = set(old)

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        shown, self.opts = self.opts, [o for o in self.opts if o not in self.old]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown


def job_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The job of a command that names one, as JOB or --job JOB (the other commands take --job):
    either form, not two different ones. The command receives it as `job`."""

    @functools.wraps(fn)
    def command(*args: Any, job: str | None, job_option: str | None, **kwargs: Any) -> Any:
        if job is not None and job_option is not None and job != job_option:
            raise click.UsageError(f"two jobs given: {job} and --job {job_option}; give one")
        if job is None and job_option is None:
            raise click.UsageError("give the job: JOB or --job JOB")
        return fn(*args, job=job or job_option, **kwargs)

    command = click.option("--job", "job_option", type=JobName(), default=None, metavar="JOB",
                           help="The job, as an option (the same as JOB).")(command)
    return click.argument("job", type=JobName(), required=False)(command)


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
    help=f"Redis URL, before or after the subcommand (env {ENV_VAR}; default redis://127.0.0.1:6379/0). "
    f"Forms: {FORMS}. Passwords are masked in all output; docs/operations.md has every form.",
)
@click.version_option(package_name="genq")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None) -> None:
    """genq: batch LLM generation over a fleet of SGLang, vLLM or llama.cpp (llama-server) servers, queued in Redis.

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
    ctx.obj = Settings(checked_url(resolve_url(redis_url)))


def settings(ctx: click.Context) -> Settings:
    obj = ctx.find_object(Settings)
    if obj is None:  # a subcommand invoked on its own (tests, python -m)
        obj = Settings(resolve_url(None))
    return obj


@contextmanager
def redis_conn(ctx: click.Context) -> Iterator[redis.Redis]:
    """The command's Redis, closed after. Whatever Redis says instead of answering (unreachable,
    full, a database index it does not have, an address that is not Redis) is one line naming
    the URL (its password masked), exit 1, not a traceback: genq.core.redisconn.describe_error."""
    url = settings(ctx).redis_url
    conn = connect(url)
    try:
        yield conn
    except redis.RedisError as exc:
        raise click.ClickException(describe_error(url, exc)) from None
    finally:
        conn.close()


def console() -> Console:
    # Piped output (logs, docs, tests) gets wide lines rather than wrapped cells.
    return Console() if sys.stdout.isatty() else Console(width=200, no_color=True)


def main() -> None:
    try:
        cli(prog_name="genq")
    except KeyboardInterrupt:
        sys.exit(130)
