"""No pickle on any path genq controls: jobs queued by genq 0.1 (pickled) are neither run nor
unpickled, and their batches still complete; `genq dlq list` never unpickles what Redis holds."""

from __future__ import annotations

from pathlib import Path

from rq import Queue

from genq.core import keys
from genq.core.queueing import rq_queue
from tests.conftest import read_results, run_genq, write_prompts


class _Bomb:
    """Unpickling this writes a file: proof that something unpickled data from Redis."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "unpickled"))


def test_jobs_pickled_by_genq_0_1_are_dropped_unread_and_their_batches_complete(redis_url, rconn, sim, worker,
                                                                                tmp_path):
    server = sim(max_running_requests=8, mean_output_tokens=60, step_ms_base=2)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 20)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "old", "--output", str(out), "--batch-size", "10")
    # What genq 0.1 left in Redis: pickled RQ jobs naming the old function, no transport record.
    rq_queue(rconn).empty()
    rconn.delete(keys.job_transport("old"))
    proof = tmp_path / "unpickled.txt"
    legacy = Queue(keys.QUEUE, connection=rconn)  # RQ's default serializer: pickle
    for batch in ("b0000001", "b0000002"):
        legacy.enqueue("worker.rqjob.run_batch", "old", batch, _Bomb(str(proof)))
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    assert "dropped 2 RQ jobs that were not JSON" in proc.log()
    assert not proof.exists(), "a worker unpickled a job from Redis"
    assert sorted(r["id"] for r in read_results(out, "old")) == ids


def test_dlq_list_does_not_unpickle_failed_jobs(redis_url, rconn, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 3)
    run_genq("enqueue", str(src), "--job", "fj", "--output", str(tmp_path / "out"))
    proof = tmp_path / "unpickled.txt"
    legacy = Queue(keys.QUEUE, connection=rconn)
    job = legacy.enqueue("worker.rqjob.run_batch", "fj", "b0000001", _Bomb(str(proof)))
    legacy.remove(job)
    legacy.failed_job_registry.add(job, ttl=600)
    listed = run_genq("dlq", "list", "--json")
    assert not proof.exists(), "genq dlq list unpickled a job from Redis"
    assert listed.returncode == 0
