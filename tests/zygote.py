"""`python -m genq ...` for the tests, forked from one interpreter that has imported genq already.

A genq process spends 0.4-0.9 s of CPU importing (aiohttp, redis, rq, msgspec) before it does
anything, and the suite starts about a thousand of them (2026-12-06, on two cores). A zygote imports genq once;
each command is a fork of it that runs `genq` exactly as `python -m genq` would (runpy, the same
argv, environment, working directory, umask and files 0-2, a new session if asked, the interpreter's own
exit), so the test sees a real process: a pid to signal, a log, an exit code. GENQ_TEST_FORK=0
starts every command as a fresh interpreter instead.

The zygote (this file run as a script) is single-threaded: it reads one request per line on
stdin, forks, answers "started ID PID", and "exited ID CODE" when the child ends (pidfds: no
polling). It dies with the test process (stdin closed).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

ENABLED = os.environ.get("GENQ_TEST_FORK", "1") != "0"


def is_genq(args: list[str]) -> bool:
    return args[:3] == [sys.executable, "-m", "genq"]


def wanted(args: list[str]) -> bool:
    """Whether the tests fork this command from the zygote."""
    return ENABLED and is_genq(args)


# ---------------------------------------------------------------- the zygote (run as a script)

def _serve() -> None:
    import importlib
    import pkgutil

    import genq

    for module in pkgutil.walk_packages(genq.__path__, "genq."):  # every module a command may import
        if module.name != "genq.__main__":
            try:
                importlib.import_module(module.name)
            except Exception:  # noqa: BLE001  (the child imports it again and says why)
                pass

    requests = sys.stdin.buffer
    waiting: dict[int, tuple[str, int]] = {}  # pidfd -> (request id, pid)
    pending = b""
    while True:
        readable, _, _ = select.select([requests.fileno(), *waiting], [], [])
        for fd in readable:
            if fd in waiting:
                rid, pid = waiting.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _say(f"exited {rid} {os.waitstatus_to_exitcode(status)}")
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # the test process is gone: so are we
                for _rid, pid in waiting.values():
                    _kill(pid)
                    os.waitpid(pid, 0)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request)  # does not return
                waiting[os.pidfd_open(pid)] = (request["id"], pid)
                _say(f"started {request['id']} {pid}")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become(request: dict) -> None:
    """In the child: become `python -m genq ARGS` and exit as that interpreter would."""
    try:
        if request["session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)  # a fresh interpreter holds nothing else open
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["genq", *request["argv"]]
    except BaseException as exc:  # noqa: BLE001  (say why, and exit as a failed exec would)
        os.write(2, f"zygote: {exc!r}\n".encode())
        os._exit(127)
    import runpy

    # Its SystemExit (or exception) leaves through _serve and ends this child as the interpreter
    # ends: threads joined, atexit run, files flushed.
    runpy.run_module("genq", run_name="__main__", alter_sys=True)


# ---------------------------------------------------------------- the tests' side

class _Zygote:
    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-u", __file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
        self.lock = threading.Lock()
        self.next_id = 0
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.changed = threading.Condition()
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="zygote").start()
        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (and whatever it still runs) and reap it."""
        self.popen.stdin.close()
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def _read(self) -> None:
        for line in self.popen.stdout:
            what, rid, value = line.decode().split()
            with self.changed:
                (self.pids if what == "started" else self.codes)[rid] = int(value)
                self.changed.notify_all()
        with self.changed:  # the zygote died: nothing will be reported again
            self.dead = True
            self.changed.notify_all()

    def start(self, argv: list[str], *, cwd: str, env: dict, stdout: str, stderr: str | None,
              session: bool) -> str:
        with self.lock:
            self.next_id += 1
            rid = str(self.next_id)
            umask = os.umask(0o022)  # read it: the only way is to set it
            os.umask(umask)
            request = {"id": rid, "argv": argv, "cwd": str(cwd), "env": env, "stdout": stdout,
                       "stderr": stderr, "session": session, "umask": umask}
            self.popen.stdin.write(json.dumps(request).encode() + b"\n")
            self.popen.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: rid in self.pids or self.dead, timeout=60):
                raise RuntimeError("the test zygote did not fork within 60 s")
            if self.dead:
                raise RuntimeError("the test zygote died")
            return rid

    def wait(self, rid: str, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: rid in self.codes or self.dead, timeout=timeout)
            return self.codes.get(rid)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.popen.poll() is not None:
            _zygote = _Zygote()
        return _zygote


class Forked:
    """The part of subprocess.Popen the tests use, for a command forked from the zygote."""

    def __init__(self, args: list[str], *, cwd, env: dict, stdout: str, stderr: str | None = None,
                 session: bool = False) -> None:
        assert is_genq(args), args
        self.args = args
        self.zygote = _the_zygote()
        self.rid = self.zygote.start(args[3:], cwd=cwd, env=env, stdout=stdout, stderr=stderr, session=session)
        self.pid = self.zygote.pids[self.rid]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.rid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.rid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended and reaped by the zygote; its exit is on its way here
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(args: list[str], *, cwd, timeout: float | None, env: dict | None = None,
        fork: bool | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True, ...) for a genq command; forked from
    the zygote when `fork`, or by default when `wanted(args)`."""
    import tempfile

    if not (wanted(args) if fork is None else fork):
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)

    with tempfile.TemporaryDirectory(prefix="genq-run-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = Forked(args, cwd=cwd, env=dict(os.environ if env is None else env), stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(args, proc.returncode, _text(out), _text(err))


def _text(path: str) -> str:
    """A file's bytes as text=True would give them (locale encoding, universal newlines)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return ""
    return io.TextIOWrapper(io.BytesIO(data)).read()


if __name__ == "__main__":
    _serve()
