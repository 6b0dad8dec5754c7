"""More than one worker per server (issue #29): when one worker process cannot keep a very fast
server's slots full, run N of them against it, each with `--concurrency` its share of the slots
and a name of its own (docs/sizing.md). Real Redis, real `genq sim`, real workers."""

from __future__ import annotations

from tests.audit import audit
from tests.conftest import run_genq, sim_stats, write_prompts

FAST = dict(mean_output_tokens=40, output_sigma=0.5, tokens_per_step=8, step_ms_base=5)


def test_two_workers_share_one_server_exactly_once_within_its_slots(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, **FAST)
    src = tmp_path / "prompts.jsonl"
    ids = write_prompts(src, 240)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "shared", "--batch-size", "30", "--max-tokens", "100",
             "--output", str(out), redis_url=redis_url)
    workers = [worker(server, "--burst", "--concurrency", "4", "--name", f"share{i}", name=f"share{i}")
               for i in range(2)]
    for proc in workers:
        assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, "shared", out, ids)
    by_worker = {r["worker"] for r in found.results.values()}
    assert by_worker == {"share0", "share1"}, f"results came from {by_worker}: both workers should share the server"
    stats = sim_stats(server)
    assert stats["finished_requests"] == 240
    # Each worker's share of the slots (4 + 4 = the server's 8): never more on the server than it runs
    # (running + waiting <= 8 at every moment; each worker on auto would aim at 8 and more by itself),
    # and more than one worker's share running.
    assert stats["busy_mean_running"] + stats["busy_mean_waiting"] <= 8.0, stats
    assert stats["busy_mean_running"] > 4, f"the two workers together kept no more than one's share running: {stats}"
