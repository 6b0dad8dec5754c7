"""`genq worker --gpus`: one worker engine per GPU of this machine, from one command.

    fleet (this process)
      ├─ server gpu0   (optional, --launch; own session, CUDA_VISIBLE_DEVICES=0)
      ├─ genq worker --server http://127.0.0.1:30000 --gpu 0 --name HOST.gpu0 ...
      ├─ server gpu1   (port 30001)
      └─ genq worker --server http://127.0.0.1:30001 --gpu 1 --name HOST.gpu1 ...

Each engine is its own child process, so one GPU's crash does not take the others; restarts
are worker/supervisor.py's, the signal ladder (drain, stop now, kill) is Fleet._on_signal's.
GPU number i of the list gets port base_port + i (its position in the list, not its GPU index).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import signal
import socket
import string
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from genq import PYTHON
from genq.core.redisconn import ENV_VAR, mask_url
from genq.worker.supervisor import EngineSupervisor, HealthTimeouts, ServerSupervisor

log = logging.getLogger("genq.fleet")

FIELDS = ("port", "gpu")  # the only substitutions in --launch and --server-url
HAS_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
STAND_IN = "without the server installed here, `--launch \"genq sim --port {port}\"` stands in for one (docs/fleet.md)"


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
        if name is not None and (name not in FIELDS or spec or conversion):
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise FleetError(f"{option}: {shown} is not a substitution genq knows; only {{port}} and {{gpu}} "
                             f"are substituted (write a literal brace as {{{{ or }}}}), in {text!r}")


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
    return [w.format(port=port, gpu=gpu) for w in words]


def launch_problem(argv: list[str]) -> str | None:
    """Why argv cannot run on this machine, or None: a program not on PATH, or `python -m PACKAGE`
    where that python has no PACKAGE (looked up without importing it: no CUDA is touched). Said
    once, before anything starts, rather than after --max-restarts failed starts per GPU."""
    program = argv[0]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None:
        return None if os.sep in program else (f"--launch: {program!r} is not a command on this machine's PATH; "
                                               f"{STAND_IN}")
    if not os.path.basename(found).startswith("python") or len(argv) < 3 or argv[1] != "-m":
        return None
    package = argv[2].split(".")[0]
    try:
        rc = subprocess.run([found, "-c", HAS_MODULE, package], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None  # the launch itself will say what is wrong
    if rc != 3:
        return None
    return (f"--launch: {found} has no module {package!r} (`{' '.join(argv[:3])}` cannot start): install it into "
            f"that python, or name the python that has it (--launch \"/path/to/venv/bin/python -m {argv[2]} ...\"); "
            f"{STAND_IN}")


def nvml_gpu_count() -> int:
    """GPUs NVML sees (nvidia-smi numbering); raises with NVML's reason when there is none."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def parse_gpus(spec: str) -> list[int]:
    """`all` (every GPU NVML sees) or a comma-separated list of GPU indices (any, where NVML sees no driver)."""
    spec = spec.strip()
    try:
        count: int | None = nvml_gpu_count()
        why = ""
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
        count, why = None, f"{type(exc).__name__}: {exc}"
    if spec.lower() == "all":
        if count is None:
            raise FleetError(f"--gpus all: cannot list this machine's GPUs through NVML ({why}); pass an explicit "
                             "list such as --gpus 0,1")
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
    if count is not None and (missing := [g for g in gpus if g >= count]):
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
    gpu: int
    url: str
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
        url = opts.server_url.format(port=port, gpu=gpu)
        name = f"{opts.name_prefix or opts.host}.gpu{gpu}"
        argv = [*PYTHON, "-m", "genq", "worker", "--server", url, "--gpu", str(gpu), "--name", name,
                "--host", opts.host, *opts.engine_args]
        engine = EngineSupervisor(
            name=name, argv=argv,
            # The Redis URL travels in the environment, not argv: `ps` must not show a password.
            env={ENV_VAR: opts.redis_url, "PYTHONUNBUFFERED": "1"},
            log_path=opts.log_dir / f"worker-gpu{gpu}.log", pid_path=opts.log_dir / f"worker-gpu{gpu}.pid",
            max_restarts=opts.max_restarts,
        )
        server = None
        if opts.launch is not None:
            # CUDA's default order (fastest first) may differ from nvidia-smi/NVML's; make them agree.
            env = {"CUDA_VISIBLE_DEVICES": str(gpu),
                   "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
            server = ServerSupervisor(
                gpu, port, url, launch_argv(opts.launch, port=port, gpu=gpu), env,
                opts.log_dir / f"server-gpu{gpu}.log", opts.log_dir / f"server-gpu{gpu}.pid",
                opts.max_restarts, opts.health,
            )
        slots.append(Slot(gpu, url, engine, server))
    return slots


def check_ports_free(slots: list[Slot]) -> None:
    """A launched server's port must be free, or /health would be answered by a stranger."""
    for slot in slots:
        if slot.server is None:
            continue
        host, port = urlsplit(slot.url).hostname or "127.0.0.1", slot.server.port
        try:
            with socket.create_connection((host, port), timeout=0.5):
                pass
        except OSError:
            continue
        raise FleetError(f"port {port} (GPU {slot.gpu}) already accepts connections at {host}; "
                         "stop what listens there or pick another --base-port")


# ---------------------------------------------------------------- the fleet


class Fleet:
    def __init__(self, opts: FleetOptions) -> None:
        self.opts = opts
        self.slots = plan(opts)
        self.signals = 0

    async def run(self) -> int:
        if self.opts.launch is not None:
            check_ports_free(self.slots)
        o = self.opts
        o.log_dir.mkdir(parents=True, exist_ok=True)
        log.info("fleet on %s: %d GPU(s), redis %s, logs in %s", o.host, len(self.slots), mask_url(o.redis_url),
                 o.log_dir)
        for s in self.slots:
            launched = f"; launched: {' '.join(s.server.argv)}" if s.server else ""
            log.info("  gpu%d -> worker %s, server %s%s", s.gpu, s.engine.name, s.url, launched)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        results = await asyncio.gather(*(self._run_slot(s) for s in self.slots))
        failed = [s.engine.name for s, ok in zip(self.slots, results) if not ok]
        if failed:
            log.error("fleet: %d of %d worker(s) ended in failure: %s", len(failed), len(self.slots),
                      ", ".join(failed))
            return 1
        log.info("fleet: all %d worker(s) have exited", len(self.slots))
        return 0

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            log.info("%s: each worker finishes its held batches (up to its --grace-period) and exits; servers stop "
                     "after their worker. Send again to stop the workers now, a third time to kill everything.", name)
        elif self.signals == 2:
            log.info("%s again: workers stop now, handing unfinished batches back", name)
        else:
            log.info("%s a third time: killing workers and servers", name)
        for slot in self.slots:
            slot.engine.stop(self.signals)
            if self.signals >= 3 and slot.server is not None:
                slot.server.stop(self.signals)

    async def _run_slot(self, slot: Slot) -> bool:
        engine_task = asyncio.create_task(slot.engine.run())
        if slot.server is None:
            await engine_task
            return slot.engine.ok
        server_task = asyncio.create_task(slot.server.run())
        await asyncio.wait({engine_task, server_task}, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done() and not engine_task.done():
            log.error("gpu%d: its server cannot be kept running (%s); stopping worker %s (held batches go back "
                      "to the queue after its --server-down-timeout/--grace-period)", slot.gpu,
                      slot.server.failure, slot.engine.name)
            slot.engine.stop(1)
        await engine_task
        slot.server.stop()  # its worker is gone: free the GPU
        await server_task
        return slot.engine.ok and slot.server.failure is None


async def run_fleet(opts: FleetOptions) -> int:
    return await Fleet(opts).run()
