"""A run on a shared, secured cluster: the embedded broker with SASL/SCRAM (and once over TLS), a principal per
role with only the ACLs `streamrft acls` derives, the loop end to end that way, Kafka's refusals told as
streamrft errors, and a wrong password refused at start without being shown."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from streamrft.acls import principal_name, role_acls
from streamrft.broker import EmbeddedBroker
from streamrft.config import EmbeddedBrokerConfig, load_config
from streamrft.consumers.explorer import Explorer
from streamrft.consumers.monitor import Monitor
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.credentials import Credential, write_credential
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.errors import AuthenticationError, AuthorizationError
from streamrft.kafka import KafkaClients
from streamrft.kafka.security import principal_acls
from streamrft.principals import provision
from streamrft.schemas import Experience, Metric, RolloutKind, RolloutRequest, SyncKind, SyncMethod, SyncSignal

from .roles import RoleThread, produce_tasks, read_all, wait_for

pytestmark = [pytest.mark.kafka]


@pytest.fixture(scope="module", params=["sasl_scram", "sasl_scram_tls"])
def secure_broker(request, tmp_path_factory):
    config = EmbeddedBrokerConfig(security=request.param)
    with EmbeddedBroker(config, data_dir=tmp_path_factory.mktemp(f"kafka-{request.param}")) as broker:
        yield broker


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory):
    with EmbeddedBroker(EmbeddedBrokerConfig(security="sasl_scram"),
                        data_dir=tmp_path_factory.mktemp("kafka-sasl")) as broker:
        yield broker


class SecuredRun:
    """A run on a secured broker: its admin's clients, and a config and clients per role principal."""

    def __init__(self, broker: EmbeddedBroker, directory: Path, **overrides):
        self.name = f"s{uuid.uuid4().hex[:8]}"
        self.overrides = overrides
        self.admin_config = load_config(overrides={"name": self.name, **overrides}, env={}).on_cluster(
            broker.bootstrap_servers, broker.security.admin)
        self.admin = KafkaClients(self.admin_config, broker.bootstrap_servers)
        self.admin.ensure_topics()
        self.files = provision(self.admin, directory)
        self.bootstrap = broker.bootstrap_servers
        self._clients: list[KafkaClients] = [self.admin]

    def config(self, role: str):
        return load_config(overrides={"name": self.name, **self.overrides,
                                      "kafka": {"bootstrap_servers": self.bootstrap,
                                                "credentials_file": str(self.files[role])}}, env={})

    def clients(self, role: str) -> KafkaClients:
        clients = KafkaClients(self.config(role), self.bootstrap)
        self._clients.append(clients)
        return clients

    def close(self) -> None:
        for clients in self._clients:
            clients.close()


@pytest.mark.model
def test_the_loop_runs_with_a_principal_per_role_and_only_the_acls_streamrft_derives(secure_broker, tiny_model_dir,
                                                                                     tmp_path):
    steps = 2
    run = SecuredRun(secure_broker, tmp_path / "credentials",
                     model={"path": str(tiny_model_dir)},
                     explorer={"batch_size": 2, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
                     rollout={"engine": "fake", "metrics_port": None},
                     trainer={"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None, "device": "cpu",
                              "total_steps": steps, "micro_batch_size": 8},
                     monitor={"output_dir": str(tmp_path / "out"), "metrics_port": None, "tensorboard": False})
    try:
        # the cluster holds exactly the derived ACLs for each principal, nothing more
        for role in run.files:
            held = {(b.restype.name.lower(), b.name, b.resource_pattern_type.name.lower(), b.operation.name.lower(),
                     b.permission_type.name, b.host)
                    for b in principal_acls(run.admin.admin(), "User:" + principal_name(run.admin_config, role))}
            derived = {(a.resource, a.name, a.pattern, a.operation, "ALLOW", "*")
                       for a in role_acls(run.admin_config, role)}
            assert held == derived, role
        produce_tasks(run.clients("tasks"), run.config("tasks"), make_arithmetic_tasks(2 * steps, seed=1))
        roles = {
            "worker": RoleThread("worker", lambda stop: RolloutWorker(run.config("rollout"), run.clients("rollout"),
                                                                      stop, "w0")).start(),
            "explorer": RoleThread("explorer", lambda stop: Explorer(run.config("explorer"), run.clients("explorer"),
                                                                     stop)).start(),
            "trainer": RoleThread("trainer", lambda stop: Trainer(run.config("trainer"), run.clients("trainer"),
                                                                  stop)).start(),
            "monitor": RoleThread("monitor", lambda stop: Monitor(run.config("monitor"), run.clients("monitor"),
                                                                  stop)).start(),
        }
        helpers = [roles["worker"], roles["explorer"], roles["monitor"]]
        wait_for(roles["trainer"], helpers, 240)
        wait_for(roles["explorer"], [roles["worker"], roles["monitor"]], 60)
        for name in ("worker", "monitor"):
            roles[name].stop.request()
            roles[name].join(60)
        assert roles["trainer"].result == steps and roles["explorer"].result.done
        assert roles["monitor"].role.exported > 0
        trained = {m.step for m in read_all(run.admin_config, run.bootstrap, "metrics", run.admin.serde, Metric)
                   if m.role == "trainer" and m.name == "actor/loss"}
        assert trained == set(range(steps))
    finally:
        run.close()


def _refusal(action) -> str:
    with pytest.raises(AuthorizationError) as info:
        action()
    return str(info.value)


def test_each_principal_is_refused_what_its_role_may_not_do_with_a_message_that_says_why(sasl_broker, tmp_path):
    run = SecuredRun(sasl_broker, tmp_path / "credentials")
    other = SecuredRun(sasl_broker, tmp_path / "other-credentials")
    config, name = run.admin_config, run.name
    signal = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=1, method=SyncMethod.OBJECT_STORE)
    try:
        tasks = run.clients("tasks")

        def write(clients, topic: str, record) -> None:
            producer = clients.producer()
            producer.produce(config.topic(topic), record)
            producer.flush(30)

        def read(clients, topic: str, group: str, record_type) -> None:
            consumer = clients.consumer([config.topic(topic)], record_type, group, dead_letters=False)
            try:
                for _ in range(60):
                    consumer.poll(timeout=0.5)
            finally:
                consumer.close()

        # a task producer: not sync, not experiences, cannot read experiences nor join the rollout group
        message = _refusal(lambda: write(tasks, "sync", signal))
        assert f"Kafka denied User:{name}.tasks WRITE on topic {config.topic('sync')}" in message
        assert f"kafka-acls --add --allow-principal User:{name}.tasks --operation Write --topic " \
               f"{config.topic('sync')}" in message
        assert f"that is for User:{name}.trainer;" in message  # only the trainer publishes weights
        assert "TOPIC_AUTHORIZATION_FAILED" in message
        message = _refusal(lambda: write(tasks, "experiences", Experience(
            eid="e/0", group_id="e", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0, model_version=0, tokens=b"\0" * 8,
            prompt_length=1, logprobs=b"\0" * 4, reward=0.0)))
        assert f"WRITE on topic {config.topic('experiences')}" in message
        message = _refusal(lambda: read(tasks, "experiences", config.consumer_group("trainer"), Experience))
        assert f"User:{name}.tasks READ on group {config.consumer_group('trainer')}" in message  # the group is checked first
        message = _refusal(lambda: tasks.offsets(config.topic("experiences")))  # and without a group, the topic
        assert f"User:{name}.tasks DESCRIBE on topic {config.topic('experiences')}" in message
        message = _refusal(lambda: read(tasks, "rollouts", config.consumer_group("rollout"), RolloutRequest))
        assert f"User:{name}.tasks READ on group {config.consumer_group('rollout')}" in message
        # a rollout worker may not publish weights
        message = _refusal(lambda: write(run.clients("rollout"), "sync", signal))
        assert f"User:{name}.rollout WRITE on topic {config.topic('sync')}" in message
        # a second run's principals cannot touch this run's topics
        message = _refusal(lambda: write(other.clients("trainer"), "sync", signal))
        assert f"User:{other.name}.trainer WRITE on topic {config.topic('sync')}" in message
        assert "No role of this run is allowed that" in message  # run B's ACLs hold nothing of run A
        message = _refusal(lambda: read(other.clients("rollout"), "rollouts", config.consumer_group("rollout"),
                                        RolloutRequest))
        assert f"User:{other.name}.rollout READ on group {config.consumer_group('rollout')}" in message
        # and a transactional id of this run's is not theirs either
        message = _refusal(lambda: other.clients("trainer").producer(transactional_id=f"{name}.trainer")
                           .init_transactions(10))
        assert f"WRITE on transactional id {name}.trainer" in message
    finally:
        run.close()
        other.close()


def test_a_wrong_password_fails_at_start_and_is_never_shown(sasl_broker, tmp_path):
    run = SecuredRun(sasl_broker, tmp_path / "credentials")
    wrong = "not-the-password-4f1c9e"
    path = write_credential(tmp_path / "wrong.json", Credential.model_validate({
        "username": principal_name(run.admin_config, "explorer"), "password": wrong}))
    config = load_config(overrides={"name": run.name, "kafka": {"bootstrap_servers": run.bootstrap,
                                                                "credentials_file": str(path)}}, env={})
    try:
        with pytest.raises(AuthenticationError) as info:
            KafkaClients(config, run.bootstrap).check_credentials(timeout=15)
        assert f"user '{run.name}.explorer'" in str(info.value) and wrong not in str(info.value)
        # the same from the command line, as a role would start: exit 2, the reason, no password
        env = {"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": run.bootstrap, "STREAMRFT_KAFKA__CREDENTIALS_FILE": str(path),
               "STREAMRFT_NAME": run.name, "PATH": "/usr/bin:/bin"}
        done = subprocess.run([sys.executable, "-m", "streamrft.cli", "topics"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "refused the credentials" in done.stderr and wrong not in done.stdout + done.stderr
    finally:
        run.close()


def test_credentials_files_are_private(sasl_broker, tmp_path):
    run = SecuredRun(sasl_broker, tmp_path / "credentials")
    try:
        assert (tmp_path / "credentials").stat().st_mode & 0o777 == 0o700
        for path in run.files.values():
            assert path.stat().st_mode & 0o777 == 0o600
            assert set(json.loads(path.read_text())) >= {"username", "password", "security_protocol"}
        shared = next(iter(run.files.values()))
        shared.chmod(0o644)
        with pytest.raises(Exception, match="chmod 600"):
            load_config(overrides={"kafka": {"credentials_file": str(shared)}}, env={})
    finally:
        run.close()
