"""The monitor's experiment trackers (``monitor.trackers``): TensorBoard, MLflow and W&B, as Trinity-RFT's
``monitor_type`` offers them. Each is a sink of the monitor's de-duplicated rows: ``add`` each new or changed
value, ``flush`` before the offsets are committed, ``log_eval_table`` when an eval value came, ``close`` at the
end. A tracker's package is imported only when the run asks for it.

Keys: a metric keeps its name (``rollout/reward_mean``), step and time (``created_at``); a metric of a role with
several sources (rollout workers) is keyed ``<source>/<name>``, as Prometheus labels them. MLflow allows fewer
characters in a key than streamrft's names use: the others become ``_`` there (``eval/x/mean@4`` ->
``eval/x/mean_4``). The run's config goes along as parameters, flattened (``explorer.batch_size``), secrets
redacted. A restarted monitor goes on with the same tracker run (its id is kept in the output directory).
"""
from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from streamrft.config import RunConfig
from streamrft.config.base import SECRET_WORDS

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
WANDB_RUN_ID_FILE = "wandb_run_id"
EVAL_TABLE = "eval_table"
EVAL_COLUMNS = ["step", "taskset", "metric", "value"]
REDACTED = "***"
MLFLOW_PARAM_MAX = 6000  # characters of a parameter value MLflow stores
MLFLOW_BATCH = 100  # parameters per log_batch call


def tracker_key(row) -> str:
    """The tracker's name of a row's metric: its name, prefixed by its source when the source is no role."""
    return row.name if row.source == row.role else f"{row.source}/{row.name}"


# a key that names a secret as a word of its own: sasl_password, api_key, secret_access_key (not max_tokens)
_SECRET_KEY = re.compile(rf"(?:^|[._-])(?:{'|'.join(SECRET_WORDS)})(?:$|[._-])", re.IGNORECASE)


def config_params(config: RunConfig) -> dict[str, str]:
    """The run's config, flattened to ``section.key`` strings: SecretStr values (already masked by pydantic)
    and any key named like a secret (``kafka.producer.sasl.password``) redacted."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if prefix and _SECRET_KEY.search(prefix.rsplit(".", 1)[-1]):
            out[prefix] = REDACTED if value not in (None, "", {}, []) else json.dumps(value)
        elif isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", config.model_dump(mode="json"))
    return out


def eval_table(rows: Iterable) -> list[list]:
    """``eval/<taskset>/<metric>`` rows as table rows [step, taskset, metric, value], by step."""
    table = []
    for row in rows:
        parts = row.name.split("/", 2)
        if parts[0] == "eval" and len(parts) == 3:
            table.append([row.step, parts[1], parts[2], row.value])
    return sorted(table, key=lambda r: (r[0], r[1], r[2]))


def _run_id(path: Path) -> str | None:
    return path.read_text().strip() or None if path.is_file() else None


class TensorBoardTracker:
    """Scalars into TensorBoard event files: tag = metric name, step = the metric's step, wall time = its
    ``created_at``."""

    def __init__(self, writer):
        self.writer = writer

    @classmethod
    def open(cls, config: RunConfig) -> "TensorBoardTracker | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            logger.warning("monitor: TensorBoard output off (%s); install it with `pip install "
                           "'streamrft[monitor]'` or leave tensorboard out of monitor.trackers", exc)
            return None
        directory = config.output_dir / TENSORBOARD_DIR
        directory.mkdir(parents=True, exist_ok=True)
        return cls(SummaryWriter(log_dir=str(directory)))

    def add(self, row) -> None:
        self.writer.add_scalar(tracker_key(row), row.value, global_step=row.step, walltime=row.created_at / 1000)

    def log_eval_table(self, table: list[list]) -> None:
        pass  # its scalars show the eval values already

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per streamrft run: metrics batched until the flush, the config as parameters at the run's
    creation, the eval table as the artifact ``eval_table.json`` (MLflow's table form: columns and data)."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id
        self._pending: list = []

    @classmethod
    def open(cls, config: RunConfig) -> "MlflowTracker":
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(f"monitor.trackers lists mlflow, which is not installed ({exc}); install it with "
                              "`pip install 'streamrft[mlflow]'` or leave it out of monitor.trackers") from exc
        settings = config.monitor.mlflow
        uri = settings.tracking_uri or (config.output_dir / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store working but refuses it unless asked: this is the store it is for
            # (one run, one machine, no server)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        id_file = config.output_dir / MLFLOW_RUN_ID_FILE
        run_id = _run_id(id_file)
        if run_id is None:
            run_id = cls._create_run(client, config)
            config.output_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        logger.info("monitor: MLflow run %s at %s", run_id, uri)
        return cls(client, run_id)

    @staticmethod
    def _create_run(client, config: RunConfig) -> str:
        from mlflow.entities import Param

        name = config.monitor.mlflow.experiment or config.name
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run = client.create_run(experiment_id, run_name=config.name, tags={"streamrft.run": config.name})
        params = [Param(key, value[:MLFLOW_PARAM_MAX]) for key, value in config_params(config).items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            client.log_batch(run.info.run_id, params=params[i:i + MLFLOW_BATCH])
        return run.info.run_id

    def add(self, row) -> None:
        from mlflow.entities import Metric

        key = re.sub(r"[^\w./\- :]", "_", tracker_key(row))
        self._pending.append(Metric(key, row.value, row.created_at, row.step))

    def log_eval_table(self, table: list[list]) -> None:
        self.client.log_dict(self.run_id, {"columns": EVAL_COLUMNS, "data": table}, f"{EVAL_TABLE}.json")

    def flush(self) -> None:
        for i in range(0, len(self._pending), MLFLOW_BATCH * 10):
            self.client.log_batch(self.run_id, metrics=self._pending[i:i + MLFLOW_BATCH * 10])
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """An offline W&B run under ``<output_dir>/wandb``. W&B wants each run's steps in increasing order, but
    the roles' metrics arrive out of it (the trainer a step behind the explorer, replays): so each metric is
    plotted against its own ``step`` key (``define_metric(step_metric=...)``), and W&B's internal step only
    counts the calls."""

    def __init__(self, run):
        self.run = run
        self._pending: dict[int, dict[str, float]] = {}

    @classmethod
    def open(cls, config: RunConfig) -> "WandbTracker":
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"monitor.trackers lists wandb, which is not installed ({exc}); install it with "
                              "`pip install 'streamrft[wandb]'` or leave it out of monitor.trackers") from exc
        settings = config.monitor.wandb
        config.output_dir.mkdir(parents=True, exist_ok=True)
        id_file = config.output_dir / WANDB_RUN_ID_FILE
        run_id = _run_id(id_file) or uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        run = wandb.init(mode="offline", dir=str(config.output_dir), project=settings.project, entity=settings.entity,
                         name=config.name, id=run_id, resume="allow", config=config_params(config),
                         settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True))
        run.define_metric("step", hidden=True)
        run.define_metric("*", step_metric="step")
        logger.info("monitor: W&B offline run %s in %s (upload it with `wandb sync %s`)", run_id, run.dir,
                    Path(run.dir).parent)
        return cls(run)

    def add(self, row) -> None:
        self._pending.setdefault(row.step, {})[tracker_key(row)] = row.value

    def log_eval_table(self, table: list[list]) -> None:
        import wandb

        self.run.log({EVAL_TABLE: wandb.Table(columns=EVAL_COLUMNS, data=table)})

    def flush(self) -> None:
        for step, values in sorted(self._pending.items()):
            self.run.log({**values, "step": step})
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}


def open_trackers(config: RunConfig) -> list:
    """The trackers of ``monitor.trackers`` (``tensorboard: false`` leaves TensorBoard out). A tracker whose
    package is missing stops the monitor with the install command, except TensorBoard, which it only warns of."""
    opened = (TRACKERS[name].open(config) for name in config.monitor.active_trackers)
    return [tracker for tracker in opened if tracker is not None]
