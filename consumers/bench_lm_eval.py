"""``streamrft bench --lm-eval TASKS``: lm-evaluation-harness tasks on each version the bench evaluates, as
columns ``lm_eval/<task>/<metric>`` of its table.

Each version is served as ``streamrft serve`` serves it (the serve role and its HTTP app, on loopback, on a free
port, behind a key this process makes up) in a namespace of its own (the run's name + ``-lm-eval``: its own
topics and groups, none of which it writes). Its serving loop does not follow that namespace's ``sync`` but the
versions this module announces to it, oldest first, each a WEIGHTS_PUBLISHED of the bench's store (the run's, or
with ``--checkpoints`` the bench's store of checkpoint versions); it loads each between requests through its own
weight follower, the path and checks (manifest, sha256, lineage) of a published version, before lm-eval starts
on it. Version 0 is the model the server is built with. lm-eval's ``local-completions`` then scores the tasks in
its default, tokenized mode with the served model's tokenizer.

Nothing is learnt from the evaluation: serve writes an experience only for a ``POST /feedback``, which nobody but
this process could send (the key), and it keeps one completion for feedback at a time (``serve.max_pending`` 1),
so a long evaluation holds no memory for it.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from streamrft.config import RunConfig
from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.model_paths import resolve_model_path
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.weights.follower import FollowedWeights

from .bench import bench_config

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lm-eval[api]' (in the dev extra: pip install -e '.[dev]')"
LOOPBACK = "127.0.0.1"
RESERVED_ARGS = ("model", "base_url", "header", "tokenizer_backend")  # what points lm-eval at this server

Progress = Callable[[int, int, str], None]  # (versions done, versions, what happens now)


def require_lm_eval():
    """lm-eval's evaluator, or a ConfigError that says how to install it."""
    try:
        import lm_eval
        from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: F401 - needs the api extra
    except ImportError as exc:
        raise ConfigError(f"--lm-eval needs lm-evaluation-harness with its API models ({exc.name} is missing): "
                          f"{INSTALL_HINT}") from None
    return lm_eval


def lm_eval_config(config: RunConfig, api_key: str, weights_url: str | None = None) -> RunConfig:
    """The lm-eval namespace of a run: the bench's settings and weights store (``weights_url``: the store of
    checkpoint versions), its own topics and groups, and a server on loopback behind ``api_key``."""
    bench = bench_config(config, weights_url)
    serve = config.serve.model_copy(update={
        "host": LOOPBACK, "port": 0, "api_key": SecretStr(api_key), "tls_cert": None, "tls_key": None,
        "server_id": None, "max_pending": 1})
    prefix = config.topic_prefix_override
    return bench.model_copy(update={"name": f"{config.name}-lm-eval", "serve": serve,
                                    "topic_prefix_override": None if prefix is None else f"{prefix}lm-eval."})


def parse_model_args(text: str | None) -> dict:
    """``--lm-eval-args``: more arguments of lm-eval's ``local-completions`` (``num_concurrent=8,batch_size=4``);
    those that point it at this server are refused."""
    if not text:
        return {}
    from lm_eval.utils import simple_parse_args_string

    extra = simple_parse_args_string(text)
    taken = [key for key in extra if key in RESERVED_ARGS]
    if taken:
        raise ConfigError(f"--lm-eval-args: {', '.join(taken)} is set by the bench (it points lm-eval at the "
                          f"server of each version); leave out {', '.join(RESERVED_ARGS)}")
    return extra


def task_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results as bench columns ``lm_eval/<task>/<metric>``: every numeric metric of the tasks and
    groups asked for (a group's subtasks are in its aggregate); a metric under a filter other than lm-eval's
    ``none`` keeps lm-eval's own name for the pair, ``<metric>,<filter>``."""
    entries = {**results.get("results", {}), **results.get("groups", {})}
    inside = {child for children in results.get("group_subtasks", {}).values() for child in children}
    columns = {}
    for task, values in entries.items():
        if task in inside:
            continue
        for key, value in values.items():
            metric, comma, kept = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # its alias, or a stderr lm-eval could not compute ("N/A")
            columns[f"lm_eval/{task}/{metric if kept == 'none' else key}"] = float(value)
    return columns


def check_tasks(tasks: list[str], include: Path | None):
    """lm-eval's task manager (with ``include``'s tasks); ConfigError naming the tasks it does not know."""
    from lm_eval.tasks import TaskManager

    if include is not None and not include.exists():
        raise ConfigError(f"--lm-eval-include {include}: no such file or directory; give a folder of lm-eval "
                          "task YAML files")
    manager = TaskManager(include_path=str(include) if include is not None else None)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        where = f" nor in {include}" if include is not None else " (a task of your own: --lm-eval-include DIR)"
        raise ConfigError(f"--lm-eval: lm-eval knows no task {', '.join(unknown)} among its own{where}")
    return manager


class Announced:
    """The versions the lm-eval server is given, as its weight follower reads a view of ``sync``: the newest
    WEIGHTS_PUBLISHED announced (None: the model it was built with)."""

    def __init__(self) -> None:
        self.weights: SyncSignal | None = None

    @property
    def version(self) -> int:
        return self.weights.version if self.weights is not None else 0


class LmEvalBench:
    """The server of the lm-eval namespace and the versions it is given, one after another."""

    def __init__(self, config: RunConfig, bootstrap: str, weights_url: str | None = None, *,
                 timeout_s: float = 1800):
        from .serve.role import ServeRole

        self.api_key = secrets.token_urlsafe(32)
        self.config = lm_eval_config(config, self.api_key, weights_url)
        self.timeout_s = timeout_s
        self.announced = Announced()
        self.clients = KafkaClients(self.config, bootstrap)
        self.role = self.server = self._thread = None
        try:
            self.clients.ensure_topics()
            self.role = ServeRole(self.config, self.clients, StopSignal(signals=()))
            # the serving loop swaps to what is announced here, on its own thread, between requests, as it
            # swaps to what the trainer publishes
            self.role.serving.weights = FollowedWeights(self.role.weights, self.announced, self.role.stop)
            self.role.start()
            self._serve()
        except BaseException:
            self.close()
            raise
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{LOOPBACK}:{port}"

    def _serve(self) -> None:
        from .serve.http_server import http_server

        self.server = server = http_server(self.role)
        self._thread = thread = threading.Thread(target=server.run, name="lm-eval-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the lm-eval server did not start within 60 s; see the log above")
            time.sleep(0.05)

    def serve_version(self, version: int, published: dict[int, tuple[str, str]], lineage: str) -> None:
        """Announce ``version`` (0: the base model, served from the start) and wait until the server serves
        it; raises when it refuses the version or has not loaded it within the bench's timeout."""
        if version == self.role.version:
            return
        if version < self.role.version:
            raise ValueError(f"lm-eval: v{version} after v{self.role.version}; versions go oldest first")
        uri, sha256 = published[version]
        signal = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE,
                            uri=uri, sha256=sha256, source="bench", lineage=lineage)
        self.announced.weights = signal
        deadline = time.monotonic() + self.timeout_s
        while self.role.version != version:
            if self.role.weights.refusals.final(signal):
                raise RuntimeError(f"lm-eval: the server refused v{version} (the log above says why)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"lm-eval: the server has not loaded v{version} after {self.timeout_s:.0f}s "
                                   "(--timeout-s); is the weights store reachable from here?")
            time.sleep(0.05)

    def model(self, extra: dict):
        """lm-eval's ``local-completions`` pointed at this server, tokenizing with the served model's tokenizer
        and sending no prompt longer than the server takes."""
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        engine, role = self.role.engine, self.role
        longest = role.max_prompt_tokens + 1  # lm-eval keeps one token of max_length to generate
        if engine.max_model_len:
            longest = min(longest, engine.max_model_len)
        arguments = {"max_length": longest, "tokenizer": str(resolve_model_path(self.config.model.path)), **extra}
        return LocalCompletionsAPI(model=role.model_name, base_url=f"{self.base_url}/v1/completions",
                                   tokenizer_backend="huggingface",
                                   header={"Authorization": f"Bearer {self.api_key}"}, **arguments)

    def close(self) -> None:
        """Stop what was started, newest first."""
        if self.server is not None:
            self.server.should_exit = True
            self._thread.join(10)
        if self.role is not None:
            self.role.close()
        self.clients.close()


@dataclass(frozen=True)
class LmEvalPlan:
    """What ``--lm-eval`` asks, checked before the bench starts (lm-eval installed, its tasks known, its
    arguments): ``limit`` documents of each task (a number below 1: that share of it)."""

    tasks: list[str]
    manager: Any  # lm-eval's TaskManager, with the included tasks
    limit: float | None = None
    model_args: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tasks: list[str], include: Path | None = None, limit: float | None = None,
           model_args: str | None = None) -> "LmEvalPlan":
        if not tasks:
            raise ConfigError("--lm-eval: name at least one lm-eval task (comma-separated)")
        require_lm_eval()
        return cls(tasks, check_tasks(tasks, include), limit, parse_model_args(model_args))

    def run(self, config: RunConfig, versions: list[int], published: dict[int, tuple[str, str]], lineage: str, *,
            bootstrap: str, weights_url: str | None = None, timeout_s: float = 1800,
            progress: Progress | None = None) -> dict[int, dict[str, float]]:
        """The tasks on each of ``versions`` (as :class:`streamrft.consumers.bench.Bench` takes them: 0 the base
        model, any other ``published[version]`` = (manifest uri, sha256) under ``lineage``);
        ``{version: {column: value}}``."""
        lm_eval = require_lm_eval()
        report = progress or (lambda done, total, what: None)
        report(0, len(versions), "starting the lm-eval server")
        bench = LmEvalBench(config, bootstrap, weights_url, timeout_s=timeout_s)
        scores: dict[int, dict[str, float]] = {}
        try:
            model = bench.model(self.model_args)
            for done, version in enumerate(versions):
                report(done, len(versions), f"v{version}: loading its weights")
                bench.serve_version(version, published, lineage)
                report(done, len(versions), f"v{version}: {','.join(self.tasks)}")
                results = lm_eval.simple_evaluate(model=model, tasks=self.tasks, task_manager=self.manager,
                                                  limit=self.limit, log_samples=False)
                scores[version] = task_metrics(results)
                logger.info("lm-eval: v%d: %s", version, ", ".join(f"{k.partition('/')[2]}={v:.4f}"
                                                                    for k, v in scores[version].items()))
            report(len(versions), len(versions), "done")
        finally:
            bench.close()
        return scores
