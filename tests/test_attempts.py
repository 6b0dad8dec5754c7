"""`attempts` in a record counts every try, tries lost with a killed worker too (#28).

A worker killed with SIGKILL mid-run leaves its claims (worker/held.py) in Redis: the prompts it
was sending, and at most CLAIM_AHEAD it was about to send. The engine that takes such a prompt
over counts that claim as a lost try, so its record says attempts >= 2; every other prompt says 1.
"""

from __future__ import annotations

from tests.audit import audit
from tests.conftest import run_genq, sim_stats, wait_until, write_prompts

SLOW = dict(mean_output_tokens=600, output_sigma=0.5, tokens_per_step=8, step_ms_base=20)


def test_tries_lost_with_a_killed_worker_are_counted(redis_url, rconn, sim, worker, tmp_path):
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 24)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "kill", "--output", str(out), "--batch-size", "8", "--max-tokens", "2000")
    doomed_server = sim(max_running_requests=4, **SLOW)
    doomed = worker(doomed_server, "--name", "doomed", name="doomed")
    wait_until(lambda: sim_stats(doomed_server)["finished_requests"] >= 2 and rconn.keys("genq:job:kill:claims:*"),
               90, "the doomed worker mid-run")
    doomed.kill_tree()
    claims: dict[str, str] = {}
    for key in rconn.keys("genq:job:kill:claims:*"):
        claims.update({k.decode(): v.decode() for k, v in rconn.hgetall(key).items()})
    in_flight = {i for i, claim in claims.items() if claim.startswith("doomed")}
    assert in_flight, f"no prompt in flight at the kill: {claims}"

    survivor = worker(sim(max_running_requests=8, **SLOW), "--name", "survivor", "--burst", name="survivor")
    assert survivor.wait(timeout=240) == 0, survivor.log()
    found = audit(rconn, "kill", out, ids)
    attempts = {i: r["attempts"] for i, r in found.results.items()}
    lost = {i: attempts[i] for i in in_flight}
    assert all(n >= 2 for n in lost.values()), f"prompts in flight at the kill: {lost}"
    others = {i: n for i, n in attempts.items() if i not in in_flight}
    assert set(others.values()) == {1}, f"prompts not in flight at the kill: {others}"
    by_doomed = {i for i, r in found.results.items() if r["worker"] == "doomed"}
    assert by_doomed and not by_doomed & in_flight, (by_doomed, in_flight)
