"""A Prometheus scrape config for a run's roles (``streamrft monitor CONFIG --prometheus-config FILE``): one job
per role that serves ``/metrics``, on the ports its config gives, as ``streamrft run`` starts them on this
machine (rollout worker i on ``launch.rollout_metrics_port_base + i``), and ``streamrft run`` itself (job
``launch``: role restarts and roles up, on ``launch.metrics_port``). compose/prometheus/prometheus.yml is the
same for the compose stack, where the roles are found by service name."""
from __future__ import annotations

from typing import Any

from streamrft.config import RunConfig

SCRAPE_INTERVAL = "5s"
ANY_INTERFACE = ("0.0.0.0", "::", "")


def _target(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ANY_INTERFACE else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def role_ports(config: RunConfig) -> dict[str, list[int]]:
    """Role (or ``launch``) -> the ports its processes serve /metrics on (a fixed port only: 0 or none is not
    scrapable)."""
    ports: dict[str, list[int]] = {}
    roles = config.shape.roles
    for role, settings in (("explorer", config.explorer), ("trainer", config.trainer), ("monitor", config.monitor)):
        if role in roles and settings.metrics_port:
            ports[role] = [settings.metrics_port]
    if "rollout" in roles:
        base = config.launch.rollout_metrics_port_base
        workers = range(config.launch.rollout_workers)
        ports["rollout"] = ([base + i for i in workers] if base
                            else [config.rollout.metrics_port] if config.rollout.metrics_port else [])
    if config.launch.metrics_port:  # streamrft run itself: the restarts of the roles it supervises
        ports["launch"] = [config.launch.metrics_port]
    return {role: found for role, found in ports.items() if found}


def scrape_config(config: RunConfig) -> dict[str, Any]:
    """The prometheus.yml content (a mapping) for ``config``'s roles on ``config.metrics_host``."""
    jobs = [{"job_name": role,
             "static_configs": [{"targets": [_target(config.metrics_host, port) for port in ports],
                                 "labels": {"run": config.name}}]}
            for role, ports in role_ports(config).items()]
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": jobs}
