"""`genq worker --gpus`: one engine per GPU, supervised servers, restarts, joining machines.

Real processes throughout: the fleet launches real `genq sim` servers (the venv's
`genq` script, as an operator would launch SGLang), real engines, real Redis. There
GPU indices pick CUDA_VISIBLE_DEVICES, ports and names. Where NVML sees no GPU (no driver)
any index is accepted and telemetry says "no GPU"; where it sees GPUs (a GPU host), the
tests use real indices and expect real figures (nvml_count() decides; nothing is faked).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from genq.core import keys  # noqa: E402
from genq.core.records import Control, pack  # noqa: E402
from genq.core.redisconn import connect  # noqa: E402
from genq.ops import control  # noqa: E402
from tests.conftest import (
    REDIS_URL,
    free_port,
    genq_cmd,
    nvml_count,
    nvml_gpu,
    read_results,
    run_genq,
    wait_until,
    write_prompts,
)

GENQ = Path(sys.executable).parent / "genq"  # the venv's console script
SIM_ARGS = "--max-running-requests 4 --step-ms-base 25 --step-ms-per-req 0 --tokens-per-step 8 " \
           "--mean-output-tokens 48 --output-sigma 0.3"


def launch(extra: str = SIM_ARGS) -> str:
    assert GENQ.exists(), f"{GENQ} is missing: install the package into the venv (pip install -e .)"
    return f"{GENQ} sim --port {{port}} {extra}"


def free_ports(n: int) -> int:
    """A base port with n free ports after it (checked, not guaranteed; retried by the caller)."""
    import socket

    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports")





def fleet_now() -> dict[str, control.WorkerRow]:
    conn = connect(REDIS_URL)
    try:
        return {r.name: r for r in control.fleet(conn)}
    finally:
        conn.close()


def job_now(job: str) -> control.JobRow:
    conn = connect(REDIS_URL)
    try:
        return control.job_rows(conn, [job])[0]
    finally:
        conn.close()


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def enqueue(tmp_path: Path, job: str, n: int, batch_size: int = 10) -> list[str]:
    ids = write_prompts(tmp_path / f"{job}.jsonl", n)
    run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"),
             "--batch-size", str(batch_size), "--max-tokens", "64")
    return ids


def start_fleet(procs, *args: str, name: str = "fleet"):
    return procs(genq_cmd("worker", *args), name=name)


def test_fleet_runs_one_worker_per_gpu_and_restarts_a_killed_server(tmp_path, redis_url, procs):
    count = nvml_count()
    if count is not None and count < 2:
        # A GPU host with one GPU: two workers cannot honestly be started; the fleet must say why.
        out = run_genq("worker", "--gpus", "0,1", "--launch", launch(), check=False, timeout=30)
        assert out.returncode == 1 and f"NVML sees {count} GPU(s)" in out.stderr, out.stderr
        assert f"no GPU {count}" in out.stderr, out.stderr  # the first index it lacks
        return
    base = free_ports(2)
    logs = tmp_path / "logs"
    fleet = start_fleet(procs, "--gpus", "0,1", "--base-port", str(base), "--host", "head", "--log-dir", str(logs),
                        "--launch", launch(), "--health-interval", "0.5")
    urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]

    # Both servers and both workers come up; the fleet view shows them with their GPU.
    wait_until(lambda: all(health(u) == 200 for u in urls), what="both servers healthy")
    view = wait_until(lambda: (v := fleet_now()) and all(
        v.get(n) and v[n].state == "idle" for n in ("head.gpu0", "head.gpu1")) and v, what="both workers idle")
    rows = {w["name"]: w for w in json.loads(run_genq("workers", "--json").stdout)}
    assert set(rows) == {"head.gpu0", "head.gpu1"}
    assert [(rows[n]["gpu"], rows[n]["host"], rows[n]["server"]) for n in sorted(rows)] == [
        ("0", "head", urls[0]), ("1", "head", urls[1])]
    assert view["head.gpu0"].pid != view["head.gpu1"].pid  # one process per GPU

    ids = enqueue(tmp_path, "fl", 300)
    wait_until(lambda: job_now("fl").done >= 30, what="30 prompts done")

    # Kill GPU 0's server outright: the fleet restarts it and its prompts still finish.
    old = read_pid(logs / "server-gpu0.pid")
    other = read_pid(logs / "server-gpu1.pid")
    assert old and other
    os.kill(old, signal.SIGKILL)
    new = wait_until(lambda: (p := read_pid(logs / "server-gpu0.pid")) and p != old and p, timeout=20,
                     what="a new server pid for GPU 0")
    wait_until(lambda: health(urls[0]) == 200, timeout=20, what="GPU 0's server healthy again")
    assert job_now("fl").done < 300, "the job ended before the server was killed"
    assert read_pid(logs / "server-gpu1.pid") == other  # the other GPU was not touched

    wait_until(lambda: job_now("fl").state == "done", timeout=90, what="the job to complete")
    results = read_results(tmp_path / "out", "fl")
    got = [r["id"] for r in results]
    assert len(got) == len(set(got)) and sorted(got) == ids
    assert {r["worker"] for r in results} == {"head.gpu0", "head.gpu1"}
    # Work was done by the restarted server too (it answered after the restart).
    stats = json.load(urllib.request.urlopen(urls[0] + "/sim/stats", timeout=5))
    assert stats["finished_requests"] > 0
    server_log = (logs / "server-gpu0.log").read_text()
    assert "start #1 " in server_log and "start #2 " in server_log
    assert "exited with status -9; restart 1/10" in fleet.log()

    # Drain everything: engines exit 0, the fleet stops the servers and exits 0.
    out = run_genq("drain", "--host", "head", "--wait", "--timeout", "60")
    assert "all drained: head.gpu0 stopped, head.gpu1 stopped" in out.stdout
    assert fleet.wait(timeout=40) == 0, fleet.log()
    assert not pid_alive(new) and not pid_alive(other)
    assert "not restarted" in fleet.log()


def test_server_that_stops_answering_health_is_restarted(tmp_path, redis_url, procs):
    count = nvml_count()
    if count == 0:  # a driver but no GPU: NVML refuses every index, so no fleet can start here
        out = run_genq("worker", "--gpus", "0", "--launch", launch(), check=False, timeout=30)
        assert out.returncode == 1 and "NVML sees 0 GPU(s)" in out.stderr, out.stderr
        return
    gpu = 3 if count is None else count - 1  # a real index on a GPU host
    base = free_ports(1)
    logs = tmp_path / "logs"
    fleet = start_fleet(procs, "--gpus", str(gpu), "--base-port", str(base), "--log-dir", str(logs), "--host", "h",
                        "--launch", launch("--step-ms-base 1"), "--health-interval", "0.2",
                        "--server-health-timeout", "1")
    url = f"http://127.0.0.1:{base}"
    # The supervisor must have seen it healthy: a server that never was is still "starting"
    # (model loading) and gets --server-start-timeout, not --server-health-timeout.
    wait_until(lambda: "healthy after" in fleet.log(), what="the fleet to see the server healthy")
    old = wait_until(lambda: read_pid(logs / f"server-gpu{gpu}.pid"), what="its pid file")
    # The process stays up but /health answers 503 (a wedged server).
    req = urllib.request.Request(url + "/sim/faults", data=json.dumps({"outage_for": 120}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).close()
    assert health(url) == 503
    new = wait_until(lambda: (p := read_pid(logs / f"server-gpu{gpu}.pid")) and p != old and p, timeout=20,
                     what="the wedged server to be replaced")
    wait_until(lambda: health(url) == 200, timeout=20, what="the new server healthy")
    assert not pid_alive(old)
    assert "/health failing for" in fleet.log()
    # CUDA_VISIBLE_DEVICES names the GPU for the launched server.
    with open(f"/proc/{new}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert env[b"CUDA_VISIBLE_DEVICES"] == str(gpu).encode()
    fleet.signal(signal.SIGTERM)
    assert fleet.wait(timeout=40) == 0, fleet.log()
    assert not pid_alive(new)


def test_crashed_engine_is_restarted_and_external_servers_work(tmp_path, redis_url, procs, sim):
    # Without --launch the fleet drives servers someone else runs, at --server-url.
    port = free_port()
    url = sim(port=port, step_ms_base=1)
    logs = tmp_path / "logs"
    fleet = start_fleet(procs, "--gpus", "0", "--server-url", "http://127.0.0.1:{port}", "--base-port", str(port),
                        "--log-dir", str(logs), "--name", "box", "--concurrency", "5")
    wait_until(lambda: (w := fleet_now().get("box.gpu0")) and w.state == "idle", what="worker box.gpu0 idle")
    first = read_pid(logs / "worker-gpu0.pid")
    assert fleet_now()["box.gpu0"].pid == first and fleet_now()["box.gpu0"].server == url
    assert fleet_now()["box.gpu0"].cap == 5  # shared options reach each GPU's worker

    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: (p := read_pid(logs / "worker-gpu0.pid")) and p != first and p, timeout=20,
                        what="the worker restarted")
    wait_until(lambda: (w := fleet_now().get("box.gpu0")) and w.pid == second and w.state == "idle", timeout=30,
               what="the restarted worker to heartbeat")
    assert "exited with status -9; restart 1/10" in fleet.log()

    ids = enqueue(tmp_path, "after", 30)
    wait_until(lambda: job_now("after").state == "done", timeout=60, what="the job to complete")
    assert sorted(r["id"] for r in read_results(tmp_path / "out", "after")) == ids

    fleet.signal(signal.SIGINT)  # Ctrl-C: forwarded, the worker drains and exits 0
    assert fleet.wait(timeout=40) == 0, fleet.log()
    assert fleet_now()["box.gpu0"].state == "stopped"


def test_second_machine_joins_mid_job(tmp_path, redis_url, procs):
    base_a = free_ports(1)
    head = start_fleet(procs, "--gpus", "0", "--base-port", str(base_a), "--host", "head-host",
                       "--log-dir", str(tmp_path / "logs-a"), "--launch", launch(), name="head")
    ids = enqueue(tmp_path, "grow", 300)
    wait_until(lambda: job_now("grow").done >= 20, timeout=40, what="the head to make progress")

    # Another machine: the same command against the same Redis, nothing else configured.
    base_b = free_ports(1)
    joined = start_fleet(procs, "--gpus", "0", "--base-port", str(base_b), "--host", "other-host",
                         "--log-dir", str(tmp_path / "logs-b"), "--launch", launch(), name="other")
    wait_until(lambda: (w := fleet_now().get("other-host.gpu0")) and w.state in ("busy", "idle"), timeout=30,
               what="the new machine's worker in the fleet view")
    assert job_now("grow").done < 300, "the job ended before the second machine joined"

    wait_until(lambda: job_now("grow").state == "done", timeout=90, what="the job to complete")
    results = read_results(tmp_path / "out", "grow")
    got = [r["id"] for r in results]
    assert len(got) == len(set(got)) and sorted(got) == ids
    by = {}
    for r in results:
        by[r["worker"]] = by.get(r["worker"], 0) + 1
    assert set(by) == {"head-host.gpu0", "other-host.gpu0"}, by

    run_genq("drain", "--all")
    assert head.wait(timeout=40) == 0, head.log()
    assert joined.wait(timeout=40) == 0, joined.log()


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0,0"], "GPU 0 is listed twice"),
    (["--gpus", "0,x"], "'x' is not a GPU index"),
    (["--gpus", "0", "--launch", "genq sim --port {port} --model {model}"],
     "{model} is not a substitution genq knows; only {port} and {gpu}"),
    (["--gpus", "0", "--launch", "x --json '{\"a\": 1}'"], "write a literal brace as {{ or }}"),
    (["--gpus", "0", "--server-url", "http://{host}:{port}"], "--server-url: {host} is not a substitution"),
    (["--gpus", "0", "--server", "http://127.0.0.1:1"], "give either --server URL"),
    ([], "give either --server URL"),
    (["--server", "http://127.0.0.1:1", "--launch", "x"], "--launch only work(s) with --gpus"),
    (["--gpus", "0", "--gpu", "1"], "--gpu is for --server"),
])
def test_bad_fleet_settings_are_refused(args, message, redis_url):
    out = run_genq("worker", *args, check=False, timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr  # bad usage, before anything starts


def test_gpus_all_is_every_gpu_nvml_sees_or_says_to_list_them(tmp_path, redis_url, procs):
    count = nvml_count()
    if not count:
        out = run_genq("worker", "--gpus", "all", check=False, timeout=30)
        assert out.returncode == 1
        if count is None:
            assert "--gpus all: cannot list this machine's GPUs through NVML" in out.stderr, out.stderr
            assert "pass an explicit list such as --gpus 0,1" in out.stderr
        else:
            assert "--gpus all: NVML sees no GPU on this machine" in out.stderr, out.stderr
        return
    # A GPU host: one worker per GPU NVML sees, each with its index.
    base = free_ports(count)
    fleet = start_fleet(procs, "--gpus", "all", "--base-port", str(base), "--host", "allhost",
                        "--log-dir", str(tmp_path / "logs"), "--launch", launch())
    names = {f"allhost.gpu{i}" for i in range(count)}
    view = wait_until(lambda: (v := fleet_now()) and names <= {n for n, w in v.items() if w.state == "idle"} and v,
                      timeout=60, what=f"{count} workers idle")
    assert {n for n in view if n.startswith("allhost.")} == names
    assert sorted(view[n].gpu for n in names) == sorted(str(i) for i in range(count))
    fleet.signal(signal.SIGTERM)
    assert fleet.wait(timeout=40) == 0, fleet.log()


def test_gpu_telemetry_is_real_figures_or_says_there_is_no_gpu(tmp_path, redis_url, rconn, procs, sim):
    """A worker on GPU 0 reports NVML's own figures for it, or, with no driver, says there is none."""
    from genq.core import keys
    from genq.core.records import WorkerStatus, unpack

    url = sim(step_ms_base=1)
    procs(genq_cmd("worker", "--server", url, "--gpu", "0", "--name", "tele"), name="tele")

    def status() -> WorkerStatus | None:
        raw = rconn.get(keys.worker_status("tele"))
        return unpack(raw, WorkerStatus) if raw else None

    count = nvml_count()
    if count:
        # Samples are taken every few heartbeats: wait for the first one.
        s = wait_until(lambda: (s := status()) and (s.gpu_sample or s.gpu_note) and s, 30,
                       "a GPU sample from NVML (or a note saying why there is none)")
        assert s.gpu_note is None and s.gpu_sample is not None, s.gpu_note
        gpu = nvml_gpu(0)
        sample = s.gpu_sample
        assert (sample.index, sample.name, sample.memory_total_mib) == (0, gpu.name, gpu.memory_total_mib)
        assert 0 < sample.memory_used_mib <= gpu.memory_total_mib
        assert 0 <= sample.utilization_pct <= 100
        # Optional figures (absent on some boards), plausible where present.
        assert sample.power_w is None or 0 < sample.power_w <= gpu.power_limit_w * 1.5
        assert sample.temperature_c is None or 0 < sample.temperature_c < 120
        assert sample.sm_clock_mhz is None or 0 <= sample.sm_clock_mhz <= gpu.max_sm_clock_mhz
        shown = {w["name"]: w for w in json.loads(run_genq("workers", "--json").stdout)}["tele"]
        assert shown["gpu"] == "0"
    else:
        s = wait_until(lambda: (s := status()) and s.state == "idle" and s, 30, "the worker idle")
        assert s.gpu_sample is None
        assert s.gpu_note and s.gpu_note.startswith("no GPU"), s.gpu_note
        if count is None:
            assert s.gpu_note.startswith("no GPU telemetry: NVML"), s.gpu_note  # NVML's own reason, named
        # The monitor passes the note on instead of showing empty GPU figures.
        src = tmp_path / "p.jsonl"
        write_prompts(src, 3)
        run_genq("enqueue", str(src), "--job", "tele", "--output", str(tmp_path / "out"))
        report = wait_until(
            lambda: (r := json.loads(run_genq("monitor", "--job", "tele", "--once", "--json").stdout))
            and r["status"] == "done" and r, 60, "the job done")
        assert report["gpu_note"] == f"no GPU figures from any worker: {s.gpu_note}"
        (detail,) = [w for w in report["worker_details"] if w["name"] == "tele"]
        assert detail["gpu"] is None and detail["gpu_note"] == s.gpu_note


def test_busy_port_and_missing_program_are_reported(tmp_path, redis_url, procs, sim):
    port = free_port()
    sim(port=port)
    out = run_genq("worker", "--gpus", "0", "--base-port", str(port), "--launch", launch(),
                   "--log-dir", str(tmp_path / "l1"), check=False, timeout=30)
    assert out.returncode == 1 and f"port {port} (GPU 0) already accepts connections" in out.stderr

    out = run_genq("worker", "--gpus", "0", "--base-port", str(free_ports(1)), "--log-dir", str(tmp_path / "l2"),
                   "--launch", "/nonexistent/sglang --port {port}", check=False, timeout=30)
    assert out.returncode == 1
    assert "cannot run '/nonexistent/sglang'" in out.stderr



def test_the_same_name_started_twice_is_refused_while_the_first_is_idle(redis_url, sim, worker):
    """An idle worker beats every 20 s, not every second: the second one under its name must still see
    it alive (it asks for a beat now) instead of taking the name and the first one's status."""
    from genq.worker.heartbeat import IDLE_AFTER_S

    url = sim()
    first = worker(url, "--name", "twice", name="first")

    def state() -> str | None:
        rows = json.loads(run_genq("workers", "--json", redis_url=redis_url).stdout)
        return next((r["state"] for r in rows if r["name"] == "twice"), None)

    wait_until(lambda: state() == "idle", timeout=60, what="the first worker idle")
    time.sleep(IDLE_AFTER_S + 3)  # now at the idle pace: its next beat is up to 20 s away
    second = worker(url, "--name", "twice", name="second")
    assert second.wait(timeout=60) != 0 and "a worker named twice is already running" in second.log(), second.log()
    assert first.alive(), first.log()


def test_a_worker_that_dies_while_draining_is_not_restarted_by_its_fleet(tmp_path, redis_url, rconn, procs, sim):
    """The drain asked this GPU's worker to go; the fleet does not start another in its place (a worker
    started by hand under the name is another life: it does not drain, docs/operations.md)."""
    port = free_port()
    sim(port=port, step_ms_base=1)
    logs = tmp_path / "logs"
    fleet = start_fleet(procs, "--gpus", "0", "--server-url", "http://127.0.0.1:{port}", "--base-port", str(port),
                        "--log-dir", str(logs), "--name", "dr")
    wait_until(lambda: (w := fleet_now().get("dr.gpu0")) and w.state == "idle", what="worker dr.gpu0 idle")
    first = read_pid(logs / "worker-gpu0.pid")
    os.kill(first, signal.SIGSTOP)  # frozen, so the drain is asked of it and it dies before acting on it
    rconn.set(keys.worker_control("dr.gpu0"), pack(Control(drain=True)))
    os.kill(first, signal.SIGKILL)
    fleet.wait(timeout=60)
    assert "while draining; not restarted" in fleet.log() and "restart 1/" not in fleet.log(), fleet.log()
