"""How the run's pods are locked down on Kubernetes: who they run as, what they may write, who may reach them.

* Every pod and container runs as the image's non-root user (``kubernetes.run_as_user``), with no privilege
  escalation, every capability dropped, the runtime's default seccomp profile and no service-account token
  (the roles never call the Kubernetes API).
* The root filesystem is read-only. What the roles write goes to volumes: ``/tmp`` and ``$HOME`` (caches of
  torch, triton and vLLM) on emptyDirs, ``/dev/shm`` in memory for the GPU roles (NCCL, vLLM's workers), the
  model cache, weights and monitor output on the shared claim, and the trainer's checkpoints on a claim of
  their own.
* A NetworkPolicy denies all ingress to the run's pods; others let in Prometheus (the ``metrics`` port, from
  ``kubernetes.monitoring_namespace``) and, with ``trainer.weights.method: collective``, the run's own pods to
  each other (NCCL picks its ports at run time). Egress is open: the roles reach Kafka, the registry and the
  object store wherever they run.
"""
from __future__ import annotations

from typing import Any

from ..config import RunConfig

HOME = "/home/streamrft"  # the image's user's home (compose/Dockerfile)
# the roles whose engines share memory between processes through /dev/shm
_GPU_ROLES = ("rollout", "trainer")


def pod_security(config: RunConfig) -> dict[str, Any]:
    """The pod-level fields: the user every container runs as, seccomp, no service-account token."""
    uid = config.kubernetes.run_as_user
    return {"automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                                "seccompProfile": {"type": "RuntimeDefault"}}}


def container_security(config: RunConfig) -> dict[str, Any]:
    """A container's ``securityContext``: non-root, read-only root, no escalation, no capabilities."""
    return {"runAsNonRoot": True, "runAsUser": config.kubernetes.run_as_user,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def scratch_volumes(role: str) -> list[dict[str, Any]]:
    """The emptyDirs a role writes to with its root filesystem read-only."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]
    if role in _GPU_ROLES:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    return volumes


def scratch_mounts(role: str) -> list[dict[str, Any]]:
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": HOME}]
    if role in _GPU_ROLES:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return mounts


def network_policies(config: RunConfig, labels: dict[str, str], name) -> list[dict[str, Any]]:
    """Default-deny ingress for the run's pods (``labels`` select them), then what must reach them."""
    policies = [_policy(name("deny-ingress"), labels, []),
                _policy(name("allow-metrics"), labels, [{
                    "from": [{"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": config.kubernetes.monitoring_namespace}}}],
                    "ports": [{"protocol": "TCP", "port": "metrics"}]}])]
    if config.trainer.weights.method == "collective":
        policies.append(_policy(name("allow-collective"), labels, [{"from": [{"podSelector": {
            "matchLabels": dict(labels)}}]}]))
    return policies


def _policy(name: str, labels: dict[str, str], ingress: list[dict]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": dict(labels)},
            "spec": {"podSelector": {"matchLabels": dict(labels)}, "policyTypes": ["Ingress"], "ingress": ingress}}
