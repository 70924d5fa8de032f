"""Serve mode's generation loop without a broker or HTTP (engines/serving.py): many jobs share the engine's
batch, bounds refuse instead of queueing, swaps wait for a drain, cancelled and late jobs leave the engine,
and streamed text never takes anything back (consumers/serve/stream.py)."""
from __future__ import annotations

import threading
import time

import pytest

from streamrft.consumers.serve.stream import TextDeltas
from streamrft.engines.inference import create_engine
from streamrft.engines.inference.base import SamplingParams
from streamrft.engines.serving import Job, JobStopped, Overloaded, ServingLoop, ServingPolicy


class Outcome:
    def __init__(self) -> None:
        self.completions = None
        self.error = None
        self.done = threading.Event()
        self.tokens: list[int] = []

    def on_done(self, completions, error) -> None:
        self.completions, self.error = completions, error
        self.done.set()

    def on_tokens(self, _prompt, _choice, ids, _logprobs) -> None:
        self.tokens += ids


class Weights:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.published = 0
        self.loaded_while_running: list[int] = []
        self.loop: ServingLoop | None = None

    def newer_due(self) -> bool:
        return self.published > self.engine.version

    def swap_to_latest(self) -> bool:
        self.loaded_while_running.append(self.loop.running)
        self.engine.load_weights({}, self.published)
        return True


def make_loop(engine, **policy):
    weights = Weights(engine)
    loop = ServingLoop(engine, weights, ServingPolicy(**policy))
    weights.loop = loop
    return loop, weights


def job(outcome: Outcome, prompt=(1, 2, 3), *, n=1, max_tokens=4, stream=False) -> Job:
    return Job(list(prompt), SamplingParams(max_tokens=max_tokens, seed=1), n, on_done=outcome.on_done,
               on_tokens=outcome.on_tokens if stream else None)


def run_until(loop: ServingLoop, outcomes, timeout_s=20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(o.done.is_set() for o in outcomes):
        assert time.monotonic() < deadline, "the loop never finished its jobs"
        loop.step(timeout=0.01)


def test_a_batch_engine_runs_every_job_waiting_in_one_step_and_gathers_within_its_window():
    engine = create_engine("fake", latency_s=0.001)
    loop, _ = make_loop(engine, batch_window_s=0.3)
    outcomes = [Outcome() for _ in range(16)]

    def client(i):
        time.sleep(0.01 * i)  # they come one after the other, within the window
        loop.submit(job(outcomes[i], prompt=(i + 1, 7)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    run_until(loop, outcomes)
    assert loop.largest_batch == 16 and loop.steps == 1 and engine.calls == 1
    assert all(o.error is None and len(o.completions) == 1 for o in outcomes)


def test_an_incremental_engine_takes_jobs_into_the_running_batch_up_to_the_bound():
    engine = create_engine("fake", latency_s=0.05, incremental=True)
    loop, _ = make_loop(engine, max_running=3, max_waiting=10)
    outcomes = [Outcome() for _ in range(5)]
    for o in outcomes:
        loop.submit(job(o, n=2))
    loop.step(timeout=0)
    assert loop.running == 3 and loop.waiting == 2
    run_until(loop, outcomes)
    assert loop.largest_batch == 3 and all(len(o.completions) == 2 for o in outcomes)


def test_beyond_the_queue_a_job_is_refused_with_when_to_come_back():
    engine = create_engine("fake", latency_s=0.05, incremental=True)
    loop, _ = make_loop(engine, max_running=1, max_waiting=1)
    kept = [Outcome(), Outcome()]
    loop.submit(job(kept[0]))
    loop.step(timeout=0)  # running
    loop.submit(job(kept[1]))  # waiting
    with pytest.raises(Overloaded) as refused:
        loop.submit(job(Outcome()))
    assert refused.value.retry_after_s >= 1 and loop.refused == 1
    run_until(loop, kept)
    later = Outcome()
    loop.submit(job(later))  # room again
    run_until(loop, [later])
    assert later.error is None


def test_new_weights_wait_for_the_running_jobs_and_admission_pauses_meanwhile():
    engine = create_engine("fake", latency_s=0.1, incremental=True)
    loop, weights = make_loop(engine)
    first, second = Outcome(), Outcome()
    loop.submit(job(first, n=3))
    loop.step(timeout=0)
    weights.published = 1
    loop.submit(job(second))
    loop.step(timeout=0)
    assert loop.running == 1 and loop.waiting == 1  # paused: the swap is due
    run_until(loop, [first, second])
    assert weights.loaded_while_running == [0] and loop.swaps == 1 and loop.swap_pause_s > 0
    assert {c.model_version for c in first.completions} == {0}
    assert {c.model_version for c in second.completions} == {1}


def test_a_cancelled_job_leaves_the_engine_and_others_go_on():
    engine = create_engine("fake", latency_s=0.2, incremental=True)
    loop, _ = make_loop(engine)
    gone, kept = Outcome(), Outcome()
    cancelled = job(gone, n=10)
    loop.submit(cancelled)
    loop.submit(job(kept))
    loop.step(timeout=0)
    loop.cancel(cancelled)
    run_until(loop, [gone, kept])
    assert isinstance(gone.error, JobStopped) and loop.cancelled == 1 and engine.unfinished == 0
    assert kept.error is None


def test_a_job_past_its_deadline_is_stopped():
    engine = create_engine("fake", latency_s=1.0, incremental=True)
    loop, _ = make_loop(engine, request_timeout_s=0.2)
    late = Outcome()
    loop.submit(job(late, n=5))
    run_until(loop, [late], timeout_s=5)
    assert isinstance(late.error, JobStopped) and "serve.request_timeout_s" in str(late.error)
    assert loop.timed_out == 1


def test_the_transformers_engine_streams_each_token_and_stops_a_cancelled_row_mid_step(tiny_model_dir):
    engine = create_engine("transformers", tiny_model_dir, device="cpu")
    loop, _ = make_loop(engine)
    streamed, whole = Outcome(), Outcome()
    loop.submit(job(streamed, max_tokens=12, stream=True))
    loop.submit(job(whole, max_tokens=12))
    run_until(loop, [streamed, whole])
    assert streamed.tokens == streamed.completions[0].response_ids  # token by token, adding up to the answer
    assert streamed.tokens == whole.completions[0].response_ids  # seeded: the same sample either way

    stopped = Outcome()
    cancelled = job(stopped, max_tokens=400, stream=True)

    def cancel_after_three(_prompt, _choice, ids, _logprobs):
        stopped.tokens += ids
        if len(stopped.tokens) == 3:
            loop.cancel(cancelled)

    cancelled.on_tokens = cancel_after_three
    loop.submit(cancelled)
    run_until(loop, [stopped])
    assert isinstance(stopped.error, JobStopped) and len(stopped.tokens) <= 4  # the row left at its next token


def test_streamed_text_holds_back_partial_characters_and_possible_stop_strings():
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\n", 6: "END", 7: "!"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    plain = TextDeltas(decode)
    assert [plain.add([i]) for i in (1, 2, 3)] == ["Hel", "lo", " wor"]
    assert plain.finish("Hello wor") == ""

    stopping = TextDeltas(decode, stops=["\nEND"])
    sent = [stopping.add([i]) for i in (1, 2, 3, 4, 5, 6, 7)]
    assert "".join(sent) == "Hello world" and "\n" not in "".join(sent)
    assert stopping.finish("Hello world") == ""

    texts = {(1,): "caf", (1, 2): "caf\ufffd", (1, 2, 3): "café"}  # token 2 is the first byte of "é"
    partial = TextDeltas(lambda ids: texts[tuple(ids)])
    assert [partial.add([i]) for i in (1, 2, 3)] == ["caf", "", "é"]
