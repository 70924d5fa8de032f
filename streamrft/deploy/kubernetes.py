"""The Kubernetes manifests of a run, rendered from its config so that the two cannot disagree.

What a run gets (``kubernetes`` section of the config for the cluster-side names):

* the run config as a ConfigMap, mounted at ``/config/run.yaml`` in every role; cluster addresses come as
  ``STREAMRFT_*`` variables, secrets from each role's own Secret (``k8s_secrets``: a config file that holds
  one is refused, never written into the manifests);
* with ``trainer.weights.method: collective``, the trainer and the rollout workers take
  ``trainer.weights.group_secret`` (which admits members to the weight-sync group) from one Secret only those two
  roles read, ``<run>-weight-sync`` (key ``group_secret``), that the operator creates once:
  ``kubectl create secret generic <run>-weight-sync --from-literal=group_secret="$(openssl rand -base64 32)"``;
  the pods do not start without it (a group anyone who reaches the trainer could join is not deployed);
* each pod locked down (``k8s_security``): non-root, read-only root filesystem with scratch emptyDirs, no
  privilege escalation or capabilities, seccomp RuntimeDefault, no service-account token; NetworkPolicies that
  deny ingress to the run's pods but for Prometheus and, for collective weights, the run's own pods;
* a Strimzi ``KafkaTopic`` for each of the run's topics and dead-letter topics, partitions and topic configs from
  ``topics`` (the roles' own ``ensure_topics`` then finds them in place);
* the roles restarted as ``streamrft run`` restarts them (``launch.restart``): after a failure, never after a clean
  end. The explorer and the trainer end their work (exit 0), so each is a one-pod Job (``OnFailure``: a restarted
  explorer resumes from its state record, a restarted trainer from its checkpoint; ``podReplacementPolicy:
  Failed``: never two explorers of one run); the monitor and the rollout workers run until stopped, so they are
  Deployments (``Always``). The trainer has ``trainer_gpus`` GPUs. A role with a ``metrics_port`` is probed on its
  ``/metrics`` endpoint: a startup probe that allows for loading the model, then liveness (restart it) and
  readiness;
* the rollout workers as a Deployment scaled by a KEDA ``ScaledObject`` on the ``<run>.rollout`` group's lag on
  ``rollouts`` in records (a worker per ``kubernetes.rollout_lag_threshold``; at most the topic's partitions,
  since a worker beyond them gets no partition): KEDA's ``prometheus`` scaler on the monitor's
  ``streamrft_consumer_group_lag_records`` (``consumers/lag_gauges.py``), through the Prometheus operator's
  ``prometheus-operated`` service in ``kubernetes.monitoring_namespace``. KEDA's own ``kafka`` scaler counts
  offsets, so every idle partition of a transactional topic would show a lag of 1 (its last commit marker) and
  hold a worker up; with ``kafka_authentication`` the monitor's user may read the run's topics to count;
* a Service and a ``ServiceMonitor`` per role for the Prometheus operator, on the role's ``metrics_port``;
* with ``kafka_authentication: scram-sha-512``, a Strimzi ``KafkaUser`` per role (``<run>.<role>``, SCRAM, the
  ACLs of ``streamrft acls``): each role connects as its own user, its password from the Secret the User Operator
  writes. With
  ``kafka_tls`` the roles trust the Strimzi cluster CA (``<cluster>-cluster-ca-cert``).

Files the roles share -- the model cache, the monitor's output, and weights published through a ``file://`` URL --
live on the ReadWriteMany claim ``kubernetes.shared_volume_claim`` mounted at ``/shared``; the trainer's
checkpoints on a claim of their own (``kubernetes.checkpoint_volume_claim`` at ``/checkpoints``, mounted by the
trainer alone). A config that puts them anywhere else is refused with what to change (a pod's own disk is gone
when it moves).
"""
from __future__ import annotations

import re
from typing import Any

from ..acls import principal_name, role_acls
from ..config import RunConfig
from ..errors import ConfigError
from .k8s_secrets import env_name, role_secret_env, secret_problems
from .k8s_security import (container_security, network_policies, pod_security, scratch_mounts,
                           scratch_volumes)

SHARED = "/shared"
CHECKPOINTS = "/checkpoints"
CONFIG_PATH = "/config/run.yaml"
STRIMZI = "kafka.strimzi.io/v1beta2"
# role (also the name of its config section) -> the streamrft command that runs it
ROLES = {"explorer": "explorer", "rollout": "rollout", "trainer": "train", "monitor": "monitor"}
# the roles whose clean exit (0) means their work is done: restarted only after a failure, as `streamrft run` does
ENDS_ITS_WORK = ("explorer", "trainer")
# the roles that get a KafkaUser: the deployed ones, task producers, and a read-only viewer (Kafka UI)
ACL_ROLES = ("explorer", "rollout", "trainer", "monitor", "tasks", "viewer")


def render(config: RunConfig, config_text: str) -> list[dict[str, Any]]:
    """Every manifest of the run, in apply order; ``config_text`` is the run config file as written."""
    check_deployable(config)
    k8s = config.kubernetes
    out: list[dict[str, Any]] = [_config_map(config, config_text)]
    out += [_kafka_topic(config, name, layout) for name, layout in config.topic_layouts().items()]
    roles = config.shape.roles
    for role in ROLES:
        if role not in roles:
            continue
        out.append(_workload(config, role))
        if _metrics_port(config, role) is not None:
            out += [_service(config, role), _service_monitor(config, role)]
    if _authenticated(config):
        out += [_kafka_user(config, role) for role in ACL_ROLES]
    if "rollout" in roles:
        out.append(_scaled_object(config))
    out += network_policies(config, _labels(config), lambda what: resource_name(config, what))
    for manifest in out:
        manifest["metadata"].setdefault("namespace", k8s.namespace)
    return out


def check_deployable(config: RunConfig) -> None:
    """ConfigError, with what to change, for a config whose roles could not find each other's files."""
    problems = []
    if not str(config.checkpoint_dir).startswith(CHECKPOINTS + "/"):
        problems.append(f"trainer.checkpoint_dir is {config.checkpoint_dir}: put it under {CHECKPOINTS}/ (the "
                        "trainer's own claim), or a restarted trainer cannot resume")
    url = config.trainer.weights.url
    if config.trainer.weights.method == "object_store" and (not url or url.startswith("file://")):
        path = config.weights_url.removeprefix("file://")
        if not path.startswith(SHARED + "/"):
            problems.append(f"trainer.weights.url is {config.weights_url}: workers on other pods cannot read it; "
                            f"use an object store (s3://...) or a file:// URL under {SHARED}/")
    gpus, nproc = config.kubernetes.trainer_gpus, config.trainer.nproc
    if gpus and nproc != gpus:
        problems.append(f"trainer.nproc is {nproc} but kubernetes.trainer_gpus is {gpus}: the trainer pod runs one "
                        "rank per GPU; set them equal")
    if _authenticated(config) and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", config.name):
        problems.append(f"name {config.name!r}: with kafka_authentication each role's KafkaUser is named "
                        "<name>.<role>, a Kubernetes name: use lowercase letters, digits and '-'")
    problems += secret_problems(config, role_secret(config, "<role>"))
    if problems:
        raise ConfigError("cannot deploy this run on Kubernetes:\n- " + "\n- ".join(problems))


def _labels(config: RunConfig, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "streamrft", "app.kubernetes.io/instance": config.name}
    if role is not None:
        labels["app.kubernetes.io/component"] = role
    return labels


def role_secret(config: RunConfig, role: str) -> str:
    """The Secret only ``role`` reads its secret keys from."""
    prefix = config.kubernetes.secret
    return f"{prefix}-{role}" if prefix else resource_name(config, f"{role}-secrets")


def resource_name(config: RunConfig, what: str) -> str:
    """``<run>-<what>`` as a DNS label (run names may hold '.' and '_')."""
    return f"{config.name}-{what}".lower().replace(".", "-").replace("_", "-")


def _config_map(config: RunConfig, config_text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": resource_name(config, "config"), "labels": _labels(config)},
            "data": {"run.yaml": config_text}}


def _kafka_topic(config: RunConfig, name: str, layout) -> dict[str, Any]:
    spec: dict[str, Any] = {"partitions": layout.partitions, "config": layout.kafka_config()}
    if layout.replication_factor > 0:  # else the cluster's default.replication.factor
        spec["replicas"] = layout.replication_factor
    return {"apiVersion": STRIMZI, "kind": "KafkaTopic",
            "metadata": {"name": name.lower().replace("_", "-"),
                         "labels": {**_labels(config), "strimzi.io/cluster": config.kubernetes.kafka_cluster}},
            "spec": {"topicName": name, **spec}}


def bootstrap_servers(config: RunConfig) -> str:
    k8s = config.kubernetes
    return f"{k8s.kafka_cluster}-kafka-bootstrap:{k8s.kafka_listener_port}"


def _environment(config: RunConfig, role: str | None = None) -> list[dict[str, Any]]:
    """The environment of ``role``'s containers; with authentication, its own user and password."""
    env = {"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": bootstrap_servers(config),
           "STREAMRFT_METRICS_HOST": "0.0.0.0",  # scraped from other pods
           "STREAMRFT_CACHE_DIR": f"{SHARED}/cache",
           "OMP_WAIT_POLICY": "PASSIVE"}
    secret: list[dict[str, Any]] = []
    if role is not None and _authenticated(config):
        user = principal_name(config, role)
        env.update({"STREAMRFT_KAFKA__SECURITY_PROTOCOL": "SASL_SSL" if config.kubernetes.kafka_tls
                    else "SASL_PLAINTEXT", "STREAMRFT_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
                    "STREAMRFT_KAFKA__SASL_USERNAME": user})
        secret = [{"name": "STREAMRFT_KAFKA__SASL_PASSWORD",
                   "valueFrom": {"secretKeyRef": {"name": user, "key": "password"}}}]
        if config.kubernetes.kafka_tls:
            env["STREAMRFT_KAFKA__SSL_CA_LOCATION"] = f"{KAFKA_CA}/ca.crt"
    if role is not None:
        secret += _weight_sync_secret_env(config, role)
        secret += role_secret_env(config, role, role_secret(config, role), skip=frozenset(e["name"] for e in secret))
    return [{"name": key, "value": value} for key, value in env.items()] + secret


WEIGHT_SYNC_ROLES = ("trainer", "rollout")


def weight_sync_secret(config: RunConfig) -> str:
    """The Secret the trainer and the workers share for collective weights: ``group_secret``."""
    return resource_name(config, "weight-sync")


def _weight_sync_secret_env(config: RunConfig, role: str) -> list[dict[str, Any]]:
    """``trainer.weights.group_secret`` for the members of a collective weight-sync group; not optional, so a
    pod without the Secret does not start (Kubernetes names the missing Secret in the pod's events)."""
    if config.trainer.weights.method != "collective" or role not in WEIGHT_SYNC_ROLES:
        return []
    return [{"name": env_name(("trainer", "weights", "group_secret")),
             "valueFrom": {"secretKeyRef": {"name": weight_sync_secret(config), "key": "group_secret"}}}]


def _metrics_port(config: RunConfig, role: str) -> int | None:
    return getattr(config, role).metrics_port


def _container(config: RunConfig, role: str) -> dict[str, Any]:
    k8s = config.kubernetes
    container: dict[str, Any] = {
        "name": role, "image": k8s.image, "command": ["streamrft", ROLES[role], CONFIG_PATH],
        "env": _environment(config, role),
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True},
                         {"name": "shared", "mountPath": SHARED}, *scratch_mounts(role)],
        "securityContext": container_security(config),
    }
    if role == "trainer":
        container["volumeMounts"].append({"name": "checkpoints", "mountPath": CHECKPOINTS})
    if _authenticated(config) and k8s.kafka_tls:
        container["volumeMounts"].append({"name": "kafka-ca", "mountPath": KAFKA_CA, "readOnly": True})
    port = _metrics_port(config, role)
    if port is not None:
        container["ports"] = [{"name": "metrics", "containerPort": port}]
        container.update(_probes())
    gpus = {"trainer": k8s.trainer_gpus, "rollout": k8s.rollout_gpus}.get(role, 0)
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return container


def _probes() -> dict[str, Any]:
    """The role's ``/metrics`` endpoint as its probes: up within 10 minutes (a model to load), then restarted
    after a minute without an answer, and out of its Service while it does not answer."""
    metrics = {"httpGet": {"path": "/metrics", "port": "metrics"}, "timeoutSeconds": 5}
    return {"startupProbe": {**metrics, "periodSeconds": 10, "failureThreshold": 60},
            "livenessProbe": {**metrics, "periodSeconds": 20, "failureThreshold": 3},
            "readinessProbe": {**metrics, "periodSeconds": 10, "failureThreshold": 3}}


def _pod(config: RunConfig, role: str, restart: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": restart,
        # a role that gets SIGTERM finishes its unit of work and commits (compose: stop_grace_period)
        "terminationGracePeriodSeconds": 60,
        **pod_security(config),
        "containers": [_container(config, role)],
        "volumes": [{"name": "config", "configMap": {"name": resource_name(config, "config")}},
                    {"name": "shared", "persistentVolumeClaim": {"claimName": config.kubernetes.shared_volume_claim}},
                    *scratch_volumes(role)],
    }
    if role == "trainer":
        spec["volumes"].append({"name": "checkpoints", "persistentVolumeClaim": {
            "claimName": config.kubernetes.checkpoint_volume_claim}})
    if _authenticated(config) and config.kubernetes.kafka_tls:
        spec["volumes"].append({"name": "kafka-ca", "secret": {"secretName": _cluster_ca(config)}})
    if role in ("rollout", "trainer") and not config.model.path.startswith("/"):
        spec["initContainers"] = [{  # the model into the shared cache once; a no-op when it is there
            "name": "model", "image": config.kubernetes.image,
            "command": ["streamrft", "model", "prepare", config.model.path],
            "env": _environment(config), "securityContext": container_security(config),
            "volumeMounts": [{"name": "shared", "mountPath": SHARED}, *scratch_mounts(role)]}]
    return {"metadata": {"labels": _labels(config, role)}, "spec": spec}


def _workload(config: RunConfig, role: str) -> dict[str, Any]:
    name = resource_name(config, role)
    if role in ENDS_ITS_WORK:
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "labels": _labels(config, role)},
                "spec": {"backoffLimit": 10, "parallelism": 1, "completions": 1, "podReplacementPolicy": "Failed",
                         "template": _pod(config, role, "OnFailure")}}
    replicas = config.kubernetes.rollout_min_replicas if role == "rollout" else 1
    strategy = {"type": "RollingUpdate"} if role == "rollout" else {"type": "Recreate"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": _labels(config, role)},
            "spec": {"replicas": replicas, "strategy": strategy,
                     "selector": {"matchLabels": _labels(config, role)},
                     "template": _pod(config, role, "Always")}}


def _service(config: RunConfig, role: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": resource_name(config, role), "labels": _labels(config, role)},
            "spec": {"clusterIP": "None", "selector": _labels(config, role),
                     "ports": [{"name": "metrics", "port": _metrics_port(config, role), "targetPort": "metrics"}]}}


def _service_monitor(config: RunConfig, role: str) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": resource_name(config, role), "labels": _labels(config, role)},
            "spec": {"selector": {"matchLabels": _labels(config, role)},
                     "endpoints": [{"port": "metrics", "interval": "15s"}]}}


def _scaled_object(config: RunConfig) -> dict[str, Any]:
    k8s = config.kubernetes
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": resource_name(config, "rollout"), "labels": _labels(config, "rollout")},
            "spec": {
                "scaleTargetRef": {"name": resource_name(config, "rollout")},
                "minReplicaCount": k8s.rollout_min_replicas,
                "maxReplicaCount": k8s.rollout_max_replicas or config.topics.rollouts.partitions,
                "triggers": [_prometheus_trigger(config)]}}


def _prometheus_trigger(config: RunConfig) -> dict[str, Any]:
    """The rollout group's records lag as the monitor exports it; a missing series is an error (KEDA keeps the
    replicas), not a lag of 0."""
    k8s = config.kubernetes
    query = (f'sum(streamrft_consumer_group_lag_records{{group="{config.consumer_group("rollout")}",'
             f'topic="{config.topic("rollouts")}"}})')
    return {"type": "prometheus",
            "metadata": {"serverAddress": f"http://prometheus-operated.{k8s.monitoring_namespace}.svc:9090",
                         "query": query, "threshold": str(k8s.rollout_lag_threshold),
                         "activationThreshold": "0", "ignoreNullValues": "false"}}


# -- authentication: a KafkaUser per role ----------------------------------------------------------------------
KAFKA_CA = "/kafka-ca"
# streamrft.acls names -> Strimzi's
_STRIMZI_RESOURCE = {"topic": "topic", "group": "group", "transactional_id": "transactionalId"}
_STRIMZI_PATTERN = {"literal": "literal", "prefixed": "prefix"}
_STRIMZI_OPERATION = {"read": "Read", "write": "Write", "describe": "Describe", "describe_configs": "DescribeConfigs"}


def _authenticated(config: RunConfig) -> bool:
    return config.kubernetes.kafka_authentication != "none"


def _cluster_ca(config: RunConfig) -> str:
    return f"{config.kubernetes.kafka_cluster}-cluster-ca-cert"


def _kafka_user(config: RunConfig, role: str) -> dict[str, Any]:
    """``role``'s Strimzi KafkaUser: SCRAM-SHA-512 (the User Operator writes its password to a Secret of the same
    name) and exactly the ACLs of ``streamrft acls``."""
    acls = [{"resource": {"type": _STRIMZI_RESOURCE[acl.resource], "name": acl.name,
                          "patternType": _STRIMZI_PATTERN[acl.pattern]},
             "operations": [_STRIMZI_OPERATION[acl.operation]], "host": "*"}
            for acl in role_acls(config, role)]
    return {"apiVersion": STRIMZI, "kind": "KafkaUser",
            "metadata": {"name": principal_name(config, role),
                         "labels": {**_labels(config, role), "strimzi.io/cluster": config.kubernetes.kafka_cluster}},
            "spec": {"authentication": {"type": "scram-sha-512"},
                     "authorization": {"type": "simple", "acls": acls}}}
