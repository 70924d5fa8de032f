"""The Kubernetes manifests agree with the run config, without a cluster: what `streamrft k8s` renders and the
committed compose/k8s/streamrft.yaml (the same thing, so it cannot drift), checked the way a cluster would
(names, selectors, ports, env) and against the config (topics, groups, KEDA bounds)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from streamrft.config import TOPIC_NAMES, load_config
from streamrft.deploy.kubernetes import render
from streamrft.errors import ConfigError

K8S = Path(__file__).resolve().parents[2] / "compose" / "k8s"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
KNOWN = {("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "Deployment"), ("batch/v1", "Job"),
         ("kafka.strimzi.io/v1beta2", "KafkaTopic"), ("keda.sh/v1alpha1", "ScaledObject"),
         ("monitoring.coreos.com/v1", "ServiceMonitor"), ("kafka.strimzi.io/v1beta2", "KafkaUser"),
         ("networking.k8s.io/v1", "NetworkPolicy")}
PROCESS_VARS = {"STREAMRFT_CACHE_DIR", "OMP_WAIT_POLICY"}  # read by the model cache / OpenMP, not config keys


@pytest.fixture(scope="module")
def config():
    return load_config(K8S / "run.yaml", env={})


@pytest.fixture(scope="module")
def manifests(config):
    return render(config, (K8S / "run.yaml").read_text())


def _by_kind(manifests, kind):
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def _pod_specs(manifests):
    for m in manifests:
        if m["kind"] in ("Deployment", "Job"):
            yield m, m["spec"]["template"]["spec"]


def test_the_committed_manifests_are_what_the_config_renders(manifests):
    assert list(yaml.safe_load_all((K8S / "streamrft.yaml").read_text())) == manifests, (
        "compose/k8s/streamrft.yaml is stale: streamrft k8s compose/k8s/run.yaml -o compose/k8s/streamrft.yaml")


def test_every_manifest_is_a_known_kind_with_a_valid_unique_name(manifests, config):
    seen = set()
    for m in manifests:
        assert (m["apiVersion"], m["kind"]) in KNOWN, m["kind"]
        name = m["metadata"]["name"]
        assert (DNS_SUBDOMAIN if m["kind"] in ("KafkaTopic", "KafkaUser") else DNS_LABEL).match(name), name
        assert m["metadata"]["namespace"] == config.kubernetes.namespace
        assert (m["kind"], name) not in seen
        seen.add((m["kind"], name))


def test_topics_are_the_runs_topics_with_their_layout(manifests, config):
    topics = {m["spec"]["topicName"]: m for m in _by_kind(manifests, "KafkaTopic").values()}
    names = {config.topic(n) for n in TOPIC_NAMES}
    assert set(topics) == names | {config.dlq_topic(n) for n in names}
    rollouts = topics[config.topic("rollouts")]
    assert rollouts["spec"]["partitions"] == config.topics.rollouts.partitions == 16
    assert rollouts["spec"]["replicas"] == 3
    assert topics[config.topic("sync")]["spec"]["config"]["cleanup.policy"] == "compact,delete"
    assert {m["metadata"]["labels"]["strimzi.io/cluster"] for m in topics.values()} == {"streamrft"}


def test_roles_run_their_command_on_the_config_with_real_config_keys(manifests, config):
    commands = {}
    for workload, pod in _pod_specs(manifests):
        (container,) = pod["containers"]
        commands[workload["metadata"]["labels"]["app.kubernetes.io/component"]] = container["command"]
        role = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        # a secret comes from a Secret, never as a value: the role's own KafkaUser's password, the rest from the
        # role's own Secret (test_kubernetes_security checks each secret field)
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert secrets["STREAMRFT_KAFKA__SASL_PASSWORD"] == {"name": f"demo.{role}", "key": "password"}
        assert {ref["name"] for name, ref in secrets.items() if name != "STREAMRFT_KAFKA__SASL_PASSWORD"} == {
            f"demo-{role}-secrets"}
        assert secrets["STREAMRFT_KAFKA__SASL_PASSWORD"]["name"] in _by_kind(manifests, "KafkaUser")
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e} | {
            "STREAMRFT_KAFKA__SASL_PASSWORD": "x"}
        # every STREAMRFT_* variable is a config key: loading the config with them applies each one
        config_env = {k: v for k, v in env.items() if k.startswith("STREAMRFT_") and k not in PROCESS_VARS}
        loaded = load_config(K8S / "run.yaml", env=config_env)
        assert loaded.kafka.bootstrap_servers == "streamrft-kafka-bootstrap:9092"
        assert loaded.kafka.sasl_username == f"demo.{role}" and loaded.kafka.sasl_mechanism == "SCRAM-SHA-512"
        assert loaded.metrics_host == "0.0.0.0"
        assert set(env) - set(config_env) <= PROCESS_VARS
        volumes = {v["name"] for v in pod["volumes"]}
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
        assert pod["volumes"][0]["configMap"]["name"] in _by_kind(manifests, "ConfigMap")
    assert commands == {"explorer": ["streamrft", "explorer", "/config/run.yaml"],
                        "rollout": ["streamrft", "rollout", "/config/run.yaml"],
                        "trainer": ["streamrft", "train", "/config/run.yaml"],
                        "monitor": ["streamrft", "monitor", "/config/run.yaml"]}
    (config_map,) = _by_kind(manifests, "ConfigMap").values()
    assert load_config(K8S / "run.yaml", env={}) == config  # the ConfigMap holds the file itself
    assert config_map["data"]["run.yaml"] == (K8S / "run.yaml").read_text()


def test_gpus_trainer_job_and_single_explorer(manifests, config):
    deployments, jobs = _by_kind(manifests, "Deployment"), _by_kind(manifests, "Job")
    trainer = jobs["demo-trainer"]["spec"]["template"]["spec"]
    assert trainer["restartPolicy"] == "OnFailure"
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == config.kubernetes.trainer_gpus
    explorer = jobs["demo-explorer"]["spec"]
    assert (explorer["parallelism"], explorer["completions"], explorer["podReplacementPolicy"]) == (1, 1, "Failed")
    rollout = deployments["demo-rollout"]["spec"]
    assert rollout["selector"]["matchLabels"].items() <= rollout["template"]["metadata"]["labels"].items()
    assert rollout["template"]["spec"]["initContainers"][0]["command"] == ["streamrft", "model", "prepare",
                                                                           "smollm2-135m"]


def test_services_and_monitors_reach_each_roles_metrics_port(manifests, config):
    services, monitors = _by_kind(manifests, "Service"), _by_kind(manifests, "ServiceMonitor")
    pods = {w["metadata"]["name"]: (w["spec"]["template"]["metadata"]["labels"], pod) for w, pod in
            _pod_specs(manifests)}
    ports = {"explorer": config.explorer.metrics_port, "rollout": config.rollout.metrics_port,
             "trainer": config.trainer.metrics_port, "monitor": config.monitor.metrics_port}
    for role, port in ports.items():
        service = services[f"demo-{role}"]
        labels, pod = pods[f"demo-{role}"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert pod["containers"][0]["ports"] == [{"name": "metrics", "containerPort": port}]
        assert service["spec"]["ports"][0] == {"name": "metrics", "port": port, "targetPort": "metrics"}
        monitor = monitors[f"demo-{role}"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_roles_restart_on_failure_as_streamrft_run_does_and_are_probed_on_their_metrics(manifests, config):
    """launch.restart's rule: a role that ends its work (explorer, trainer: exit 0) is restarted only after a
    failure; one that runs until stopped (monitor, rollout workers) always. The /metrics endpoint is the probe."""
    policies = {w["metadata"]["name"]: (w["kind"], pod["restartPolicy"]) for w, pod in _pod_specs(manifests)}
    assert policies == {"demo-explorer": ("Job", "OnFailure"), "demo-trainer": ("Job", "OnFailure"),
                        "demo-monitor": ("Deployment", "Always"), "demo-rollout": ("Deployment", "Always")}
    for workload, pod in _pod_specs(manifests):
        (container,) = pod["containers"]
        assert container["ports"] == [{"name": "metrics", "containerPort": container["ports"][0]["containerPort"]}]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, (workload, probe)
        # the model loads before the endpoint answers: minutes of start-up, then a minute of silence restarts it
        startup, liveness = container["startupProbe"], container["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 120
    # a role without an endpoint gets no probe that could never pass
    silent = config.model_copy(update={"monitor": config.monitor.model_copy(update={"metrics_port": None})})
    monitor = next(pod for w, pod in _pod_specs(render(silent, (K8S / "run.yaml").read_text()))
                   if w["metadata"]["name"] == "demo-monitor")
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & monitor["containers"][0].keys()


def test_keda_scales_the_rollout_workers_on_their_groups_lag_in_records():
    from streamrft.consumers.lag_gauges import LAG_GAUGE

    config = load_config(K8S / "run.yaml", overrides={"kubernetes": {"kafka_authentication": "none"}}, env={})
    manifests = render(config, "")
    (scaled,) = _by_kind(manifests, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] in _by_kind(manifests, "Deployment")
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"  # the monitor's records lag: KEDA's kafka scaler counts offsets
    metadata = trigger["metadata"]
    assert metadata["query"] == (f'sum({LAG_GAUGE}{{group="{config.consumer_group("rollout")}",'
                                 f'topic="{config.topic("rollouts")}"}})')
    assert config.consumer_group("rollout") == "demo.rollout"
    assert metadata["serverAddress"] == f"http://prometheus-operated.{config.kubernetes.monitoring_namespace}.svc:9090"
    assert metadata["threshold"] == str(config.kubernetes.rollout_lag_threshold)
    assert metadata["ignoreNullValues"] == "false"  # no series is not a lag of 0
    assert scaled["spec"]["maxReplicaCount"] == config.topics.rollouts.partitions


def test_configs_that_cannot_work_on_a_cluster_are_refused_with_what_to_change(config):
    with pytest.raises(ConfigError, match="rollout_max_replicas .* is more than topics.rollouts.partitions"):
        load_config(K8S / "run.yaml", overrides={"kubernetes": {"rollout_max_replicas": 17}}, env={})
    local = load_config(K8S / "run.yaml", overrides={"trainer": {"checkpoint_dir": "runs/x", "weights": {
        "url": "file:///tmp/w"}}}, env={})
    with pytest.raises(ConfigError) as err:
        render(local, "")
    assert "trainer.checkpoint_dir" in str(err.value) and "workers on other pods cannot read it" in str(err.value)
    secret = load_config(K8S / "run.yaml", overrides={"kafka": {"sasl_mechanism": "SCRAM-SHA-512",
                                                                "sasl_username": "u", "sasl_password": "hunter2"}},
                         env={})
    with pytest.raises(ConfigError, match="holds a secret") as err:
        render(secret, "")
    assert "hunter2" not in str(err.value)
    ranks = load_config(K8S / "run.yaml", overrides={"trainer": {"nproc": 4}}, env={})
    with pytest.raises(ConfigError, match="trainer.nproc is 4 but kubernetes.trainer_gpus is 1"):
        render(ranks, "")


def test_train_mode_deploys_the_trainer_alone(config):
    train = config.model_copy(update={"mode": "train"})
    kinds = {(m["kind"], m["metadata"]["name"]) for m in render(train, (K8S / "run.yaml").read_text())}
    assert ("Job", "demo-trainer") in kinds and ("Deployment", "demo-monitor") in kinds
    assert not {name for kind, name in kinds if name in ("demo-explorer", "demo-rollout")}  # no crash-looping roles
    assert "ScaledObject" not in {kind for kind, _ in kinds}


def test_explore_mode_deploys_no_trainer(config):
    explore = config.model_copy(update={"mode": "explore"})
    kinds = {(m["kind"], m["metadata"]["name"]) for m in render(explore, (K8S / "run.yaml").read_text())}
    assert ("Job", "demo-trainer") not in kinds and ("Job", "demo-explorer") in kinds


def test_every_role_has_a_kafka_user_with_exactly_the_acls_streamrft_derives(manifests, config):
    from streamrft.acls import role_acls

    users = _by_kind(manifests, "KafkaUser")
    assert set(users) == {f"demo.{role}" for role in ("explorer", "rollout", "trainer", "monitor", "tasks", "viewer")}
    operations = {"read": "Read", "write": "Write", "describe": "Describe", "describe_configs": "DescribeConfigs"}
    for name, user in users.items():
        assert user["metadata"]["labels"]["strimzi.io/cluster"] == config.kubernetes.kafka_cluster
        assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
        acls = user["spec"]["authorization"]["acls"]
        expected = [(acl.resource, acl.name, acl.pattern, operations[acl.operation])
                    for acl in role_acls(config, name.split(".", 1)[1])]
        assert [({"topic": "topic", "group": "group", "transactionalId": "transactional_id"}[a["resource"]["type"]],
                 a["resource"]["name"], {"literal": "literal", "prefix": "prefixed"}[a["resource"]["patternType"]],
                 a["operations"][0]) for a in acls] == expected
    sync = config.topic("sync")
    writers = {name for name, user in users.items() for a in user["spec"]["authorization"]["acls"]
               if a["resource"]["name"] == sync and "Write" in a["operations"]}
    assert writers == {"demo.trainer"}  # only the trainer publishes weights
    (scaled,) = _by_kind(manifests, "ScaledObject").values()
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"  # records lag from the monitor, whose user may read the run's topics
    monitor = {(a["resource"]["type"], a["resource"]["name"], a["resource"]["patternType"], a["operations"][0])
               for a in users["demo.monitor"]["spec"]["authorization"]["acls"]}
    assert {("topic", "rft.demo.", "prefix", "Read"), ("group", "demo.", "prefix", "Describe")} <= monitor
    assert not _by_kind(manifests, "TriggerAuthentication")


def test_tls_mounts_the_strimzi_cluster_ca_and_names_of_other_shapes_are_refused(config):
    tls = load_config(K8S / "run.yaml", overrides={"kubernetes": {"kafka_tls": True}}, env={})
    manifests = render(tls, "")
    for _, pod in _pod_specs(manifests):
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["STREAMRFT_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
        assert env["STREAMRFT_KAFKA__SSL_CA_LOCATION"] == "/kafka-ca/ca.crt"
        assert {"name": "kafka-ca", "secret": {"secretName": "streamrft-cluster-ca-cert"}} in pod["volumes"]
    named = load_config(K8S / "run.yaml", overrides={"name": "Demo_Run"}, env={})
    with pytest.raises(ConfigError, match="KafkaUser is named"):
        render(named, "")
