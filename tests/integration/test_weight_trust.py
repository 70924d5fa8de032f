"""On a real broker: a rollout worker loads only weights this run's trainer published. Forged weight signals on
``sync`` are refused (and dead-lettered once for the rollout group) while the worker keeps serving what it has;
a trainer that lost its last steps with the process and resumed from an older checkpoint is followed to its
new lineage, even though its versions are lower than or equal to the lost ones."""
from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrft.consumers.trainer.checkpoints import Checkpoints
from streamrft.consumers.rollout import RolloutWorker
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.sync import SyncView
from .roles import RoleThread
from .test_trainer_side import _clients, _settings, produce, steps_of, trainer_thread

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def wait_until(condition, timeout: float, what: str, *threads: RoleThread) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for thread in threads:
            assert thread.thread.is_alive(), f"{thread.thread.name} stopped: {thread.error!r}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def forged(real: SyncSignal, store_url: str) -> dict[str, SyncSignal]:
    """Signals a hostile or confused producer could write, each next to the real one's version. All but the
    last are refused where they are read (the view never takes them as the newest weights); the last points
    where the real v-N lives but with another sha256, so only loading can tell it is wrong."""
    def like(**changes) -> SyncSignal:
        fields = {"kind": SyncKind.WEIGHTS_PUBLISHED, "version": real.version + 1, "method": SyncMethod.OBJECT_STORE,
                  "uri": real.uri, "sha256": real.sha256, "nbytes": real.nbytes, "source": "trainer",
                  "lineage": real.lineage}
        return SyncSignal(**{**fields, **changes})

    return {
        "foreign-uri": like(uri="file:///tmp/elsewhere/v00000009/manifest.json"),
        "dotdot": like(uri=f"{store_url}/../../etc/manifest.json"),
        "missing-sha256": like(sha256=""),
        "version-mismatch": like(),  # the real v-N manifest announced as v-N+1
        "huge-version": like(version=10**12),
        "wrong-sha256": like(version=real.version, sha256="0" * 64),
    }


def test_forged_signals_are_refused_and_a_resumed_trainer_is_followed(run_config, tiny_model_dir, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    config = run_config(**_settings(tiny_model_dir, ckpt, trainer={"total_steps": 3, "save_interval": 2},
                                    sync={"style": "fully_async"}))
    clients = _clients(config)
    produce(clients, config, steps_of(0, 2))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    trainer = trainer_thread(config, clients)
    trainer.join(180)
    wait_until(lambda: worker.role is not None and worker.role.weights.loaded is not None
               and worker.role.engine.version == 3, 60, "the worker to load v3", worker)
    first = worker.role.weights.loaded
    assert first.lineage  # every trainer lifetime has one

    producer = clients.producer()
    for signal in forged(first, config.weights_url).values():
        producer.produce(config.topic("sync"), signal)
    producer.flush()
    refused = worker.role.runtime.registry
    wait_until(lambda: sum(s.value for m in refused.collect() if m.name == "streamrft_rollout_weights_refused"
                           for s in m.samples if s.name.endswith("_total")) >= 1, 60, "the refusal", worker)
    time.sleep(1)  # the dead letter goes out with the worker's next transaction
    assert worker.role.engine.version == 3 and worker.role.weights.loaded == first  # keeps serving
    # the owner of sync's dead letters (the explorer, in a run) reads the same topic
    owner = SyncView(clients, client_id="owner", dead_letters=True)
    owner.catch_up()
    assert owner.rejected == 5 and owner.weights.sha256 == "0" * 64
    owner.close()

    # The trainer "crashed" after publishing v3 and before checkpointing it: only step 2's checkpoint is left.
    checkpoints = Checkpoints(ckpt, 5)
    shutil.rmtree(checkpoints.latest())
    assert checkpoints.steps()[-1] == 2
    resumed = trainer_thread(config, clients)
    resumed.join(180)
    wait_until(lambda: worker.role.weights.loaded.lineage != first.lineage, 60, "the worker to follow the resumed "
               "trainer", worker)
    assert worker.role.engine.version == 3 and worker.role.weights.loaded.version == 3
    worker.stop.request()
    worker.join(60)

    letters = [dict(raw.headers) for raw in read_to_end(config.kafka, clients.bootstrap,
                                                         config.topic("sync") + ".dlq")]
    by_offset = Counter(h["streamrft.source.offset"] for h in letters)
    assert len(letters) == 6 and set(by_offset.values()) == {1}, letters  # each forged signal once
    reasons = Counter((h["streamrft.stage"].decode(), h["streamrft.reason"].decode()) for h in letters)
    assert reasons == {("validate", "foreign-uri"): 3, ("validate", "missing-sha256"): 1,
                       ("validate", "out-of-range"): 1, ("weights", "integrity"): 1}, reasons
    clients.close()
