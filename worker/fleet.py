"""`genq worker --gpus`: one worker engine per GPU of this machine, from one command.

    fleet (this process)
      ├─ server gpu0   (optional, --launch; own session, CUDA_VISIBLE_DEVICES=0)
      ├─ genq worker --server http://127.0.0.1:30000 --gpu 0 --name HOST.gpu0 ...
      ├─ server gpu1   (port 30001)
      └─ genq worker --server http://127.0.0.1:30001 --gpu 1 --name HOST.gpu1 ...

Each engine is its own child process, so one GPU's crash does not take the others;
an engine that exits with an error is restarted (backoff, limit), one that exits 0
(drained, --burst, stopped) is not. GPU number i of the list gets port base_port + i
(its position in the list, not its GPU index). Ctrl-C/SIGTERM is forwarded to every
engine, which finishes its held batches (--grace-period) and exits; servers are
stopped after their engine. A second signal makes the engines stop at once; a
third kills everything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import socket
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from genq import PYTHON
from genq.core.redisconn import ENV_VAR, mask_url
from genq.core.words import plural
from genq.worker.launchcheck import launch_problem
from genq.worker.supervisor import (
    HealthTimeouts,
    RestartPolicy,
    ServerSpec,
    ServerSupervisor,
    preexec_die_with_parent,
    remove_pid_file,
    signal_group,
    sleep_unless,
)

log = logging.getLogger("genq.fleet")

FIELDS = ("port", "gpu")  # the only substitutions in --launch and --server-url


class FleetError(Exception):
    """A setting that cannot work; the message names it and says what to do."""


# ---------------------------------------------------------------- settings


def check_template(text: str, option: str) -> None:
    """Allow only {port} and {gpu}; literal braces are written {{ and }}."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise FleetError(f"{option}: {exc} in {text!r}; only {{port}} and {{gpu}} are substituted "
                         "(write a literal brace as {{ or }})") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in FIELDS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise FleetError(f"{option}: {shown} is not a substitution genq knows; only {{port}} and {{gpu}} "
                             f"are substituted (write a literal brace as {{{{ or }}}}), in {text!r}")


def expand(text: str, *, port: int, gpu: int) -> str:
    return text.format(port=port, gpu=gpu)


def launch_argv(command: str, *, port: int, gpu: int) -> list[str]:
    """Split like a POSIX shell (no shell runs it), then substitute in each word."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise FleetError(f"--launch: cannot split {command!r}: {exc}") from None
    if not words:
        raise FleetError("--launch is empty")
    for word in words:
        check_template(word, "--launch")
    return [expand(w, port=port, gpu=gpu) for w in words]


def nvml_gpu_count() -> int:
    """GPUs NVML sees (nvidia-smi numbering); raises with NVML's reason when there is none."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def parse_gpus(spec: str) -> list[int]:
    """`all` (every GPU NVML sees) or a comma-separated list of GPU indices."""
    spec = spec.strip()
    if spec.lower() == "all":
        try:
            count = nvml_gpu_count()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
            raise FleetError(f"--gpus all: cannot list this machine's GPUs through NVML "
                             f"({type(exc).__name__}: {exc}); pass an explicit list such as --gpus 0,1") from None
        if count == 0:
            raise FleetError("--gpus all: NVML sees no GPU on this machine; pass an explicit list such as --gpus 0")
        return list(range(count))
    gpus: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():
            raise FleetError(f"--gpus {spec!r}: {part!r} is not a GPU index; use 'all' or a list such as 0,1,5")
        if int(part) in gpus:
            raise FleetError(f"--gpus {spec!r}: GPU {part} is listed twice")
        gpus.append(int(part))
    try:
        count = nvml_gpu_count()
    except Exception:
        return gpus  # no driver here (CPU box, simulator): trust the list
    missing = [g for g in gpus if g >= count]
    if missing:
        raise FleetError(f"--gpus {spec!r}: NVML sees {count} GPU(s) (0-{count - 1}); no GPU {missing[0]}")
    return gpus


@dataclass
class FleetOptions:
    redis_url: str
    gpus: list[int]
    host: str
    base_port: int = 30000
    server_url: str = "http://127.0.0.1:{port}"
    launch: str | None = None
    log_dir: Path = Path("genq-logs")
    name_prefix: str | None = None  # default: the host name
    engine_args: list[str] = field(default_factory=list)  # shared `genq worker` options, forwarded
    max_restarts: int = 10
    health: HealthTimeouts = field(default_factory=HealthTimeouts)


@dataclass
class Slot:
    position: int
    gpu: int
    port: int
    url: str
    name: str
    engine: EngineSupervisor
    server: ServerSupervisor | None = None


def plan(opts: FleetOptions) -> list[Slot]:
    """One slot per GPU: its port, server URL, worker name and (optional) server command."""
    check_template(opts.server_url, "--server-url")
    if opts.launch is not None:  # fail on a bad template, or a command that cannot run here, before starting anything
        if problem := launch_problem(launch_argv(opts.launch, port=opts.base_port, gpu=opts.gpus[0] if opts.gpus else 0)):
            raise FleetError(problem)
    last = opts.base_port + len(opts.gpus) - 1
    if not 1 <= opts.base_port or last > 65535:
        raise FleetError(f"--base-port {opts.base_port} with {len(opts.gpus)} GPU(s) needs ports up to {last}")
    slots = []
    for position, gpu in enumerate(opts.gpus):
        port = opts.base_port + position
        url = expand(opts.server_url, port=port, gpu=gpu)
        name = f"{opts.name_prefix or opts.host}.gpu{gpu}"
        argv = [*PYTHON, "-m", "genq", "worker", "--server", url, "--gpu", str(gpu), "--name", name,
                "--host", opts.host, *opts.engine_args]
        engine = EngineSupervisor(
            name=name, argv=argv,
            # The Redis URL travels in the environment, not argv: `ps` must not show a password.
            env={ENV_VAR: opts.redis_url, "PYTHONUNBUFFERED": "1"},
            log_path=opts.log_dir / f"worker-gpu{gpu}.log", pid_path=opts.log_dir / f"worker-gpu{gpu}.pid",
            policy=RestartPolicy(max_restarts=opts.max_restarts),
        )
        server = None
        if opts.launch is not None:
            env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
            # CUDA's default order (fastest first) may differ from nvidia-smi/NVML's; make them agree.
            env.setdefault("CUDA_DEVICE_ORDER", os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
            server = ServerSupervisor(
                ServerSpec(gpu=gpu, port=port, argv=launch_argv(opts.launch, port=port, gpu=gpu), url=url,
                           log_path=opts.log_dir / f"server-gpu{gpu}.log",
                           pid_path=opts.log_dir / f"server-gpu{gpu}.pid", env=env),
                RestartPolicy(max_restarts=opts.max_restarts), opts.health,
            )
        slots.append(Slot(position, gpu, port, url, name, engine, server))
    return slots


def check_ports_free(slots: list[Slot]) -> None:
    """A launched server's port must be free, or /health would be answered by a stranger."""
    for slot in slots:
        if slot.server is None:
            continue
        parts = urlsplit(slot.url)
        host = parts.hostname or "127.0.0.1"
        try:
            with socket.create_connection((host, slot.port), timeout=0.5):
                pass
        except OSError:
            continue
        raise FleetError(f"port {slot.port} (GPU {slot.gpu}) already accepts connections at {host}; "
                         "stop what listens there or pick another --base-port")


# ---------------------------------------------------------------- engines


class EngineSupervisor:
    """Runs one `genq worker --server ... --gpu N` child; restarts it when it fails."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, pid_path: Path,
                 policy: RestartPolicy) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.pid_path = pid_path
        self.policy = policy
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.failure: str | None = None
        self.starts = 0
        self._stop = asyncio.Event()

    def stop(self, level: int = 1) -> None:
        """1: drain (SIGTERM); 2: stop now (a second SIGTERM); 3+: SIGKILL."""
        self.stopping = True
        self._stop.set()
        if self.proc is None or self.proc.returncode is not None:
            return
        if level >= 3:
            signal_group(self.proc.pid, signal.SIGKILL)
        else:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    async def run(self) -> int:
        """The child's last exit status (0: exited normally, not restarted)."""
        while True:
            if self.stopping:
                return 0
            started = time.monotonic()
            self.starts += 1
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True,
                # The fleet killed outright: engines still drain (SIGTERM), never run unsupervised.
                preexec_fn=preexec_die_with_parent(signal.SIGTERM), limit=1 << 20,
            )
            self.pid_path.parent.mkdir(parents=True, exist_ok=True)
            self.pid_path.write_text(f"{self.proc.pid}\n")
            log.info("worker %s: started pid %d%s", self.name, self.proc.pid,
                     f" (start #{self.starts})" if self.starts > 1 else "")
            if self.stopping:  # stop() came while it was being spawned
                self.proc.send_signal(signal.SIGTERM)
            assert self.proc.stdout is not None  # started with stdout=PIPE
            pump = asyncio.create_task(self._pump(self.proc.stdout))
            rc = await self.proc.wait()
            await pump
            remove_pid_file(self.pid_path, self.proc.pid)
            if rc == 0:
                log.info("worker %s: exited normally (drained, burst or stopped); not restarted", self.name)
                return 0
            if self.stopping:
                if rc in (-signal.SIGTERM, -signal.SIGKILL):
                    # Killed by our own signal before it installed its handlers
                    # (still waiting for its server): it held nothing.
                    log.info("worker %s: stopped (it had not started work)", self.name)
                    return 0
                log.info("worker %s: exited with status %s while stopping", self.name, rc)
                return rc
            delay = self.policy.next_delay(time.monotonic() - started)
            if delay is None:
                self.failure = f"exited with status {rc}; gave up after {plural(self.policy.max_restarts, 'restart')}"
                log.error("worker %s: %s (log: %s)", self.name, self.failure, self.log_path)
                return rc
            log.warning("worker %s: exited with status %s; restart %d/%d in %.0fs", self.name, rc,
                        self.policy.restarts, self.policy.max_restarts, delay)
            if await sleep_unless(self._stop, delay):
                return rc

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """Copy the child's output to its log file and, prefixed with its name, to our stderr."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            while True:
                try:
                    line = await stream.readline()
                except ValueError:  # a line over the limit: pass it on in pieces
                    line = await stream.read(1 << 16)
                if not line:
                    return
                logf.write(line)
                logf.flush()
                try:
                    sys.stderr.write(f"{self.name} | {line.decode(errors='replace')}")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass  # our terminal went away: the log file still has it


# ---------------------------------------------------------------- the fleet


class Fleet:
    def __init__(self, opts: FleetOptions) -> None:
        self.opts = opts
        self.slots = plan(opts)
        self.signals = 0

    async def run(self) -> int:
        if self.opts.launch is not None:
            check_ports_free(self.slots)
        self.opts.log_dir.mkdir(parents=True, exist_ok=True)
        self._announce()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        results = await asyncio.gather(*(self._run_slot(s) for s in self.slots))
        failed = [s.name for s, ok in zip(self.slots, results) if not ok]
        if failed:
            log.error("fleet: %d of %d worker(s) ended in failure: %s", len(failed), len(self.slots),
                      ", ".join(failed))
            return 1
        log.info("fleet: all %d worker(s) have exited", len(self.slots))
        return 0

    def _announce(self) -> None:
        o = self.opts
        log.info("fleet on %s: %d GPU(s), redis %s, logs in %s", o.host, len(self.slots), mask_url(o.redis_url),
                 o.log_dir)
        for s in self.slots:
            launched = f"; launched: {' '.join(s.server.spec.argv)}" if s.server else ""
            log.info("  gpu%d -> worker %s, server %s%s", s.gpu, s.name, s.url, launched)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("%s: each worker finishes its held batches (up to its --grace-period) and exits; servers stop "
                     "after their worker. Send again to stop the workers now, a third time to kill everything.",
                     signal.Signals(sig).name)
        elif self.signals == 2:
            log.info("%s again: workers stop now, handing unfinished batches back", signal.Signals(sig).name)
        else:
            log.info("%s a third time: killing workers and servers", signal.Signals(sig).name)
        for slot in self.slots:
            slot.engine.stop(self.signals)
            if self.signals >= 3 and slot.server is not None:
                slot.server.timeouts.stop = 0.1  # no more patience
                slot.server.stop()

    async def _run_slot(self, slot: Slot) -> bool:
        engine_task = asyncio.create_task(slot.engine.run())
        if slot.server is None:
            rc = await engine_task
            return rc == 0 and slot.engine.failure is None
        server_task = asyncio.create_task(slot.server.run())
        await asyncio.wait({engine_task, server_task}, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done() and not engine_task.done():
            log.error("gpu%d: its server cannot be kept running (%s); stopping worker %s (held batches go back "
                      "to the queue after its --server-down-timeout/--grace-period)", slot.gpu,
                      slot.server.failure, slot.name)
            slot.engine.stop(1)
        rc = await engine_task
        slot.server.stop()  # its worker is gone: free the GPU
        await server_task
        return rc == 0 and slot.engine.failure is None and slot.server.failure is None


async def run_fleet(opts: FleetOptions) -> int:
    return await Fleet(opts).run()
