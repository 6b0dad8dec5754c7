"""The decode bound's arithmetic (genq.core.decodebound) on the figures of the story behind genq, what caps
a batch and its fix, the GPU slower than its peers, NVML's bandwidth against the rated table, and the
server's generation counter read as a rate. Pure functions: no Redis, no server."""

from __future__ import annotations

import time
from pathlib import Path

import click
import pytest

from genq.cli.worker import ByteSize
from genq.core.decodebound import GpuFigures, batch_cap, bound, fleet_line, slow, verdicts
from genq.core.records import Hardware
from genq.worker.controller import checked_bandwidth, throttle_reasons
from genq.worker.held import COUNTER_WINDOW_S, RateWindow

# 8 RTX PRO 6000 Blackwell GPUs made 3.9K tok/s: 485 each, 37 running, a 27B model's bf16 weights.
PRO_6000 = 1.79e12  # bytes/s (GDDR7, 512-bit at 28 Gbps)
WEIGHTS_27B = 54e9  # 27e9 parameters x 2 bytes


def story(**kw) -> GpuFigures:
    hw = Hardware(engine="sglang", bandwidth=PRO_6000, weight_bytes=WEIGHTS_27B, **kw.pop("hw", {}))
    return GpuFigures(hw=hw, running=37, tok_per_s=485.0, **kw)


def test_the_story_weights_only_bound_and_share() -> None:
    # KV bytes assumption: none counted (a server that does not publish its KV cache's size): each step
    # reads the 54 GB of weights once, so 37 running make at most 37 x 1.79e12 / 54e9 tokens a second.
    b = bound(story())
    assert b.tok_per_s == pytest.approx(37 * 1.79e12 / 54e9)
    assert round(b.tok_per_s) == 1226
    assert b.share == pytest.approx(485 / 1226.48, rel=1e-4)
    assert f"{b.share:.1%}" == "39.5%"
    assert b.kv_bytes is None and b.unknown is not None and "KV bytes" in b.unknown  # said: a ceiling


def test_the_story_with_the_kv_cache_read_each_step() -> None:
    # KV bytes assumption: SGLang says its KV cache holds 20 GB (memory_usage.kvcache) and 45 % of it is in
    # use (sglang:token_usage): 9 GB of KV read per step beside the weights.
    b = bound(story(token_usage=0.45, hw={"kv_pool_bytes": 20e9, "token_capacity": 200_000}))
    assert b.kv_bytes == pytest.approx(9e9)
    assert b.step_bytes == pytest.approx(63e9)
    assert round(b.tok_per_s or 0) == 1051
    assert f"{b.share:.1%}" == "46.1%"
    assert b.unknown is None


def test_a_missing_figure_is_named_with_the_option_that_gives_it() -> None:
    b = bound(GpuFigures(hw=Hardware(engine="vllm"), running=37, tok_per_s=485.0))
    assert b.tok_per_s is None
    assert b.unknown and b.unknown.startswith("unknown: ")
    assert "--gpu-bandwidth" in b.unknown and "--model-bytes" in b.unknown


def test_kv_cache_caps_the_batch_and_the_fix_is_sglangs_memory_flags() -> None:
    cap = batch_cap(story(token_usage=0.97, waiting=40, running_limit=128, in_flight=77, target=77, queued=500,
                          hw={"kv_pool_bytes": 20e9, "token_capacity": 100_000}))
    assert cap is not None and cap.code == "kv_cache"
    assert "--mem-fraction-static" in cap.advice and "--kv-cache-dtype" in cap.advice
    assert "--mamba-scheduler-strategy" in cap.advice
    assert "2,622 tokens a request" in cap.text  # 0.97 x 100,000 / 37
    vllm = batch_cap(GpuFigures(hw=Hardware(engine="vllm"), running=37, token_usage=0.95, in_flight=37))
    assert vllm is not None and "--gpu-memory-utilization" in vllm.advice


def test_a_running_limit_below_what_the_kv_cache_holds_gets_raised() -> None:
    # 37 running at the limit 37, the KV cache 37 % used: it would hold 100 at this context.
    cap = batch_cap(story(token_usage=0.37, waiting=30, running_limit=37, in_flight=67, target=67, queued=10))
    assert cap is not None and cap.code == "running_limit"
    assert cap.advice == "raise --max-running-requests to ~100"
    assert "~100" in cap.text


def test_the_running_limit_advice_names_the_figure_its_text_gives() -> None:
    # The KV cache would hold 100.6: the text and the fix say the same ~101, not ~101 then ~100.
    cap = batch_cap(story(token_usage=37 / 100.6, running_limit=37, in_flight=37, target=37))
    assert cap is not None and "would hold ~101" in cap.text, cap.text
    assert cap.advice == "raise --max-running-requests to ~101", cap.advice


def test_genq_target_prefill_and_the_tail() -> None:
    target = batch_cap(story(token_usage=0.3, waiting=0, running_limit=72, in_flight=32, target=32, cap=32,
                             queued=200))
    assert target is not None and target.code == "genq_target" and "genq concurrency" in target.advice
    prefill = batch_cap(story(token_usage=0.3, waiting=12, running_limit=72, in_flight=49, target=49, queued=0))
    assert prefill is not None and prefill.code == "prefill" and "--chunked-prefill-size" in prefill.advice
    tail = batch_cap(story(token_usage=0.3, waiting=0, running_limit=72, in_flight=37, target=72, queued=0))
    assert tail is not None and tail.code == "nothing_to_send"
    assert batch_cap(GpuFigures(running=0, in_flight=0)) is None


def test_a_gpu_at_half_its_peers_share_is_flagged() -> None:
    fleet = {f"gpu{i}": story() for i in range(7)}
    fleet["gpu7"] = GpuFigures(hw=fleet["gpu0"].hw, running=37, tok_per_s=240.0)
    flagged = slow(fleet)
    assert list(flagged) == ["gpu7"]
    assert "20% of its bound" in flagged["gpu7"] and "peers are at 40%" in flagged["gpu7"]
    line = fleet_line(fleet, verdicts(fleet))
    assert line is not None and line.startswith("fleet at 37% of its bandwidth bound")
    assert "gpu7 slowest at 20%" in line
    # Without a bound, tokens per running request at about the same running count.
    bare = {"a": GpuFigures(running=37, tok_per_s=485.0), "b": GpuFigures(running=36, tok_per_s=480.0),
            "c": GpuFigures(running=37, tok_per_s=240.0), "d": GpuFigures(running=5, tok_per_s=100.0)}
    assert list(slow(bare)) == ["c"]


@pytest.mark.parametrize(("name", "bus", "clock", "rated"), [
    ("NVIDIA H100 80GB HBM3", 5120, 2619, 3.35e12),
    ("NVIDIA H200", 6144, 3201, 4.8e12),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 512, 14001, 1.792e12),
    ("NVIDIA L40S", 384, 9001, 0.864e12),
])
def test_nvml_bus_width_times_clock_agrees_with_the_rated_table(name: str, bus: int, clock: int,
                                                                rated: float) -> None:
    bw, told = checked_bandwidth(name, bus, clock)
    assert bw == pytest.approx(rated, rel=0.05)
    assert "not the rated" not in told and "rated" in told


def test_nvml_without_bus_width_uses_the_table_and_a_disagreement_is_said() -> None:
    assert checked_bandwidth("NVIDIA B200", None, None)[0] == 8.0e12
    bw, told = checked_bandwidth("NVIDIA H100 80GB HBM3", 5120, 1000)
    assert bw == pytest.approx(1.28e12) and "not the rated 3.35 TB/s" in told
    assert checked_bandwidth("Some GPU", None, None)[0] is None
    assert throttle_reasons(0x4 | 0x40) == ["power cap", "hw thermal"]


def test_the_no_gpu_probe_is_clean_here() -> None:
    from genq.worker.controller import GpuProbe

    probe = GpuProbe(0)
    assert probe.note is not None and probe.bandwidth is None  # this machine has no GPU / driver
    assert probe.sample() is None


def test_nvml_bandwidth_script_without_a_gpu_says_so(tmp_path, capsys) -> None:
    """scripts/nvml_bandwidth.py, run on a GPU machine by scripts/sglang/gpu_check.sh: here, no GPU, exit 1;
    a model directory's weight files are its bytes."""
    import runpy

    script = runpy.run_path(str(Path(__file__).parent.parent / "scripts" / "nvml_bandwidth.py"))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 99)
    assert script["model_bytes"](tmp_path) == 1000
    assert script["main"](["--model", str(tmp_path), "--running", "4"]) == 1
    assert capsys.readouterr().out.startswith("no GPU: ")


def test_byte_sizes_as_the_worker_options_take_them() -> None:
    assert ByteSize(per_second=True).convert("1.79TB/s", None, None) == pytest.approx(1.79e12)
    assert ByteSize(per_second=True).convert("1790GB/s", None, None) == pytest.approx(1.79e12)
    assert ByteSize().convert("54GB", None, None) == pytest.approx(54e9)
    assert ByteSize().convert("48GiB", None, None) == 48 * 2**30
    assert ByteSize().convert("1790000000000.0", None, None) == 1.79e12  # as --gpus forwards it
    with pytest.raises(click.BadParameter):
        ByteSize().convert("fast", None, None)


def test_the_counter_rate_follows_the_server_within_its_window() -> None:
    w = RateWindow()
    now = time.monotonic()
    assert w.server_window() is None
    for i in range(22):  # 500 tok/s at 50 running for 15 s, then 100 tok/s at 10
        at = now - 22 + i
        w.counted(at, (500 * i) if i <= 15 else 500 * 15 + 100 * (i - 15), 50 if i <= 15 else 10, 0.5)
    assert w.server_window() == pytest.approx((100.0, 10.0, 0.5), rel=0.01)
    assert len(w._counter) <= COUNTER_WINDOW_S + 2
    # SGLang between two batches: 0 running while it prefills the next, the counter still: the window's.
    w.counted(now - 0.7, 500 * 15 + 100 * 6, 0, 0.0, waiting=10)
    between = w.server_window()
    assert between is not None and 80 < between[0] <= 100, between
    w.counted(now - 0.5, 500 * 15 + 100 * 6, 0, 0.0)  # it ran nothing, nothing waits, made nothing since: 0
    assert w.server_window() == (0.0, 0.0, 0.0)  # now, not the window's 100
    w.counted(now, 10.0, 10, None)  # the server restarted: its counter began again
    assert w.server_window() is None


def test_workers_sharing_a_server_are_one_gpu() -> None:
    from genq.core.decodebound import judge
    from genq.core.records import WorkerStatus

    def status(name: str, server: str) -> WorkerStatus:
        return WorkerStatus(name=name, host="h", pid=1, server=server, state="busy", started_at=0.0,
                            heartbeat_at=0.0, server_running=37, tok_per_s=485.0, in_flight=20,
                            hardware=Hardware(bandwidth=PRO_6000, weight_bytes=WEIGHTS_27B))

    judged = judge({"a": status("a", "http://gpu0"), "b": status("b", "http://gpu0"), "c": status("c", "http://gpu1")})
    assert sorted(judged) == ["a", "c"]
    assert round(judged["a"].bound.tok_per_s or 0) == 1226


def test_a_job_summary_counts_a_shared_server_once() -> None:
    """Two workers on one server both read its counter: each books its part of the server's speed and
    bound, and the summary counts that GPU once."""
    from genq.core.decodebound import add_tally, job_line
    from genq.core.records import WorkerStatus

    def status(name: str, server: str, tok_per_s: float, sequences: int) -> WorkerStatus:
        return WorkerStatus(name=name, host="h", pid=1, server=server, state="busy", started_at=0.0,
                            heartbeat_at=0.0, server_running=37, server_waiting=3, window_running=37,
                            tok_per_s=tok_per_s,
                            tok_per_s_from="server", in_flight=sequences, sequences=sequences,
                            hardware=Hardware(bandwidth=PRO_6000, weight_bytes=WEIGHTS_27B))

    # gpu0 at 40 % of its 1,226 tok/s bound, its 40 requests held half by a, half by b; gpu1 at 20 %, c alone.
    workers = [status("a", "http://gpu0", 485.0, 20), status("b", "http://gpu0", 485.0, 20),
               status("c", "http://gpu1", 242.5, 40)]
    for s in workers:
        for _ in range(10):
            add_tally(s.bound_tally, {"job": s.sequences}, s, 1.0)
    assert sum(s.bound_tally["job"].made for s in workers) == pytest.approx((485.0 + 242.5) * 10)
    line = job_line(workers, "job")
    assert line is not None and line.startswith("fleet at 30% of its bandwidth bound over the job;"), line
    assert "c slowest at 20%" in line and "c much slower than its peers (20% against 40%)" in line, line
    # A worker whose speed is its own answers' (no counter) made its part already: its bound is its part too.
    own = status("d", "http://gpu2", 242.5, 20)
    own.tok_per_s_from = "answers"
    add_tally(own.bound_tally, {"job": 20}, own, 1.0)
    shared = workers[0].bound_tally["job"]
    assert own.bound_tally["job"].made / own.bound_tally["job"].bound == pytest.approx(shared.made / shared.bound)
