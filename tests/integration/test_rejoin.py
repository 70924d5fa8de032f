"""Every role goes on in-process from what it committed when a unit cannot commit (the group let it go, or the
brokers were away past the unit's deadline), on the 3-node cluster while the broker under it dies: the explorer
from its last committed state record, the trainer from its newest checkpoint. Nothing is lost or doubled.

The loop (explorer, rollout worker, trainer) runs once for the module. The node leading the explorer's
``control`` partition (where every commit of it writes its state record) is SIGKILLed and brought back, then the
one leading the trainer's ``experiences``; and one unit of the explorer and one of the trainer, each holding a
step, is reported failed, as the Transactor reports a unit it could not commit, so that each role's ``rejoin``
runs at a known step whatever the kills happened to cost."""
from __future__ import annotations

import time

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients, TransactionFailed

from .chaos_harness import chaos_module
from .roles import RoleThread, produce_tasks, wait_for, wait_for_explorer_step
from .test_cluster import _admin_config, cluster  # noqa: F401 (the module's own 3-node cluster)

pytestmark = [pytest.mark.kafka, pytest.mark.model]

STEPS = 6


class FailingOnce:
    """Runs ``role`` in its runtime's loop with a unit whose commit fails once, when ``due(role)`` says so: the
    unit is not committed (nothing of it is produced) and the loop sees ``TransactionFailed``."""

    def __init__(self, role, due):
        self.role = role
        self.failed_at = None
        unit = role.runtime.unit_of_work(state=getattr(role, "_state_record", None))
        commit = unit.commit

        def commit_or_fail() -> None:
            if self.failed_at is None and unit.due and due(role):
                self.failed_at = time.monotonic()
                raise TransactionFailed("could not commit the unit in 60s; is the broker up? (injected)")
            commit()

        unit.commit = commit_or_fail
        self.unit = unit

    def __getattr__(self, name):
        return getattr(self.role, name)

    def run(self):
        self.role.runtime.run(self.role, self.unit)
        return self.role.state if isinstance(self.role, Explorer) else self.role.step

    def rejoins(self) -> float:
        return self.role.runtime.registry.get_sample_value("streamrft_group_rejoins_total")


def _bounce(cluster, node: int) -> None:  # noqa: F811
    cluster.kill_node(node)
    time.sleep(3)
    cluster.start_node(node)
    cluster.wait_in_sync(timeout=90)


@pytest.fixture(scope="module")
def loop_with_failures(cluster, tiny_model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("rejoin")
    config = _admin_config(cluster, model={"path": str(tiny_model_dir)},
                           explorer={"batch_size": 2, "repeat_times": 4, "max_steps": STEPS, "metrics_port": None},
                           rollout={"engine": "fake", "metrics_port": None},
                           trainer={"checkpoint_dir": str(tmp / "ckpt"), "metrics_port": None, "device": "cpu",
                                    "total_steps": STEPS, "micro_batch_size": 8, "save_interval": 1})
    clients = lambda: KafkaClients(config, cluster.bootstrap_servers)  # noqa: E731
    clients().ensure_topics()
    produce_tasks(clients(), config, make_arithmetic_tasks(2 * STEPS, seed=5))
    # the unit that publishes step 2; the one that trained step 2 (its step counter went to 3)
    explorer = RoleThread("explorer", lambda stop: FailingOnce(Explorer(config, clients(), stop),
                                                               lambda e: e.state.next_step == 3))
    trainer = RoleThread("trainer", lambda stop: FailingOnce(Trainer(config, clients(), stop),
                                                             lambda t: t.step == 3))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients(), stop, "w0"))
    roles = [worker, explorer, trainer]
    try:
        for role in roles:
            role.start()
        wait_for_explorer_step(explorer, 0, 180)
        _bounce(cluster, cluster.leader_of(config.topic("control"), 0))  # under the explorer
        _bounce(cluster, cluster.leader_of(config.topic("experiences"), 0))  # under the trainer
        wait_for(trainer, [worker, explorer], 240)
        wait_for(explorer, [worker], 60)
        yield {"explorer": explorer, "trainer": trainer,
               "observed": chaos_module().observe_topics(config, cluster.bootstrap_servers, tmp / "ckpt")}
    finally:
        for role in roles:
            role.stop.request()
        for role in roles:
            role.thread.join(60)


def test_explorer_and_trainer_go_on_from_what_they_committed(loop_with_failures):
    explorer, trainer = loop_with_failures["explorer"], loop_with_failures["trainer"]
    assert explorer.role.failed_at is not None and trainer.role.failed_at is not None
    assert explorer.role.rejoins() >= 1 and trainer.role.rejoins() >= 1  # the kills may have cost more
    assert explorer.result.done and explorer.result.next_step == STEPS
    assert trainer.result == STEPS
    verdict = chaos_module().check(loop_with_failures["observed"], [], STEPS)
    assert verdict.violations == {}
    figures = verdict.figures
    assert figures["duplicates"] == 0 and figures["lost"] == 0
    assert figures["tasks"] == figures["requests"] == 2 * STEPS  # every task rolled out once
    assert figures["trained"] == figures["experiences"] == 2 * STEPS * 4  # every experience trained once


def test_the_trainer_audit_holds_each_step_once_in_order(loop_with_failures):
    audit = loop_with_failures["observed"].audit
    steps = [entry["step"] for entry in audit]
    assert steps == list(range(STEPS)), steps
