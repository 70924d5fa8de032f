"""The compose stack agrees with the code: no Docker needed. Every STREAMRFT_* variable is a real config key,
ports match the config defaults, Prometheus scrapes services that exist on the ports they serve, and the Grafana
dashboard only queries metric names the monitor exports."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from streamrft.config import RunConfig, env_overrides, load_config
from streamrft.consumers.monitor import PrometheusExport, Row
from streamrft.rollout_stats import eval_metrics, step_metrics
from streamrft.schemas import RolloutResult, RolloutStatus

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
ROLES = {"explorer": "explorer", "rollout": "rollout", "trainer": "train", "monitor": "monitor"}  # service: command
# STREAMRFT_* variables that are process settings, not config keys (read by the CLI and the model cache).
PROCESS_VARS = {"STREAMRFT_CACHE_DIR", "STREAMRFT_LOG_LEVEL"}
CONFIG_KEYS = set(RunConfig.model_fields) | {"topic_prefix"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _host_port(address: str) -> tuple[str, int]:
    address = re.sub(r"^[A-Za-z_]+://", "", address)
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _published(service: dict) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for spec in service.get("ports", []):
        host, container = str(spec).split("/")[0].rsplit(":", 2)[-2:]
        out[int(container)] = int(host)
    return out


def _exposed(service: dict) -> set[int]:
    return {int(str(p).split("/")[0]) for p in service.get("expose", [])} | set(_published(service))


def test_services_and_role_commands(services):
    assert {"kafka", "schema-registry", "kafka-ui", "prometheus", "grafana", *ROLES} <= set(services)
    for name, command in ROLES.items():
        service = services[name]
        assert service["command"] == ["streamrft", command, "/config/run.yaml"], name
        assert "./run.yaml:/config/run.yaml:ro" in service["volumes"]
        assert any(v.startswith("shared:") for v in service["volumes"]), f"{name} lacks the shared volume"
        assert (COMPOSE / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)


def test_roles_share_cores_as_streamrft_run_sets_them(services):
    from streamrft.commands.run import SHARED_CORES_ENV

    for name in ROLES:
        env = _env(services[name])
        assert {k: env.get(k) for k in SHARED_CORES_ENV} == SHARED_CORES_ENV, name


def test_rollout_scales(services):
    rollout = services["rollout"]
    assert "container_name" not in rollout and "ports" not in rollout  # replicas would collide


def test_every_streamrft_variable_is_a_real_config_key(services):
    seen = 0
    for name, service in services.items():
        env = _env(service)
        config_env = {k: v for k, v in env.items() if k.startswith("STREAMRFT_") and k not in PROCESS_VARS}
        if not config_env:
            continue
        overrides = env_overrides(config_env)
        for var, value in config_env.items():
            path = var.removeprefix("STREAMRFT_").lower().split("__")
            assert path[0] in CONFIG_KEYS, f"{name}: {var} names no config section (would be ignored)"
            node = overrides
            for part in path:
                node = node[part]
        # validates (unknown keys are errors) and the values arrive where the variable says
        config = load_config(COMPOSE / "run.yaml", env=config_env)
        for var, value in config_env.items():
            node = config
            for part in var.removeprefix("STREAMRFT_").lower().split("__"):
                node = getattr(node, part)
            assert str(node) == value, f"{name}: {var}"
            seen += 1
    assert seen >= 4 * len(ROLES)


def test_a_misspelt_variable_would_be_caught():
    from streamrft.errors import ConfigError

    with pytest.raises(ConfigError, match="bootstrap_server"):
        load_config(COMPOSE / "run.yaml", env={"STREAMRFT_KAFKA__BOOTSTRAP_SERVER": "kafka:29092"})


def test_kafka_listeners_match_the_roles_bootstrap(services):
    kafka = _env(services["kafka"])
    advertised = dict(item.split("://", 1) for item in kafka["KAFKA_ADVERTISED_LISTENERS"].split(","))
    listeners = dict(item.split("://", 1) for item in kafka["KAFKA_LISTENERS"].split(","))
    protocols = dict(item.split(":") for item in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) == set(protocols) and set(advertised) <= set(listeners)
    in_network = [name for name, address in advertised.items() if _host_port(address)[0] == "kafka"]
    assert len(in_network) == 1
    bootstrap = advertised[in_network[0]]
    assert _host_port(listeners[in_network[0]])[1] == _host_port(bootstrap)[1]
    for name in ROLES:
        assert _env(services[name])["STREAMRFT_KAFKA__BOOTSTRAP_SERVERS"] == bootstrap, name
    assert _host_port(_env(services["schema-registry"])["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"]) == \
        _host_port(bootstrap)
    assert _env(services["kafka-ui"])["KAFKA_CLUSTERS_0_BOOTSTRAPSERVERS"] == bootstrap
    # the host listener is published on the same port it advertises
    host = [address for address in advertised.values() if _host_port(address)[0] == "localhost"]
    assert host and _published(services["kafka"])[_host_port(host[0])[1]] == _host_port(host[0])[1]
    assert _host_port(kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@", 1)[1]) == \
        ("kafka", _host_port(listeners[kafka["KAFKA_CONTROLLER_LISTENER_NAMES"]])[1])
    assert len(base64.urlsafe_b64decode(kafka["CLUSTER_ID"] + "==")) == 16
    # experiences need the bigger message size the config gives their topic
    assert int(kafka["KAFKA_MESSAGE_MAX_BYTES"]) >= RunConfig().topics.experiences.max_message_bytes


def test_schema_registry_and_kafka_ui(services):
    registry = _env(services["schema-registry"])
    port = _host_port(registry["SCHEMA_REGISTRY_LISTENERS"])[1]
    url = f"http://schema-registry:{port}"
    for name in ROLES:
        assert _env(services[name])["STREAMRFT_SCHEMA_REGISTRY__URL"] == url
    assert _env(services["kafka-ui"])["KAFKA_CLUSTERS_0_SCHEMAREGISTRY"] == url
    assert services["kafka-ui"]["image"].startswith("kafbat/kafka-ui")
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["schema-registry"]["image"].startswith("confluentinc/cp-schema-registry:")


def test_metrics_ports_agree_with_the_config(services):
    defaults = RunConfig()
    stack = load_config(COMPOSE / "run.yaml", env={})
    expected = {"explorer": 9101, "rollout": 9102, "trainer": 9103, "monitor": 9100}
    for name, port in expected.items():
        assert getattr(defaults, name).metrics_port == port
        assert getattr(stack, name).metrics_port == port
        assert port in _exposed(services[name]), f"{name} does not expose its metrics port {port}"


def test_roles_serve_metrics_to_other_containers_and_only_there(services):
    """Prometheus scrapes from its own container, so the roles bind every interface inside the stack; outside
    it (the same run.yaml without the stack's environment) they stay on loopback."""
    assert RunConfig().metrics_host == "127.0.0.1"
    assert load_config(COMPOSE / "run.yaml", env={}).metrics_host == "127.0.0.1"
    for name in ROLES:
        env = {k: v for k, v in _env(services[name]).items() if k not in PROCESS_VARS}
        assert load_config(COMPOSE / "run.yaml", env=env).metrics_host == "0.0.0.0", name


def test_prometheus_scrapes_every_role_where_it_serves(services):
    config = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = _host_port(target)
                scraped[host] = port
        for dns in job.get("dns_sd_configs", []):
            for host in dns["names"]:
                scraped[host] = dns["port"]
    assert set(ROLES) <= set(scraped), f"not scraped: {set(ROLES) - set(scraped)}"
    for host, port in scraped.items():
        assert host in services, f"scrape target {host} is not a service"
        assert port in _exposed(services[host]), f"{host} does not serve port {port}"
    # a scaled service must be found by DNS, not by one static name
    assert any("rollout" in dns["names"] for job in config["scrape_configs"] for dns in job.get("dns_sd_configs", []))


def _published_metric_names() -> set[str]:
    """Metric names the roles publish: the literals in the code that builds them (the roles' files), plus the
    computed eval names."""
    root = COMPOSE.parent
    sources = [*(root / "consumers").rglob("*.py"), *(root / "engines" / "training").glob("*.py"),
               root / "streamrft" / "rollout_stats.py"]
    pattern = re.compile(r'"((?:rollout|rollout_worker|actor|trainer|time)/[A-Za-z0-9_]+)"')
    names = {name for path in sources for name in pattern.findall(path.read_text())}
    result = RolloutResult("r", 0, "t", RolloutStatus.OK, n=4, model_version=0, duration_ms=10, reward_mean=0.5)
    return names | set(step_metrics([result], 1, 0, 1)) | set(eval_metrics("arithmetic", [result], 4))


def _monitor_exported_names() -> set[str]:
    """Names on the monitor's Prometheus endpoint once the roles have published their metrics."""
    registry = CollectorRegistry()
    export = PrometheusExport(registry)
    for name in _published_metric_names():
        export.update(Row(1, "role", "source", name, 1.0, 0))
    export.records.labels(outcome="exported").inc()
    return {sample.name for family in registry.collect() for sample in family.samples}


def test_grafana_provisioning_and_dashboard_queries(services):
    grafana = services["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./"))
    datasources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    source = datasources["datasources"][0]
    host, port = _host_port(source["url"])
    assert host == "prometheus" and port in _exposed(services["prometheus"])
    providers = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/streamrft.yml").read_text())
    dashboards_in_container = providers["providers"][0]["options"]["path"]
    assert mounts["./grafana/dashboards"] == dashboards_in_container
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"

    dashboard = json.loads((COMPOSE / "grafana/dashboards/streamrft.json").read_text())
    exported = _monitor_exported_names()
    queries = [(p["title"], t) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 8
    for title, target in queries:
        assert target["datasource"]["uid"] == source["uid"], title
        expr = target["expr"]
        for pattern in re.findall(r'__name__=~"([^"]+)"', expr):
            assert any(re.fullmatch(pattern, name) for name in exported), f"{title}: {pattern} matches nothing"
        names = set(re.findall(r"\b(streamrft_[A-Za-z0-9_]+)", re.sub(r'"[^"]*"', '""', expr)))
        unknown = names - exported
        assert not unknown, f"{title}: the monitor exports no {sorted(unknown)}"
    used = {name for _, t in queries for name in re.findall(r"\b(streamrft_[A-Za-z0-9_]+)", t["expr"])}
    for core in ("streamrft_rollout_reward_mean", "streamrft_rollout_accuracy", "streamrft_actor_pg_loss",
                 "streamrft_actor_kl", "streamrft_rollout_staleness", "streamrft_time_step_s",
                 "streamrft_time_train_step"):
        assert core in used


def test_run_yaml_loads_and_writes_to_the_shared_volume(services):
    config = load_config(COMPOSE / "run.yaml", env={})
    assert config.kafka.embedded  # the cluster comes from the environment, not the file
    env = {k: v for k, v in _env(services["trainer"]).items() if k not in PROCESS_VARS}
    stack = load_config(COMPOSE / "run.yaml", env=env)
    shared = next(v.split(":")[1] for v in services["trainer"]["volumes"] if v.startswith("shared:"))
    assert stack.weights_url.startswith(f"file://{shared}/")
    for path in (stack.output_dir, stack.checkpoint_dir):
        assert Path(path).is_relative_to(shared), path
    assert _env(services["trainer"])["STREAMRFT_CACHE_DIR"].startswith(shared)
    assert stack.topics.rollouts.partitions >= 4  # room for `--scale rollout=4`


# -- the secured stack (docker-compose.secure.yml, layered on the base file) -------------------------------------


def _merged_env(*services: dict) -> dict[str, str]:
    """A service's environment as `docker compose -f base -f secure` merges it (later files win per key)."""
    out: dict[str, str] = {}
    for service in services:
        out.update(_env(service))
    return out


def test_the_secured_stack_gives_every_role_its_own_principal_and_only_the_admin_the_rest(services):
    from streamrft.acls import ROLES as ACL_ROLES, principal_name

    secure = yaml.safe_load((COMPOSE / "docker-compose.secure.yml").read_text())["services"]
    run = load_config(COMPOSE / "run.yaml", env={})
    files = {}
    for name in (*ROLES, "tasks"):
        env = _merged_env(services[name], secure[name])
        # every STREAMRFT_* variable is a real key, and the merged environment loads with the file given
        assert set(env_overrides({k: v for k, v in env.items() if k not in PROCESS_VARS})) <= CONFIG_KEYS
        files[name] = env["STREAMRFT_KAFKA__CREDENTIALS_FILE"]
        assert secure[name]["depends_on"]["principals"]["condition"] == "service_completed_successfully"
        assert "STREAMRFT_KAFKA__SASL_PASSWORD" not in env  # the roles read their credentials file
    # each role's file is the one `streamrft acls --create-users /credentials` writes for its principal
    assert files == {name: f"/credentials/{principal_name(run, name)}.json" for name in files}
    assert set(files) <= set(ACL_ROLES)
    principals = secure["principals"]
    assert principals["command"][2].startswith("streamrft acls /config/run.yaml --apply --create-users /credentials ")
    assert set(env_overrides(_env(principals))) <= CONFIG_KEYS
    assert _env(principals)["STREAMRFT_KAFKA__SASL_USERNAME"] == "admin"
    assert "${STREAMRFT_ADMIN_PASSWORD" in _env(principals)["STREAMRFT_KAFKA__SASL_PASSWORD"]  # never a literal
    broker = _merged_env(services["kafka"], secure["kafka"])
    assert broker["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert broker["KAFKA_SUPER_USERS"] == "User:admin"
    assert broker["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    listeners = {name.split(":")[0] for name in broker["KAFKA_LISTENERS"].split(",")}
    protocols = dict(item.split(":") for item in broker["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(protocols) == listeners and set(protocols.values()) == {"SASL_PLAINTEXT"}
    assert "." not in run.name  # prefixed ACLs tell runs apart only without dots in the name


def test_each_role_of_the_secured_stack_mounts_only_its_own_credentials_file(services):
    """No volume holds everyone's credentials files where every role can read them: the principals service moves
    each file into a directory of its own, and a role mounts that directory alone, read-only."""
    from streamrft.acls import principal_name

    secure = yaml.safe_load((COMPOSE / "docker-compose.secure.yml").read_text())
    run = load_config(COMPOSE / "run.yaml", env={})
    assert "credentials" in secure["volumes"]
    script = secure["services"]["principals"]["command"][2]
    # each /credentials/<principal>.json goes to /credentials/<principal>/ (compose turns $$ into $)
    assert 'dir="$${file%.json}"' in script and 'mv "$$file" "$$dir/"' in script
    assert "credentials:/credentials" in secure["services"]["principals"]["volumes"]
    for name in (*ROLES, "tasks"):
        principal = principal_name(run, name)
        mounts = [v for v in services[name].get("volumes", []) + secure["services"][name]["volumes"]
                  if (v["source"] if isinstance(v, dict) else v.split(":")[0]) == "credentials"]
        assert mounts == [{"type": "volume", "source": "credentials", "target": "/credentials", "read_only": True,
                           "volume": {"subpath": principal}}], name
        credentials_file = _merged_env(services[name], secure["services"][name])["STREAMRFT_KAFKA__CREDENTIALS_FILE"]
        assert credentials_file == f"/credentials/{principal}.json"
        # the shared volume every role mounts holds no credentials any more
        shared = [v for v in services[name].get("volumes", []) if isinstance(v, str) and v.startswith("shared:")]
        assert all("credentials" not in v for v in shared)
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert "chown streamrft:streamrft /shared /credentials" in dockerfile  # the volume starts writable by the user
