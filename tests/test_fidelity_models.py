"""A job is for one model (#24): a worker whose server serves another takes nothing of it,
`--model auto` pins the first server's model, and a fleet serving two models runs two jobs
at once, each on its own model's servers. Real private Redis, real workers, `genq sim`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from genq.core import keys
from genq.core.queueing import load_config, rq_queue
from genq.sim.lengths import prompt_key
from tests.audit import audit
from tests.conftest import read_results, run_genq, sim_stats, wait_until

SIM = {"max_running_requests": 8, "mean_output_tokens": 20, "output_sigma": 0.5, "tokens_per_step": 4,
       "step_ms_base": 5}


def enqueue(tmp_path: Path, redis_url: str, job: str, count: int, *options: str) -> tuple[list[str], Path]:
    src = tmp_path / f"{job}.jsonl"
    ids = [f"{job}-{i:03d}" for i in range(count)]
    src.write_text("".join(json.dumps({"id": i, "messages": messages(i)}) + "\n" for i in ids))
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "5", "--max-tokens", "48",
             *options, redis_url=redis_url)
    return ids, out


def messages(prompt_id: str) -> list[dict]:
    return [{"role": "user", "content": f"what is {prompt_id}?"}]


def prompt_keys(ids: list[str]) -> list[str]:
    """The sim's key of each prompt (what its generated_by_key counts)."""
    return [prompt_key(messages(i)) for i in ids]


def served(sim, name: str, **options) -> str:
    return sim(served_model_name=name, **{**SIM, **options})


def test_a_worker_on_another_model_takes_nothing_of_a_job(redis_url, rconn, sim, worker, tmp_path):
    ids, out = enqueue(tmp_path, redis_url, "forb", 10, "--model", "model-B")
    server_a = served(sim, "model-A")
    wrong = worker(server_a, name="wrong")
    wait_until(lambda: "job forb is for model model-B" in wrong.log(), 30, "the wrong worker's word")
    time.sleep(3)  # several rounds of its loops over the queue
    assert sim_stats(server_a)["finished_requests"] == 0
    assert rq_queue(rconn).count == 2 and not rconn.hlen(keys.job_leases("forb"))
    assert not rconn.hlen(keys.batch_claims("forb", "b0000001"))
    fleet = json.loads(run_genq("workers", "--json", redis_url=redis_url).stdout)
    assert [(w["model"], w["serves"]) for w in fleet] == [("model-A", [])]

    server_b = served(sim, "model-B")
    right = worker(server_b, "--burst", name="right")
    assert right.wait(timeout=120) == 0, right.log()
    assert not audit(rconn, "forb", out, ids).letters
    assert {r["model"] for r in read_results(out, "forb")} == {"model-B"}
    assert sim_stats(server_a)["finished_requests"] == 0 and sim_stats(server_b)["finished_requests"] == 10
    assert wrong.log().count("job forb is for model model-B") == 1  # said once


def test_two_jobs_on_two_models_run_at_once_each_on_its_own_servers(redis_url, rconn, sim, worker, tmp_path):
    ids_a, out = enqueue(tmp_path, redis_url, "ja", 40, "--model", "model-A")
    ids_b, _ = enqueue(tmp_path, redis_url, "jb", 40, "--model", "model-B")
    # ja's server is slow (~10 s for its 40 prompts): a worker starting a few seconds late on a loaded
    # machine must not read as jb waiting behind ja (it did at load 12 with ~1 s for ja).
    server_a, server_b = served(sim, "model-A", step_ms_base=400), served(sim, "model-B")
    workers = [worker(server_a, "--burst", name="wa"), worker(server_b, "--burst", name="wb")]
    for w in workers:
        assert w.wait(timeout=180) == 0, w.log()
    for job, ids, model in (("ja", ids_a, "model-A"), ("jb", ids_b, "model-B")):
        assert not audit(rconn, job, out, ids).letters
        assert {r["model"] for r in read_results(out, job)} == {model}
    stats_a, stats_b = sim_stats(server_a), sim_stats(server_b)
    # Each server generated exactly its own model's job's prompts, each once.
    assert stats_a["generated_by_key"] == {key: 1 for key in prompt_keys(ids_a)}
    assert stats_b["generated_by_key"] == {key: 1 for key in prompt_keys(ids_b)}
    # Job jb's batches were queued behind all of ja's: its server began before ja's ended.
    assert stats_b["first_admit_at"] < stats_a["last_finish_at"]


def test_model_auto_is_pinned_to_the_first_server_that_takes_the_job(redis_url, rconn, sim, worker, tmp_path):
    ids, out = enqueue(tmp_path, redis_url, "au", 60)
    assert load_config(rconn, "au").model == "auto"
    server_a, server_b = (served(sim, "model-A", tokens_per_step=1, step_ms_base=50, max_running_requests=4),
                          served(sim, "model-B"))
    first = worker(server_a, "--burst", name="first")
    wait_until(lambda: load_config(rconn, "au").model == "model-A", 30, "the job pinned")
    later = worker(server_b, "--burst", name="later")
    wait_until(lambda: "job au is for model model-A" in later.log(), 30, "the later worker's word")
    assert rq_queue(rconn).count > 0  # it said so with the job's batches still queued
    assert first.wait(timeout=120) == 0, first.log()
    assert later.wait(timeout=120) == 0, later.log()
    assert not audit(rconn, "au", out, ids).letters
    assert {r["model"] for r in read_results(out, "au")} == {"model-A"}
    assert sim_stats(server_b)["finished_requests"] == 0
    assert "--model auto resolved to model-A" in first.log()
