"""The `genq` command: one click group, lazily loaded subcommands, and what they share. A Redis refusal,
an operator's mistake (genq.ops.control.Refused and the like) and Ctrl-C: one line and the README's exit status."""

from __future__ import annotations

import faulthandler
import functools
import importlib
import json
import math
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import click
import redis
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from genq.core.redisconn import ENV_VAR, FORMS, BadRedisURL, connect, describe_error, parse, resolve_url

EXIT_PARTLY_DONE = 3  # some input lines or DLQ entries were skipped, or an export is partial
EXIT_INTERRUPTED = 130
INT32 = 2**31 - 1  # the most --max-tokens or --priority: storable (msgpack is 64-bit), and a server's int

COMMANDS = {cmd: cmd for cmd in ("enqueue", "worker", "monitor", "sim", "demo", "dlq", "export", "status", "recover")}
COMMANDS |= dict.fromkeys(("pause", "resume", "jobs", "drain", "workers", "concurrency"), "control")  # name -> module


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return _with_redis_option(getattr(importlib.import_module(f"genq.cli.{COMMANDS[name]}"), name))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # click would say "Aborted!", exit 1; a command may add what it did
            click.echo(f"\ninterrupted{''.join(map(str, exc.args))}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except redis.RedisError as exc:  # unreachable, full, no such database, not Redis: the URL masked
            raise click.ClickException(describe_error(redis_url(ctx), exc)) from None
        except Exception as exc:  # what the operator can fix: one line, exit 1 (imported only when something failed)
            from genq.monitor.progress import JobNotFound
            from genq.ops.control import Refused
            from genq.producer.rows import RowError
            from genq.producer.sources import SourceError
            from genq.worker.fleet import FleetError

            if isinstance(exc, RowError):  # a request field's bad value (--extra-body for the job's endpoint)
                raise click.UsageError(str(exc)) from None
            if isinstance(exc, (Refused, SourceError, FleetError, JobNotFound)):
                raise click.ClickException(str(exc)) from None
            raise


class BadURL(click.ClickException):
    exit_code = 2  # a Redis URL genq cannot use is bad usage


def _set_redis(ctx: click.Context, param: click.Parameter | None, value: str | None) -> None:
    """--redis (or GENQ_REDIS_URL), kept on the root context: the last one given wins."""
    if value is not None:
        try:
            parse(value)
        except BadRedisURL as exc:
            raise BadURL(str(exc)) from None
        ctx.find_root().obj = value


def _with_redis_option(command: click.Command) -> click.Command:
    """The group's --redis, accepted after the subcommand too (`genq dlq list --redis URL`)."""
    if not any(p.name == "subcommand_redis" for p in command.params):
        command.params.append(click.Option(["--redis", "subcommand_redis"], metavar="URL", expose_value=False,
                                           is_eager=True, callback=_set_redis,
                                           help="Redis URL, as genq --redis URL."))
    for sub in getattr(command, "commands", {}).values():
        _with_redis_option(sub)
    return command


def redis_url(ctx: click.Context) -> str:
    return ctx.find_root().obj or resolve_url(None)  # obj: the URL of --redis or GENQ_REDIS_URL


def redis_conn(ctx: click.Context | None = None) -> redis.Redis:
    return connect(redis_url(ctx or click.get_current_context()))


def concurrency(value: Any) -> int | None:
    """Requests in flight: 'auto' (None) or a whole number of at least 1 (a click type)."""
    if value is None or str(value).lower() == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is neither 'auto' nor a whole number") from None
    if not 1 <= number <= 100_000:  # more than any server runs, and storable
        raise ValueError(f"{number} is not a cap: give at least 1 (at most 100000), or auto to follow the server")
    return number


def model_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: --model names a model (or auto); a blank one, or one in spaces, matches no server."""
    if value is not None and (not value.strip() or value != value.strip()):
        raise click.BadParameter(f"{value!r}: give a model name without spaces around it, or auto")
    return value


def local_or_s3(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: a local path or s3://; another scheme (gs://) or '' would be taken as a local folder
    (each worker's own, or /)."""
    if value == "" or value is not None and "://" in value and not value.startswith("s3://"):
        raise click.BadParameter(f"{value!r}: give a local path or s3://bucket/...")
    return value


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and inf: nan passes its comparisons, and neither is a weight or a setting."""

    def convert(self, value, param, ctx):
        if not math.isfinite(number := super().convert(value, param, ctx)):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number

    def _describe_range(self) -> str:  # --help's, where no bound is given (click's would say x<=None)
        return super()._describe_range() if (self.min, self.max) != (None, None) else "finite"


class JobName(click.ParamType):
    name = "NAME"  # as the ledger allows it: a bad one is bad usage

    def convert(self, value, param, ctx):
        from genq.core.ledger.jobs import check_job_name

        try:
            return check_job_name(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def job_option(help: str = "Only this job. [default: all jobs]") -> Callable[[Any], Any]:
    return click.option("--job", type=JobName(), default=None, metavar="NAME", help=help)


def job_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The job of a command that names one, as JOB or --job JOB (either, not two different ones)."""

    @functools.wraps(fn)
    def command(*args: Any, job: str | None, job_option: str | None, **kwargs: Any) -> Any:
        if job is not None and job_option is not None and job != job_option:
            raise click.UsageError(f"two jobs given: {job} and --job {job_option}; give one")
        if job is None and job_option is None:
            raise click.UsageError("give the job: JOB or --job JOB")
        return fn(*args, job=job or job_option, **kwargs)

    command = click.option("--job", "job_option", type=JobName(), default=None, metavar="JOB",
                           help="The same as JOB.")(command)
    return click.argument("job", type=JobName(), required=False)(command)


OWN_OPTIONS = {"max_tokens": ("token cap", "--max-tokens"), "max_completion_tokens": ("token cap", "--max-tokens"),
               "temperature": ("temperature", "--temperature"), "top_p": ("top_p", "--top-p")}


def extra_body(text: str, endpoint: str | None = None, prompts: bool = False) -> dict[str, Any]:
    """--extra-body's JSON object, its fields checked as a row's sampling is (RowError says why: bad usage);
    `prompts`: it overrides dead prompts' fields (dlq requeue), not the job's."""
    from genq.core.records import pack
    from genq.producer.rows import RowError, check_params

    def finite(number: str) -> float:  # nan and inf (NaN, Infinity, 1e999) would be sent as null
        if not math.isfinite(value := float(number)):
            raise RowError(f"--extra-body has {number}, which JSON cannot send (it would go out as null)")
        return value

    try:
        extra = json.loads(text, parse_float=finite, parse_constant=finite)
    except json.JSONDecodeError as exc:
        raise RowError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise RowError("--extra-body must be a JSON object")
    check_params(extra, "--extra-body", endpoint)
    if own := sorted(OWN_OPTIONS.keys() & extra.keys()):  # sent over the option's: `jobs set` would change nothing
        what, option = OWN_OPTIONS[own[0]]
        raise RowError(f"--extra-body: {own[0]!r} cannot be set here; " + (f"give {option}" if prompts else f"the "
                       f"job's {what} is {option} (`genq jobs set {option}` changes it), and one here would hide it"))
    try:
        pack(extra)  # Redis holds the settings as msgpack, whose integers are 64-bit
    except OverflowError:
        raise RowError("--extra-body has an integer outside -2**63..2**64-1, which genq cannot store") from None
    return extra


def json_option(help: str) -> Callable[[Any], Any]:
    return click.option("--json", "as_json", is_flag=True, help=help)


yes_option = click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")


def confirmed(yes: bool, question: str, nothing: str) -> bool:
    """--yes, or the operator's answer. A no is their choice, not an error: `nothing` said, exit 0; no answer
    (stdin closed) is not a yes either: exit 1, naming --yes; Ctrl-C is an interruption (130)."""
    try:
        if yes or click.confirm(question, default=False):
            return True
    except click.Abort as exc:  # click's, for EOFError and KeyboardInterrupt alike
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt(f": {nothing}") from None
        click.echo()  # the question's line ends
        raise click.ClickException(f"no answer: {nothing} (--yes does it without asking)") from None
    click.echo(nothing)
    return False


def console() -> Console:
    """Piped output (logs, docs, tests) gets wide lines rather than wrapped cells."""
    return Console() if sys.stdout.isatty() else Console(width=200, no_color=True, highlight=False)


def table(columns: Sequence[str], rows: Iterable[Sequence[str | Text]], *, right: Collection[str] = (),
          ruled: bool = True) -> Table:
    """Every table the CLI prints, one line a row; not `ruled`: bare columns that grep and awk split on blanks.
    A str cell is text as it is, never rich markup: paths and servers' messages hold brackets."""
    shown = Table(show_edge=False, header_style="bold", box=box.HEAVY_HEAD if ruled else None, pad_edge=ruled)
    for col in columns:
        shown.add_column(col, justify="right" if col in right else "left", no_wrap=True)
    for row in rows:
        shown.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in row))
    return shown


def age(seconds: float) -> str:
    """"45s", "12m", "3h", "2d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--redis", "redis_url", envvar=ENV_VAR, default=None, metavar="URL", expose_value=False, callback=_set_redis,
    help=f"Redis URL, before or after the subcommand (env {ENV_VAR}; default redis://127.0.0.1:6379/0). "
    f"Forms: {FORMS}. Passwords are masked in all output; docs/operations.md has every form.",
)
@click.version_option(package_name="genq")
def cli() -> None:
    """genq: batch LLM generation over a fleet of SGLang, vLLM or llama.cpp (llama-server) servers, queued in Redis.

    \b
    Exit status (every command):
      0    done
      1    error: the message on stderr says what (unreachable Redis, missing input, ...)
      2    bad usage: unknown option, missing argument, value out of range
      3    partly done: some input lines or DLQ entries were skipped (each one named)
      130  interrupted (Ctrl-C)
    """


def main() -> None:
    if sys.stderr is not None:  # None: started with stderr closed
        faulthandler.enable()  # a crash in C code (SIGSEGV, SIGABRT, ...) names its place: every thread's traceback
    try:
        cli(prog_name="genq")
    except KeyboardInterrupt:  # before a subcommand runs
        sys.exit(EXIT_INTERRUPTED)
