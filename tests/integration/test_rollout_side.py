"""Explorer + rollout workers on the real broker with a tiny real model."""
from __future__ import annotations

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow
from streamrft.engines.workflows.registry import register_workflow
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, RolloutResult, RolloutStatus

from .roles import RoleThread, group_sizes, produce_tasks, read_all, wait_for, wait_for_explorer_step

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def _config(run_config, tiny_model_dir, sync: dict | None = None, **explorer):
    return run_config(
        model={"path": str(tiny_model_dir)},
        sync={"style": "fully_async", "max_staleness": 100, **(sync or {})},
        explorer={"batch_size": 8, "repeat_times": 4, "max_steps": 3, "metrics_port": None, **explorer},
        rollout={"sampling": {"max_tokens": 6}, "metrics_port": None},
        topics={"rollouts": {"partitions": 4}},
    )


def test_explorer_and_two_workers_account_for_every_sample(run_config, tiny_model_dir):
    config = _config(run_config, tiny_model_dir)
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, make_arithmetic_tasks(24, seed=1))

    workers = [RoleThread(f"worker-{i}", lambda stop, i=i: RolloutWorker(config, clients, stop, f"w{i}")).start()
               for i in range(2)]
    _wait_until_both_hold_partitions(workers, 120)  # else one member can drain all 3 quick steps alone
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, workers, 240)
    for worker in workers:
        worker.stop.request()
    for worker in workers:
        worker.join(60)

    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert len(experiences) == 3 * 8 * 4
    assert len({e.eid for e in experiences}) == len(experiences)
    assert set(group_sizes(experiences).values()) == {4}
    assert all(e.group_size == 4 and e.response_length > 0 for e in experiences)
    assert len(results) == 24 and {r.status for r in results} == {RolloutStatus.OK}
    assert sorted({r.step for r in results}) == [0, 1, 2]
    assert {e.worker_id for e in experiences} == {"w0", "w1"}  # both group members took work
    assert explorer.result.done and explorer.result.next_step == 3
    clients.close()


def _wait_until_both_hold_partitions(workers, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not all(w.role is not None and w.role.consumer.assigned for w in workers):
        assert all(w.error is None for w in workers), [w.error for w in workers]
        assert time.monotonic() < deadline, "the rollout group never gave both workers partitions"
        time.sleep(0.2)


@register_workflow("test_needs_answer", replace=True)
class _NeedsAnswer(ArithmeticWorkflow):
    """Arithmetic whose payload must hold an answer, checked only when it runs (in the worker)."""

    def run(self, task, payload, engine, repeat_times, sampling):
        if "answer" not in payload:
            raise ValueError("payload has no 'answer' to score against")
        return super().run(task, payload, engine, repeat_times, sampling)


def test_poison_task_fails_alone_and_lands_in_the_dlq(run_config, tiny_model_dir):
    from streamrft.kafka.reader import read_topic
    from streamrft.schemas import Task

    config = _config(run_config, tiny_model_dir, max_steps=1, batch_size=4)
    # one request in flight: the worker pauses its partitions whenever it is full; nothing may be lost on resume
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"requests_in_flight": 1})})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    tasks = make_arithmetic_tasks(3, seed=2)
    # valid at the explorer's edge (a plugin workflow has no payload schema there), fails in the worker
    poison = Task(task_id="poison-1", workflow="test_needs_answer", payload='{"question": "What is 1 + 1?"}')
    produce_tasks(clients, config, [tasks[0], poison, *tasks[1:]])

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, [worker], 180)
    worker.stop.request()
    worker.join(60)

    results = {r.task_id: r for r in read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)}
    assert results["poison-1"].status == RolloutStatus.FAILED
    assert "answer" in results["poison-1"].error
    assert all(results[t.task_id].status == RolloutStatus.OK for t in tasks)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert {e.task_id for e in experiences} == {t.task_id for t in tasks}
    letters = list(read_topic(config.kafka, clients.bootstrap, config.topic("rollouts") + ".dlq", idle_timeout=2))
    assert len(letters) == 1
    headers = {k: v.decode() for k, v in letters[0].headers}
    assert headers["streamrft.reason"] == "workflow-error" and headers["streamrft.stage"] == "process"
    assert "answer" in headers["streamrft.error"]
    assert clients.serde.decode(letters[0].value, config.topic("rollouts")).task.task_id == "poison-1"
    clients.close()


def test_explorer_waits_at_max_staleness_until_weights_are_published(run_config, tiny_model_dir):
    import time

    import torch

    from streamrft.engines.weights.object_store import ObjectStore
    from streamrft.schemas import SyncKind, SyncMethod, SyncSignal

    config = _config(run_config, tiny_model_dir, max_steps=2, batch_size=2,
                     sync={"style": "fixed", "interval": 1, "max_staleness": 0})
    config = config.model_copy(update={"trainer": config.trainer.model_copy(
        update={"checkpoint_dir": str(tiny_model_dir.parent / f"{config.name}-ckpt")})})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, make_arithmetic_tasks(4, seed=3))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()

    wait_for_explorer_step(explorer, 0, timeout=120)
    time.sleep(5)  # no trainer: step 1 needs weights v1, so the explorer must hold
    assert explorer.role.state.next_step == 1
    assert explorer.role.g_waiting._value.get() == 1
    assert len(read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)) == 2

    # Publish v1 as a trainer would: upload first, then the signal.
    new_weights = {name: tensor + 0.01 for name, tensor in worker.role.engine.state_dict().items()}
    published = ObjectStore(config.weights_url).publish(new_weights.items(), version=1)
    producer = clients.producer()
    producer.produce(config.topic("sync"), SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=1,
                                                      method=SyncMethod.OBJECT_STORE, uri=published.uri,
                                                      sha256=published.sha256, nbytes=published.nbytes))
    producer.flush()
    wait_for(explorer, [worker], 120)
    served = worker.role.engine.state_dict()
    worker.stop.request()
    worker.join(60)

    assert explorer.result.done and explorer.result.next_step == 2
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert {e.step: e.model_version for e in experiences} == {0: 0, 1: 1}
    for name, tensor in new_weights.items():
        assert torch.equal(served[name], tensor), name
    clients.close()


# The transformers engine only: what this checks (transactions, offsets, redelivery) is the same code whatever
# the engine, and two vLLM worker processes made it the suite's slowest test (46-74 s); vLLM in a worker process
# is covered by test_vllm.py.
@pytest.mark.parametrize("engine", ["transformers"])
def test_sigkill_of_one_worker_loses_and_duplicates_nothing(run_config, tiny_model_dir, tmp_path, engine):
    import signal
    import time

    from streamrft.config.roles import VLLMConfig

    from .roles import role_process, write_config

    config = _config(run_config, tiny_model_dir)
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={
        "requests_per_batch": 2, "transaction_timeout_ms": 10_000, "engine": engine,
        "vllm": VLLMConfig(kv_cache_gib=1, enforce_eager=True, max_model_len=256),
        "sampling": config.rollout.sampling.model_copy(update={"max_tokens": 24})})})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, make_arithmetic_tasks(24, seed=4))
    path = write_config(config, tmp_path / "run.yaml")
    workers = {name: role_process(["rollout", "--worker-id", name], path, tmp_path / f"{name}.log")
               for name in ("victim", "survivor")}
    # both in the group before there is work: else a slow-starting victim may find every request done
    deadline = time.monotonic() + 120
    while not all("assigned" in (tmp_path / f"{name}.log").read_text() for name in workers):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers.values()), \
            (tmp_path / "victim.log").read_text()[-3000:]
        time.sleep(0.2)
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    try:
        deadline = time.monotonic() + 120
        while not any(r.worker_id == "victim" for r in
                      read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=0.5)):
            assert time.monotonic() < deadline, (tmp_path / "victim.log").read_text()[-3000:]
            assert workers["victim"].poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
        workers["victim"].send_signal(signal.SIGKILL)  # mid-run: it has more requests in hand
        wait_for(explorer, [], 300)
    finally:
        explorer.stop.request()
        workers["survivor"].send_signal(signal.SIGTERM)
        assert workers["survivor"].wait(60) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
        workers["victim"].wait(10)
    assert workers["victim"].returncode == -signal.SIGKILL

    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert sorted(r.request_id for r in results) == sorted({r.request_id for r in results})
    assert len(results) == 24 and {r.status for r in results} == {RolloutStatus.OK}
    assert len(experiences) == 96 and len({e.eid for e in experiences}) == 96
    assert {r.worker_id for r in results} == {"victim", "survivor"}
    clients.close()
