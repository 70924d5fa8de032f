"""Bench mode: evaluate the base model and each published version on the run's eval tasksets, through rollout
workers and Kafka (requests of kind EVAL), and tabulate mean@n / best@n per version.

The bench runs in a namespace of its own (the run's name + ``-bench``: its own topics and groups), so it never
disturbs a live run: it announces each version there as a WEIGHTS_PUBLISHED that points at the run's object
store (the manifest's sha256 computed from the store), one version after another, oldest first, and publishes
the eval requests of that version with ``min_model_version`` = it; the workers of the bench namespace load it
through their usual, verified path. Version 0 is the model the workers are built with (``model.path``).
Versions are those the run's object store keeps (``trainer.weights.keep_last``) for the trainer's current
lineage (from the run's ``sync`` topic) or, with ``--checkpoints DIR``, the trainer's checkpoints there (each
``step-N`` holds weights version N): their weights are published, as the trainer publishes, to a store of the
bench's own under a lineage of its own, so even versions the run never published or no longer keeps can be
evaluated.
"""
from __future__ import annotations

import collections
import csv
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrft.config import EvalTaskset, RunConfig
from streamrft.engines.weights.object_store import ObjectStore
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.rollout_stats import eval_metrics
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, SyncKind, SyncMethod, SyncSignal
from streamrft.sync import SyncView

from .explorer import load_eval_tasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRow:
    version: int
    taskset: str
    metrics: dict[str, float]

    def value(self, kind: str, n: int) -> float:
        return self.metrics.get(f"eval/{self.taskset}/{kind}@{n}", float("nan"))


def bench_config(config: RunConfig, weights_url: str | None = None) -> RunConfig:
    """The bench namespace of a run: same settings (model, eval tasksets) and the same weights store (or
    ``weights_url``, the store of checkpoint versions), its own topics and groups."""
    weights = config.trainer.weights.model_copy(update={"url": weights_url or config.weights_url})
    trainer = config.trainer.model_copy(update={"weights": weights})
    prefix = config.topic_prefix_override
    return config.model_copy(update={"name": f"{config.name}-bench", "trainer": trainer,
                                     "topic_prefix_override": None if prefix is None else f"{prefix}bench."})


def published_versions(config: RunConfig, clients: KafkaClients) -> tuple[str, dict[int, tuple[str, str]]]:
    """The trainer's current lineage (from the run's ``sync``) and the versions its store keeps:
    ``{version: (manifest uri, sha256)}``."""
    view = SyncView(clients, client_id=f"{config.name}-bench-sync")
    try:
        view.catch_up()
        lineage = view.lineage
    finally:
        view.close()
    store = ObjectStore(config.weights_url, lineage=lineage)
    versions = {}
    for version in store.versions():
        uri = store.manifest_uri(version)
        versions[version] = (uri, hashlib.sha256(store.fs.cat_file(store.manifest_path(version))).hexdigest())
    return lineage, versions


def checkpoint_versions(config: RunConfig, directory: Path, store_url: str,
                        progress=None) -> tuple[str, dict[int, tuple[str, str]]]:
    """Publish the weights of every complete checkpoint with a model under ``directory`` (a trainer's
    checkpoint directory: ``step-N`` = weights version N) to the store at ``store_url``, under a new lineage,
    through the training engine (so sharded FSDP checkpoints load too); returns the lineage and ``{version:
    (manifest uri, sha256)}``. ``progress(done, total)`` is called after each."""
    from streamrft.engines.weights.locations import new_lineage

    from .trainer.checkpoints import Checkpoints
    from .trainer.engine import build_engine

    found = {step: path for step, path in Checkpoints(directory, keep=1).paths().items()
             if json.loads((path / "state.json").read_text()).get("has_model")}
    if not found:
        raise ValueError(f"--checkpoints {directory}: no complete trainer checkpoint with a model (step-N/ with "
                         "state.json) there; point it at the trainer's checkpoint_dir")
    engine = build_engine(config, device="cpu")
    store = ObjectStore(store_url, lineage=new_lineage(), keep_last=len(found))
    versions = {}
    for done, (step, path) in enumerate(found.items(), start=1):
        engine.load_state(path)
        published = store.publish(engine.named_weights(), version=step, metadata=engine.publish_metadata())
        versions[step] = (published.uri, published.sha256)
        if progress is not None:
            progress(done, len(found))
    return store.lineage, versions


def choose_versions(available: list[int], wanted: str,
                    where: str = "the object store (it keeps trainer.weights.keep_last)") -> list[int]:
    """``all`` (0 and every available one), ``latest`` (0 and the newest) or ``N,M,...`` (0 is the base)."""
    if wanted == "all":
        return [0, *available]
    if wanted == "latest":
        return [0, *available[-1:]]
    chosen = sorted({int(v) for v in wanted.split(",") if v.strip()})
    missing = [v for v in chosen if v and v not in available]
    if missing:
        raise ValueError(f"versions {missing} are not in {where}: it has {available or 'none'}")
    return chosen


@dataclass
class Evaluation:
    """One version's eval requests in flight: which taskset each request is of, and the results come so far."""

    version: int
    requests: dict[str, tuple[EvalTaskset, RolloutRequest]]
    deadline: float
    results: dict[str, RolloutResult] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.results) >= len(self.requests)

    def take(self, result: RolloutResult) -> None:
        if result.request_id in self.requests:
            self.results[result.request_id] = result

    def rows(self, tasksets: list[EvalTaskset]) -> list[BenchRow]:
        rows = []
        for taskset in tasksets:
            mine = [r for rid, r in self.results.items() if self.requests[rid][0].name == taskset.name]
            rows.append(BenchRow(self.version, taskset.name, eval_metrics(taskset.name, mine, taskset.repeat_times)))
            logger.info("bench: v%d %s: %s", self.version, taskset.name,
                        ", ".join(f"{k.rpartition('/')[2]}={v:.3f}" for k, v in rows[-1].metrics.items()))
        return rows


class Bench:
    """The bench role: in the bench namespace, one version after another, publishes the version and its eval
    requests (one unit), then collects their results (a poll per pass of the role loop)."""

    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *, timeout_s: float = 1800):
        if not config.explorer.eval_tasksets:
            raise ValueError("bench mode evaluates explorer.eval_tasksets, and the run config has none")
        self.config = config
        self.timeout_s = timeout_s
        self.runtime = RoleRuntime(config, clients, stop, role="bench", source="bench",
                                   transactional_id=f"{config.name}.bench", follows_sync=False)
        self.results = self.runtime.consumer("results", config.consumer_group("bench-results"), subscribe=False)
        self.results.assign(clients.offsets(config.topic("results"), "end"))
        self.tasksets = [(t, load_eval_tasks(t)) for t in config.explorer.eval_tasksets]

    def run(self, versions: list[int], published: dict[int, tuple[str, str]], lineage: str) -> list[BenchRow]:
        """Evaluate ``versions`` (0: the base model; any other: ``published[version]`` = (manifest uri,
        sha256) under ``lineage``); returns their rows, those of the versions done when a stop came."""
        self._versions = collections.deque(versions)
        self._published = published
        self._lineage = lineage
        self._evaluation: Evaluation | None = None
        self.rows: list[BenchRow] = []
        self.runtime.run(self)
        return self.rows

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def start(self, unit: UnitOfWork) -> None:
        pass

    def handle(self, unit: UnitOfWork) -> bool:
        if self._evaluation is None:
            if not self._versions:
                return False
            self._evaluation = self._publish(self._versions.popleft(), unit)
            return True
        self.collect(self._evaluation)
        if self._evaluation.done:
            self.rows += self._evaluation.rows([t for t, _ in self.tasksets])
            self._evaluation = None
        return True

    def finish(self, unit: UnitOfWork) -> None:
        if self._evaluation is not None:  # stopped: what came of the version under way
            self.rows += self._evaluation.rows([t for t, _ in self.tasksets])

    def _publish(self, version: int, unit: UnitOfWork) -> Evaluation:
        """Stage the version's announcement (the base model needs none) and its eval requests."""
        if version:
            uri, sha256 = self._published[version]
            unit.produce(self.config.topic("sync"), SyncSignal(
                kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE, uri=uri,
                sha256=sha256, source="bench", lineage=self._lineage))
        requests = {}
        for taskset, tasks in self.tasksets:
            for task in tasks:
                rid = f"bench-{taskset.name}-v{version}-{task.task_id}"
                requests[rid] = (taskset, RolloutRequest(request_id=rid, step=version, kind=RolloutKind.EVAL,
                                                         task=task, repeat_times=taskset.repeat_times,
                                                         min_model_version=version))
        for _, request in requests.values():
            unit.produce(self.config.topic("rollouts"), request)
        unit.describe(f"v{version} and its eval requests")
        return Evaluation(version, requests, deadline=time.monotonic() + self.timeout_s)

    def collect(self, evaluation: Evaluation) -> None:
        """One poll of ``results`` into ``evaluation``; raises once its deadline has passed."""
        if time.monotonic() > evaluation.deadline:
            raise TimeoutError(f"bench: {len(evaluation.results)} of {len(evaluation.requests)} eval results after "
                               f"{self.timeout_s:.0f}s; are rollout workers running in the bench namespace?")
        for item in self.results.poll(max_records=500, timeout=0.5):
            evaluation.take(item.record)

    def close(self) -> None:
        self.runtime.close()


def write_outputs(rows: list[BenchRow], tasksets, out: Path,
                  per_version: dict[int, dict[str, float]] | None = None) -> tuple[Path, Path | None]:
    """``bench.csv`` (one row per version and taskset, every metric, then the columns of ``per_version``:
    figures of a whole version, such as lm-eval's, on each of its rows) and ``bench.png`` (mean@n and best@n per
    version; None without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted({k.rpartition("/")[2] for r in rows for k in r.metrics})
    per_version = per_version or {}
    extra = sorted({column for columns in per_version.values() for column in columns})
    table = out / "bench.csv"
    with table.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["version", "taskset", *names, *extra])
        for r in rows:
            version = per_version.get(r.version, {})
            writer.writerow([r.version, r.taskset, *(r.metrics.get(f"eval/{r.taskset}/{n}", "") for n in names),
                             *(version.get(column, "") for column in extra)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table, None
    figure, axis = plt.subplots(figsize=(6, 4))
    for taskset in tasksets:
        mine = [r for r in rows if r.taskset == taskset.name]
        versions = [r.version for r in mine]
        n = taskset.repeat_times
        axis.plot(versions, [r.value("mean", n) for r in mine], marker="o", label=f"{taskset.name} mean@{n}")
        axis.plot(versions, [r.value("best", n) for r in mine], marker="s", linestyle="--",
                  label=f"{taskset.name} best@{n}")
    axis.set_xlabel("weights version")
    axis.set_ylabel("reward")
    axis.legend()
    figure.tight_layout()
    picture = out / "bench.png"
    figure.savefig(picture, dpi=100)
    plt.close(figure)
    return table, picture
