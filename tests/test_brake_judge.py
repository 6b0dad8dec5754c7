"""The brake's verdicts (worker/gate.py), outcome by outcome: which failures are dead-lettered
alone and when a job is blocked. The end-to-end runs are in tests/test_brake.py."""

from __future__ import annotations

from types import SimpleNamespace

from genq.core.records import BatchRef, JobBlock, JobConfig, Prompt
from genq.worker.gate import HOLD_S, TRIP_PROMPTS, WINDOW, Gate, signature
from genq.worker.held import HeldBatch, Task
from genq.worker.server import Failure

TOO_LONG = "The input ({n} tokens) is longer than the model's context length (2048 tokens)."


class Judged:
    def __init__(self) -> None:
        self.dead: list[str] = []
        batches = SimpleNamespace(dead=lambda task, failure: self.dead.append(task.prompt.id), conn=None,
                                  sync_conn=None, worker="w", held=None)
        self.brake = Gate(batches, None, None)  # type: ignore[arg-type]
        self.brake.block = self.block  # type: ignore[method-assign]
        self.batch = HeldBatch(BatchRef("j", "b0000001"), "t", JobConfig(name="j", output="/tmp"), set())
        self.blocks: list[tuple[str, JobBlock]] = []

    def block(self, job: str, record: JobBlock) -> None:
        """The blocks the brake tripped; Gate.block would store them and park the job."""
        self.blocks.append((job, record))
        self.brake.blocked.add(job)

    def task(self, i: int) -> Task:
        return Task(Prompt(id=f"p{i}", index=i), self.batch)

    def fail(self, i: int, message: str | None = None) -> bool:
        return self.brake.failed(self.task(i), Failure("bad_request", message or TOO_LONG.format(n=3000 + i), 400,
                                                       retryable=False))

    def ok(self, i: int) -> None:
        self.brake.succeeded(self.task(i))


def test_same_answer_whatever_the_numbers() -> None:
    a = Failure("bad_request", TOO_LONG.format(n=546), 400, retryable=False)
    b = Failure("bad_request", TOO_LONG.format(n=3020), 400, retryable=False)
    c = Failure("bad_request", "temperature must be >= 0", 400, retryable=False)
    assert signature(a) == signature(b) != signature(c)


# What real vLLM 0.32 and llama.cpp (llama-cpp-python 0.3.36's tree) answered make test-vllm and
# make test-llamacpp, as genq records it (vLLM's VLLMValidationError appends parameter and value).
VLLM_TOO_LONG = ("This model's maximum context length is 2048 tokens. However, your prompt contains at least {n} "
                 "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                 "of the input prompt. (parameter=input_tokens, value={n})")
VLLM_MAX_TOKENS = ("max_tokens={n} cannot be greater than max_model_len=2048. Please request fewer output tokens. "
                   "(parameter=max_tokens, value={n})")
LLAMACPP_TOO_LONG = "request ({n} tokens) exceeds the available context size (2048 tokens), try increasing it"
LLAMACPP_FORMAT = 'response_format type must be one of "text" or "json_object", but got: yaml'


def test_real_engines_answers_group_by_kind_whatever_the_numbers() -> None:
    def sig(message: str) -> str:
        return signature(Failure("bad_request", message, 400, retryable=False))

    kinds = [VLLM_TOO_LONG, VLLM_MAX_TOKENS, LLAMACPP_TOO_LONG]
    for kind in kinds:
        assert sig(kind.format(n=2049)) == sig(kind.format(n=30125)), kind
    assert len({sig(k.format(n=2049)) for k in kinds} | {sig(LLAMACPP_FORMAT)}) == 4
    assert sig(LLAMACPP_TOO_LONG.format(n=3012)) == ("400 request (N tokens) exceeds the available context size "
                                                     "(N tokens), try increasing it")


def test_a_job_whose_every_request_fails_is_blocked_with_nothing_dead_lettered() -> None:
    j = Judged()
    for i in range(WINDOW - 1):
        assert j.fail(i) and not j.blocks  # held, window not full yet
    j.fail(WINDOW - 1)
    assert [job for job, _ in j.blocks] == ["j"] and j.dead == []
    record = j.blocks[0][1]
    assert (record.reason, record.failures, record.outcomes, record.prompts, record.status) == (
        "brake", WINDOW, WINDOW, WINDOW, 400)
    assert j.fail(999) and j.dead == [] and len(j.blocks) == 1, "later failures of a blocked job wait with it"


def test_failures_that_come_first_but_are_a_minority_are_dead_lettered_alone() -> None:
    """A 400 comes back at once, a good request after its generation: a third of the prompts too
    long shows as ten failures first, then the successes. No block; each letter goes alone."""
    j = Judged()
    for i in range(10):
        j.fail(i)
    assert not j.dead and not j.blocks
    for i in range(10, 30):
        j.ok(i)
    assert sorted(j.dead) == sorted(f"p{i}" for i in range(10)) and not j.blocks


def test_a_few_failures_among_many_results_go_at_once() -> None:
    j = Judged()
    for i in range(40):
        j.ok(i)
    j.fail(40)
    assert j.dead == ["p40"] and not j.blocks


def test_one_prompt_is_not_several() -> None:
    """A majority needs TRIP_PROMPTS different prompts: one prompt failing again and again is its own."""
    j = Judged()
    for _ in range(WINDOW):
        j.fail(7, "one answer")
    assert not j.blocks
    assert TRIP_PROMPTS > 1


def test_held_failures_wait_at_most_hold_s() -> None:
    """The last prompts of a job: no outcome comes after them, their letters go after HOLD_S."""
    j = Judged()
    for i in range(3):
        j.fail(i)
    j.brake.judge_all()
    assert not j.dead
    for held in j.brake.windows["j"].held:
        held.since -= HOLD_S + 0.1
    j.brake.judge_all()
    assert sorted(j.dead) == ["p0", "p1", "p2"] and not j.blocks


def test_no_brake_leaves_every_failure_to_the_dead_letter_queue() -> None:
    j = Judged()
    j.batch.config.brake = False
    for i in range(WINDOW * 2):
        assert not j.fail(i), "with --no-brake the dispatcher dead-letters it at once"
    assert not j.blocks
