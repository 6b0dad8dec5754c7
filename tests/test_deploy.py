"""Deploying as fleets deploy: the Dockerfile's image and compose.yaml's services, without Docker.

The image is the Dockerfile's COPY layout with a non-editable `pip install .` in it; a genq process
started from the folder that holds those sources must still load the installed package (whose
genq/ has worker/, producer/ and monitor/ mapped in), never the sources' genq/, which has not.
compose.yaml's services are run as processes with their own commands, the container names mapped
to loopback ports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest
import yaml

from genq.core.redisconn import free_port
from tests.conftest import ROOT, read_results, wait_http, wait_until, write_prompts

# One process runs both tests (make test: --dist loadgroup), so the image is built once.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("deploy-image")]


def copied_layout(dest: Path) -> Path:
    """The Dockerfile's COPY lines, carried out into dest (its WORKDIR); the WORKDIR is returned."""
    workdir = dest
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words or words[0] not in ("WORKDIR", "COPY"):
            continue
        if words[0] == "WORKDIR":
            workdir = dest / words[1].lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
            continue
        *sources, target = [w for w in words[1:] if not w.startswith("--")]
        to = workdir / target
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                to.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, to / src.name)
    return workdir


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> tuple[Path, Path]:
    """(the sources' folder, the genq command) of a non-editable install of the image's layout.

    The venv borrows the test venv's dependencies through a .pth line (a plain path: the editable
    install's import hook beside them is not run), so only genq itself is installed."""
    root = tmp_path_factory.mktemp("image")
    src = copied_layout(root / "fs")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", str(src)], check=True, cwd=src)
    return src, venv / "bin" / "genq"


def test_the_images_layout_runs_the_demo_from_the_folder_holding_the_sources(image, tmp_path):
    src, genq = image
    out = tmp_path / "out"
    proc = subprocess.run([str(genq), "demo", "--num-gpus", "2", "--prompts", "60", "--mean-output-tokens", "20",
                           "--speed", "20", "--output", str(out)],
                          cwd=src, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "60 results for 60 prompts" in proc.stdout
    assert "No module named" not in proc.stdout + proc.stderr
    for log in (out / "logs").glob("*.log"):
        assert "No module named" not in log.read_text(errors="replace"), log


def test_compose_services_run_a_job_as_processes(image, redis_url, tmp_path, procs):
    """Each service of compose.yaml but Redis, started with its own command from the image's
    layout: the enqueue in compose.yaml's header comment is written whole by its workers."""
    src, genq = image
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    data = tmp_path / "data"
    data.mkdir()
    ports = {name: free_port() for name in compose["services"] if name.startswith("sim-")}
    metrics_port = free_port()

    def on_this_host(word: str, service: str) -> str:
        for name, port in ports.items():
            word = word.replace(f"http://{name}:30000", f"http://127.0.0.1:{port}")
        if word == "30000" and service in ports:
            return str(ports[service])
        return (word.replace("0.0.0.0", "127.0.0.1").replace(":9108", f"127.0.0.1:{metrics_port}")
                .replace("/data/", f"{data}/"))

    env = {"GENQ_REDIS_URL": redis_url}
    started = {name: procs([str(genq), *(on_this_host(str(w), name) for w in service["command"])], name=name,
                           env=env, cwd=src)
               for name, service in compose["services"].items()
               if name != "redis" and "cli" not in service.get("profiles", [])}
    for port in ports.values():
        wait_http(f"http://127.0.0.1:{port}/v1/models", want=None, timeout=30)
    write_prompts(data / "prompts.jsonl", 40)
    enqueue = subprocess.run([str(genq), "enqueue", str(data / "prompts.jsonl"), "--job", "demo", "--output",
                              str(data / "out"), "--max-tokens", "32"],
                             cwd=src, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert enqueue.returncode == 0, enqueue.stderr

    def written() -> bool:
        for name, service in started.items():
            assert service.alive(), f"{name} exited: {service.log()[-2000:]}"
        return len(read_results(data / "out", "demo")) == 40

    wait_until(written, timeout=120, what="the job written by compose's workers")
    assert sorted(r["id"] for r in read_results(data / "out", "demo")) == sorted(f"p{i:05d}" for i in range(40))
    progress = data / "progress.json"
    wait_until(lambda: progress.exists() and "demo" in progress.read_text(), timeout=30,
               what="the monitor's progress file naming the job")
    json.loads(progress.read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        assert b"genq_" in resp.read()
    for name, service in started.items():  # stopped as compose stops them (SIGTERM), then their logs read
        service.stop()
        text = service.log()
        assert "No module named" not in text, f"{name}: {text[-2000:]}"
        assert "Traceback" not in text, f"{name}: {text[-2000:]}"


def test_python_m_genq_from_the_folder_holding_the_sources_runs_the_installed_genq(image):
    # `docker run --entrypoint python IMAGE -m genq ...` starts in /app, whose genq/ shadows the installed one.
    src, genq = image
    proc = subprocess.run([str(genq.parent / "python"), "-m", "genq", "worker", "--help"],
                          cwd=src, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and "--gpus" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
