"""Clients none of us wrote, in two other languages, against a run's topics: a Go program (franz-go, hamba/avro,
franz-go's schema-registry client) and a Java one (Apache Kafka's client, Apache Avro) each produce tasks that the
run rolls out and trains on, read its results and experiences back with read_committed, and send one bad task that
must reach the tasks DLQ with its reason; once in Avro single-object encoding with the published headers, once in
the Confluent wire format of the embedded schema registry. What they read is checked against what the Python side
decodes from the same topics. Each client checks the published contract first: the Java one recomputes every
canonical form and fingerprint with Avro's reference implementation, the Go one the CRC-64-AVRO of each form."""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrft.config import RunConfig, load_config
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import RawRecord, read_to_end
from streamrft.schemas import (Experience, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, pack_f32,
                               pack_i32, unpack_f32, unpack_i32)

from ..integration.roles import RoleThread, read_all, wait_for
from .toolchains import Client

pytestmark = [pytest.mark.kafka, pytest.mark.model]

LANGUAGES = ("go", "java")
BATCH, REPEAT, GOOD_TASKS = 2, 2, 2  # GOOD_TASKS per language: one training step each
# framing -> language -> (the bad task its client sends, the reason and stage the explorer must dead-letter it
# with, a word its explanation must hold)
BAD_TASKS = {
    "single-object": {"go": ("swapped-fingerprint", "unknown-fingerprint", "decode", "fingerprint"),
                      "java": ("empty-workflow", "missing-workflow", "validate", "workflow")},
    "confluent": {"go": ("payload-not-object", "bad-payload", "validate", "payload"),
                  "java": ("zero-repeat-times", "out-of-range", "validate", "repeat_times")},
}
DECOY = "decoy"  # the request and group id of the records of an aborted transaction


@dataclass
class InteropRun:
    framing: str
    config: RunConfig
    contract: dict
    steps: int
    trained_steps: int
    produced: dict[str, dict]  # language -> what its client said it produced
    tasks: dict[str, RawRecord]  # key -> the task record as it is on the topic
    requests: list[RolloutRequest]
    results: list[RolloutResult]
    experiences: list[Experience]
    letters: dict[str, dict[str, str]]  # key -> the tasks DLQ's headers of its record
    read_back: dict[str, dict]  # language -> what its client read from results and experiences


def _config(name: str, bootstrap: str, model_dir, out, steps: int, registry_url: str | None) -> RunConfig:
    return load_config(env={}, overrides={
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "schema_registry": {"url": registry_url} if registry_url else {},
        "model": {"path": str(model_dir)}, "sync": {"style": "fixed", "interval": 1},
        "explorer": {"batch_size": BATCH, "repeat_times": REPEAT, "max_steps": steps, "metrics_port": None},
        "rollout": {"sampling": {"max_tokens": 3}, "metrics_port": None},
        "trainer": {"checkpoint_dir": str(out / "ckpt"), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                    "micro_batch_size": BATCH * REPEAT, "total_steps": steps, "save_interval": 100}})


def _train(config: RunConfig, kafka: KafkaClients) -> int:
    from streamrft.consumers.explorer import Explorer
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.consumers.trainer import Trainer

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, kafka, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, kafka, stop)).start()
    trainer = RoleThread("trainer", lambda stop: Trainer(config, kafka, stop)).start()
    try:
        wait_for(trainer, [worker, explorer], 240)
        wait_for(explorer, [worker], 60)
    finally:
        for role in (worker, explorer, trainer):
            role.stop.request()
        worker.join(60)
    return trainer.result


def _abort_a_transaction(config: RunConfig, kafka: KafkaClients) -> None:
    """A result and an experience written in a transaction that aborts: a read_committed reader never sees them,
    a read_uncommitted one (franz-go's and the Java client's default) does."""
    producer = kafka.producer(transactional_id=f"{config.name}.decoy")
    producer.init_transactions()
    producer.raw.begin_transaction()
    producer.produce(config.topic("results"), RolloutResult(request_id=DECOY, step=0, task_id=DECOY,
                                                            status=RolloutStatus.OK, n=1, model_version=0,
                                                            duration_ms=1))
    producer.produce(config.topic("experiences"), Experience(
        eid=f"{DECOY}/0", group_id=DECOY, task_id=DECOY, step=0, kind=RolloutKind.TRAIN, run_index=0,
        model_version=0, tokens=pack_i32([1, 2, 3]), prompt_length=2, logprobs=pack_f32([-1.0]), reward=0.0))
    producer.raw.flush(30)
    producer.raw.abort_transaction(30)
    producer.close()


@pytest.fixture(scope="module", params=["single-object", "confluent"])
def interop_run(request, interop_clients, contract_file, kafka_bootstrap, tiny_model_dir, tmp_path_factory):
    """One run per framing, fed by every client that could be built: produce → roll out and train → abort a
    decoy transaction → read back with Python and with each client."""
    framing = request.param
    built = {language: client for language, client in interop_clients.items() if isinstance(client, Client)}
    if not built:
        pytest.skip("; ".join(interop_clients.values()))
    registry_url = request.getfixturevalue("interop_registry").url if framing == "confluent" else None
    out = tmp_path_factory.mktemp(f"interop-{framing}")
    steps = GOOD_TASKS * len(built) // BATCH
    config = _config(f"interop{uuid.uuid4().hex[:8]}", kafka_bootstrap, tiny_model_dir, out, steps, registry_url)
    kafka = KafkaClients(config, kafka_bootstrap)
    kafka.ensure_topics()
    registry = {"registry": registry_url} if registry_url else {}
    began = time.monotonic()
    produced = {language: client.run("produce", bootstrap=kafka_bootstrap, topic=config.topic("tasks"),
                                     contract=contract_file, prefix=language, count=GOOD_TASKS,
                                     bad=BAD_TASKS[framing][language][0], **registry)
                for language, client in built.items()}
    trained = _train(config, kafka)
    _abort_a_transaction(config, kafka)
    results = read_all(config, kafka_bootstrap, "results", kafka.serde, RolloutResult, idle=0.5)
    experiences = read_all(config, kafka_bootstrap, "experiences", kafka.serde, Experience, idle=0.5)
    read_back = {language: client.run("consume", bootstrap=kafka_bootstrap, results=config.topic("results"),
                                      experiences=config.topic("experiences"), contract=contract_file,
                                      want_results=len(results), want_experiences=len(experiences), **registry)
                 for language, client in built.items()}
    print(f"\ninterop ({framing}): {', '.join(built)} produced, trained {trained} steps and read back in "
          f"{time.monotonic() - began:.1f} s; hamba/avro's own canonical form of Task matches the published "
          f"one: {produced['go']['library_canonical_form_matches'] if 'go' in produced else 'n/a'}")
    letters = {raw.key.decode(): {name.removeprefix("streamrft."): value.decode() for name, value in raw.headers}
               for raw in read_to_end(config.kafka, kafka_bootstrap, config.topic("tasks") + ".dlq")}
    tasks = {raw.key.decode(): raw for raw in read_to_end(config.kafka, kafka_bootstrap, config.topic("tasks"))}
    requests = read_all(config, kafka_bootstrap, "rollouts", kafka.serde, RolloutRequest, idle=0.5)
    kafka.close()
    return InteropRun(framing=framing, config=config, contract=json.loads(Path(contract_file).read_text()),
                      steps=steps, trained_steps=trained, produced=produced, tasks=tasks, requests=requests,
                      results=results, experiences=experiences, letters=letters, read_back=read_back)


def _client(interop_clients, language: str) -> Client:
    client = interop_clients[language]
    if isinstance(client, str):
        pytest.skip(client)
    return client


@pytest.mark.parametrize("language", LANGUAGES)
def test_its_tasks_are_rolled_out_and_trained_on(interop_run, interop_clients, language):
    _client(interop_clients, language)
    produced = interop_run.produced[language]
    assert produced["framing"] == interop_run.framing and len(produced["task_ids"]) == GOOD_TASKS
    for task_id in produced["task_ids"]:  # framed as the contract and the registry say
        value = interop_run.tasks[task_id].value
        if interop_run.framing == "confluent":
            assert value[0] == 0 and int.from_bytes(value[1:5], "big") == produced["schema_id"]
        else:
            assert value[:10].hex() == interop_run.contract["Task"]["header_hex"]
    rolled_out = {r.task.task_id: r.task for r in interop_run.requests}
    for task_id in produced["task_ids"]:
        task = rolled_out[task_id]  # a KeyError: the run never rolled this task out
        a, b = map(int, re.findall(r"\d+", json.loads(task.payload)["question"]))
        assert task.workflow == "arithmetic" and json.loads(task.payload)["answer"] == a + b
        samples = [e for e in interop_run.experiences if e.task_id == task_id]
        assert len(samples) == REPEAT and all(len(e.tokens) > 4 * e.prompt_length for e in samples)
    assert interop_run.trained_steps == interop_run.steps


@pytest.mark.parametrize("language", LANGUAGES)
def test_it_reads_results_and_experiences_as_python_does(interop_run, interop_clients, language):
    _client(interop_clients, language)
    back = interop_run.read_back[language]
    assert back["undecodable"] == []
    assert back["framings"] == {interop_run.framing: len(interop_run.results) + len(interop_run.experiences)}

    theirs = {r["request_id"]: r for r in back["results"]}
    assert DECOY not in theirs, "read an aborted transaction's record: the client is not reading read_committed"
    assert sorted(theirs) == sorted(r.request_id for r in interop_run.results) and len(back["results"]) == len(theirs)
    for result in interop_run.results:
        assert theirs[result.request_id] == {
            "request_id": result.request_id, "step": result.step, "task_id": result.task_id,
            "kind": result.kind.value, "status": result.status.value, "n": result.n,
            "reward_mean": pytest.approx(result.reward_mean), "model_version": result.model_version}

    experiences = {e["eid"]: e for e in back["experiences"]}
    assert sorted(experiences) == sorted(e.eid for e in interop_run.experiences)
    assert len(back["experiences"]) == len(experiences)
    for experience in interop_run.experiences:
        assert experiences[experience.eid] == {
            "eid": experience.eid, "group_id": experience.group_id, "task_id": experience.task_id,
            "step": experience.step, "kind": experience.kind.value, "run_index": experience.run_index,
            "model_version": experience.model_version, "tokens": unpack_i32(experience.tokens).tolist(),
            "prompt_length": experience.prompt_length,
            "logprobs": pytest.approx(unpack_f32(experience.logprobs).tolist(), rel=1e-6),
            "reward": pytest.approx(experience.reward), "objective": experience.objective.value}
    # real logprobs of a model, not a constant: the float32 unpacking is tested on varied values
    assert len({x for e in back["experiences"] for x in e["logprobs"]}) > 3


@pytest.mark.parametrize("language", LANGUAGES)
def test_its_bad_task_reaches_the_dlq_with_its_reason(interop_run, interop_clients, language):
    _client(interop_clients, language)
    kind, reason, stage, word = BAD_TASKS[interop_run.framing][language]
    produced = interop_run.produced[language]
    assert produced["bad"] == kind
    letter = interop_run.letters[produced["bad_task_id"]]
    print(f"\n{language}'s {kind} task: {letter['reason']} ({letter['error']})")
    assert (letter["reason"], letter["stage"]) == (reason, stage), letter
    assert word in letter["error"] and letter["source.topic"] == interop_run.config.topic("tasks")
    assert produced["bad_task_id"] not in {r.task.task_id for r in interop_run.requests}
