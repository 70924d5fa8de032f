"""The security of a run on Kubernetes, read off the rendered manifests: every pod locked down, what each role
writes on a volume, ingress denied but for what must reach a role, each role's secrets from its own Secret and
never from the ConfigMap, the trainer's checkpoints on a claim of their own."""
from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from streamrft.config import load_config
from streamrft.deploy.k8s_secrets import env_name, secret_fields
from streamrft.deploy.kubernetes import render
from streamrft.errors import ConfigError

K8S = Path(__file__).resolve().parents[2] / "compose" / "k8s"
SECRET_VALUE = "s3cr3t-value-0123456789"
# a judge reached over HTTP, so the secret fields of auxiliary_models' entries are walked too
JUDGE = {"auxiliary_models": {"judge": {"engine": "openai", "model": "m", "base_url": "http://judge:8000/v1"}}}
# what a secret needs beside it to be a valid config
COMPANIONS = {("trainer", "weights", "s3", "secret_access_key"): {
    "trainer": {"weights": {"url": "s3://bucket/weights", "s3": {"access_key_id": "AKIAEXAMPLE"}}}}}


@pytest.fixture(scope="module")
def config():
    return load_config(K8S / "run.yaml", overrides=JUDGE, env={})


@pytest.fixture(scope="module")
def manifests(config):
    return render(config, (K8S / "run.yaml").read_text())


def _pods(manifests):
    for m in manifests:
        if m["kind"] in ("Deployment", "Job"):
            yield m["metadata"]["labels"]["app.kubernetes.io/component"], m["spec"]["template"]


def _containers(pod):
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def _nested(path, value):
    for part in reversed(path):
        value = {part: value}
    return value


def _merge(a, b):
    return {k: _merge(a[k], b[k]) if isinstance(a.get(k), dict) and isinstance(b.get(k), dict) else b.get(k, a.get(k))
            for k in a.keys() | b.keys()}


def test_every_pod_and_container_is_locked_down(manifests, config):
    uid = config.kubernetes.run_as_user
    pods = list(_pods(manifests))
    assert {role for role, _ in pods} == {"explorer", "rollout", "trainer", "monitor"}
    for role, pod in pods:
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, role
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                                           "seccompProfile": {"type": "RuntimeDefault"}}, role
        for container in _containers(pod):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] == uid != 0, (role, container["name"])
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            assert "privileged" not in context


def _writable(pod, container):
    """The paths ``container`` may write: its mounts that are not read-only, each backed by a volume."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    paths = {}
    for mount in container["volumeMounts"]:
        assert mount["name"] in volumes, mount
        if not mount.get("readOnly"):
            paths[PurePosixPath(mount["mountPath"])] = volumes[mount["name"]]
    return paths


def _on(paths, path):
    path = PurePosixPath(path)
    return next((volume for mount, volume in paths.items() if path == mount or mount in path.parents), None)


def test_what_each_role_writes_is_on_a_volume_with_a_read_only_root(manifests, config):
    home = "/home/streamrft"  # compose/Dockerfile's user: torch, triton and vLLM cache under it
    for role, pod in _pods(manifests):
        for container in _containers(pod):
            paths = _writable(pod, container)
            env = {e["name"]: e.get("value") for e in container["env"]}
            writes = ["/tmp", home, env["STREAMRFT_CACHE_DIR"]]
            if role in ("rollout", "trainer"):
                writes.append("/dev/shm")  # NCCL and vLLM's workers; the runtime's default is 64 MiB
            if container["name"] == "trainer":
                writes += [str(config.checkpoint_dir), config.weights_url.removeprefix("file://")]
            if container["name"] == "monitor":
                writes.append(str(config.output_dir))
            for path in writes:
                assert _on(paths, path) is not None, f"{role}/{container['name']} writes {path} on its read-only root"
            assert "emptyDir" in _on(paths, "/tmp") and "emptyDir" in _on(paths, home)


def test_the_trainers_checkpoints_are_on_a_claim_of_their_own(manifests, config):
    k8s = config.kubernetes
    assert k8s.checkpoint_volume_claim != k8s.shared_volume_claim
    claims = {role: {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                     if "persistentVolumeClaim" in v} for role, pod in _pods(manifests)}
    assert [role for role, names in claims.items() if k8s.checkpoint_volume_claim in names] == ["trainer"]
    trainer = dict(_pods(manifests))["trainer"]
    volume = _on(_writable(trainer, trainer["spec"]["containers"][0]), config.checkpoint_dir)
    assert volume["persistentVolumeClaim"]["claimName"] == k8s.checkpoint_volume_claim
    shared = load_config(K8S / "run.yaml", overrides={"trainer": {"checkpoint_dir": "/shared/runs/x"}}, env={})
    with pytest.raises(ConfigError, match="trainer.checkpoint_dir is /shared/runs/x: put it under /checkpoints/"):
        render(shared, "")


def _policies(manifests):
    return {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "NetworkPolicy"}


def test_ingress_is_denied_but_for_prometheus_on_the_metrics_port(manifests, config):
    policies = _policies(manifests)
    assert set(policies) == {"demo-deny-ingress", "demo-allow-metrics"}  # object_store weights: no pod-to-pod
    for role, pod in _pods(manifests):  # every policy selects every pod of the run, and only them
        for spec in policies.values():
            assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
            assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == config.name
            assert spec["policyTypes"] == ["Ingress"]
        assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["metrics"], role
    assert policies["demo-deny-ingress"]["ingress"] == []
    (rule,) = policies["demo-allow-metrics"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": config.kubernetes.monitoring_namespace}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]


def test_collective_weights_let_the_runs_own_pods_reach_each_other(config):
    collective = load_config(K8S / "run.yaml", overrides={"trainer": {"weights": {"method": "collective"}}}, env={})
    policies = _policies(render(collective, ""))
    (rule,) = policies["demo-allow-collective"]["ingress"]
    assert rule == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "streamrft",
                                                                "app.kubernetes.io/instance": "demo"}}}]}


def test_the_walk_finds_every_secret_field(config):
    found = set(secret_fields(config))
    assert {("kafka", "sasl_password"), ("schema_registry", "basic_auth_user_info"),
            ("trainer", "weights", "s3", "secret_access_key"), ("serve", "api_key"),
            ("rollout", "openai", "api_key"), ("auxiliary_models", "judge", "api_key")} <= found


def test_each_role_reads_only_its_own_secrets_and_no_shared_one(manifests):
    for role, pod in _pods(manifests):
        container = pod["spec"]["containers"][0]
        assert "envFrom" not in container  # a Secret of everyone's keys, as before
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
        assert refs == {f"demo.{role}", f"demo-{role}-secrets"}, role
        mounted = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        assert mounted <= {"streamrft-cluster-ca-cert"}  # the cluster CA only, public
    prefixed = load_config(K8S / "run.yaml", overrides={"kubernetes": {"secret": "creds"}}, env={})
    for role, pod in _pods(render(prefixed, "")):
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e}
        assert refs == {f"demo.{role}", f"creds-{role}"}


@pytest.mark.parametrize("path", secret_fields(load_config(K8S / "run.yaml", overrides=JUDGE, env={})),
                         ids=lambda path: ".".join(path))
def test_every_secret_field_is_refused_from_the_config_map_and_comes_from_a_secret(path, config, manifests):
    companion = COMPANIONS.get(path, {})
    in_file = load_config(K8S / "run.yaml", overrides=_merge(_merge(JUDGE, companion), _nested(path, SECRET_VALUE)),
                          env={})
    with pytest.raises(ConfigError) as err:
        render(in_file, "")
    assert ".".join(path) in str(err.value) and env_name(path) in str(err.value)
    assert SECRET_VALUE not in str(err.value)
    # the variable a Secret supplies is a real config key: set through it, the config holds the secret
    from_env = load_config(K8S / "run.yaml", overrides=_merge(JUDGE, companion), env={env_name(path): SECRET_VALUE})
    value = from_env
    for part in path:
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    assert value.get_secret_value() == SECRET_VALUE
    # the roles that read it get it from a secretKeyRef into their own Secret, never as a value in a manifest
    readers = []
    for role, pod in _pods(manifests):
        for container in _containers(pod):
            entries = [e for e in container["env"] if e["name"] == env_name(path)]
            assert all("value" not in e for e in entries)
            for entry in entries:
                ref = entry["valueFrom"]["secretKeyRef"]
                assert ref["name"] in (f"demo.{role}", f"demo-{role}-secrets")
                readers.append(role)
    if path[0] != "serve":  # serve is not deployed on Kubernetes
        assert readers, f"no role reads {'.'.join(path)}"
    (config_map,) = [m for m in manifests if m["kind"] == "ConfigMap"]
    assert path[-1] not in config_map["data"]["run.yaml"]


def test_collective_weights_share_the_group_secret_between_the_trainer_and_the_workers_only():
    collective = load_config(K8S / "run.yaml", overrides={"trainer": {"weights": {"method": "collective"}}}, env={})
    name = env_name(("trainer", "weights", "group_secret"))
    readers = {}
    for role, pod in _pods(render(collective, "")):
        entries = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == name]
        if entries:
            (entry,) = entries
            readers[role] = entry["valueFrom"]["secretKeyRef"]
    assert readers == {role: {"name": "demo-weight-sync", "key": "group_secret"} for role in ("trainer", "rollout")}
    # an object store needs no group: nobody reads it from the shared Secret
    for role, pod in _pods(render(load_config(K8S / "run.yaml", env={}), "")):
        refs = [e["valueFrom"]["secretKeyRef"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e]
        assert all(ref["name"] != "demo-weight-sync" for ref in refs), role
