"""Replay with Kafka's own tool: `kafka-consumer-groups --reset-offsets` (ConsumerGroupCommand of kafka-tools, run
with java -cp) on the trainer's group while it runs and while it is stopped, against the trainer on the real broker
with a tiny model. The trainer never overwrites a reset it did not make: it stops naming both positions, or with
--accept-offset-reset reads on from the group's offsets, and its lag drains (the explorer does not stall).
`streamrft train --replay-from` is the other way on: a new lineage that leaves the group alone."""
from __future__ import annotations

import subprocess
import time

import pytest

from streamrft.broker.tools import CONSUMER_GROUPS, tool_command
from streamrft.consumers.trainer import Trainer
from streamrft.consumers.trainer.group_offsets import Mark, OffsetReset
from streamrft.lifecycle import StopSignal

from .test_trainer_side import _clients, _settings, audit_eids, produce, steps_of, trainer_thread

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def reset_to_earliest(config) -> str:
    """What an operator runs (docs/operations.md); returns the tool's output."""
    cmd = tool_command(CONSUMER_GROUPS, "--bootstrap-server", config.kafka.bootstrap_servers,
                       "--group", config.consumer_group("trainer"), "--topic", config.topic("experiences"),
                       "--reset-offsets", "--to-earliest", "--execute")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def committed(clients, config) -> dict:
    consumer = clients.consumer([config.topic("experiences")], object, config.consumer_group("trainer"),
                                dead_letters=False, subscribe=False)
    try:
        parts = list(clients.offsets(config.topic("experiences"), "end"))
        return consumer.committed(parts)
    finally:
        consumer.close()


def wait_until(condition, timeout: float, what: str, thread=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        assert thread is None or thread.error is None, thread.error
        time.sleep(0.2)


def test_reset_while_stopped_stops_the_resume_and_replay_or_accept_go_on(run_config, tiny_model_dir, tmp_path):
    settings = _settings(tiny_model_dir, tmp_path / "ckpt", trainer={"total_steps": 2}, sync={"max_staleness": 10})
    config = run_config(**settings)
    clients = _clients(config)
    early = steps_of(0, 1)
    produce(clients, config, early)
    trainer_thread(config, clients).join(120)
    group, topic = config.consumer_group("trainer"), config.topic("experiences")
    ends = clients.offsets(topic, "end")
    assert clients.committed(group, topic) == ends
    assert all(Mark.parse(meta).by == group for _, meta in committed(clients, config).values())

    said = reset_to_earliest(config)
    assert "NEW-OFFSET" in said and clients.committed(group, topic) == {tp: 0 for tp in ends}

    more = config.model_copy(update={"trainer": config.trainer.model_copy(update={"total_steps": 4})})
    with pytest.raises(OffsetReset) as stopped:
        Trainer(more, clients, StopSignal()).run()
    message = str(stopped.value)
    print("the trainer said:", message)
    for tp, end in ends.items():
        if end:
            assert f"{topic}[{tp[1]}] group at 0, trainer at {end}" in message
    assert "--replay-from 0" in message and "--accept-offset-reset" in message
    assert clients.committed(group, topic) == {tp: 0 for tp in ends}  # not overwritten

    replay = trainer_thread(config, clients, group="replay", replay_from="earliest")  # a new lineage
    replay.join(120)
    root = config.checkpoint_dir
    assert sorted(audit_eids(root.with_name(root.name + "-replay"))) == sorted(e.eid for e in early)
    assert clients.committed(group, topic) == {tp: 0 for tp in ends}  # the replay left the group alone

    late = steps_of(2, 3)
    produce(clients, config, late)
    accepting = trainer_thread(more, clients, accept_offset_reset=True)
    accepting.join(120)
    audit = audit_eids(root)
    # steps 0-1 trained the early data; after the accepted reset to 0 steps 2-3 read it again from there
    assert sorted(audit[:16]) == sorted(e.eid for e in early) and sorted(audit[16:]) == sorted(e.eid for e in early)
    marks = {tp: Mark.parse(meta) for tp, (_, meta) in committed(clients, config).items()}
    assert all(mark is not None and mark.by == group for mark in marks.values())
    clients.close()


def test_reset_while_live_stops_the_trainer_or_is_accepted_without_stalling(run_config, tiny_model_dir, tmp_path):
    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", trainer={"save_interval": 1},
                                    sync={"max_staleness": 10}))
    clients = _clients(config)
    group, topic = config.consumer_group("trainer"), config.topic("experiences")
    produce(clients, config, steps_of(0, 1))
    ends = clients.offsets(topic, "end")

    live = trainer_thread(config, clients)
    wait_until(lambda: live.role is not None and live.role.step == 2 and clients.committed(group, topic) == ends,
               120, "the trainer never trained the two steps", live)
    reset_to_earliest(config)  # Kafka accepts it: the trainer's group has no members
    wait_until(lambda: not live.thread.is_alive(), 30, "the trainer did not notice the reset")
    assert isinstance(live.error, OffsetReset)
    print("the trainer said:", live.error)
    assert "while the trainer ran" in str(live.error) and "group at 0, trainer at" in str(live.error)
    assert clients.committed(group, topic) == {tp: 0 for tp in ends}

    accepting = trainer_thread(config, clients, accept_offset_reset=True)  # at start: reads on from 0
    wait_until(lambda: accepting.role is not None and accepting.role.step == 4
               and clients.lag(group, topic) == 0, 120, "the accepted reset was not trained through", accepting)
    reset_to_earliest(config)  # live, accepted: the trainer reads on from 0 again and the lag drains
    wait_until(lambda: accepting.role.step == 6 and clients.lag(group, topic) == 0, 120,
               "the lag did not drain after a live reset was accepted", accepting)
    accepting.stop.request()
    accepting.join(60)
    assert len(audit_eids(config.checkpoint_dir)) == 3 * 16
    clients.close()
