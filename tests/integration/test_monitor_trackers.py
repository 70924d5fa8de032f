"""``monitor.trackers: [tensorboard, mlflow, wandb]``: a real monitor on the real broker, fed metric records,
logs them to an MLflow file store and an offline W&B run; the runs are read back with MLflow's client and from
W&B's own run file (its records decoded with wandb's protobuf classes)."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from streamrft.consumers.trackers import config_params
from streamrft.kafka import KafkaClients
from streamrft.schemas import Metric

from .test_monitor import T0, _metrics, _produce, _run_monitor

pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'streamrft[mlflow]'")
pytest.importorskip("wandb", reason="wandb is not installed: pip install 'streamrft[wandb]'")

SECRET = "hunter2-do-not-log"


def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: W&B's LevelDB-style log (a 7-byte file header, then 32 KiB blocks of
    chunks, each ``crc32 (4), length (2), type (1)``: full, first, middle, last), each record a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, records, parts = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum, f"bad checksum at byte {pos}"
        pos += 7 + length
        parts += chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


@pytest.mark.kafka
def test_monitor_logs_metrics_config_and_eval_table_to_mlflow_and_wandb(run_config, tmp_path):
    from mlflow.tracking import MlflowClient

    config = run_config(monitor={"output_dir": str(tmp_path / "{name}"), "metrics_port": None,
                                 "trackers": ["tensorboard", "mlflow", "wandb"]},
                        kafka={"sasl_password": SECRET, "producer": {"sasl.password": SECRET}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    metrics = _metrics()
    _produce(clients, config.topic("metrics"), metrics)
    monitor, exported = _run_monitor(config, clients)
    monitor.close()
    assert exported == len(metrics)
    out = config.output_dir

    # MLflow: the file store in the output dir, one run with every metric's history, the config, the table
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(config.name)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == config.name
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(s, round(0.1 * s, 6)) for s in range(5)]
    assert {m.timestamp for m in history} == {T0 + s * 1000 for s in range(5)}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [0, 1, 2, 3]
    assert len(client.get_metric_history(run.info.run_id, "w1/rollout_worker/batch_ms")) == 5
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/arith/mean_4")} == \
        pytest.approx({0: 0.2, 4: 0.6})
    params = run.data.params
    assert params["explorer.batch_size"] == str(config.explorer.batch_size)
    assert params["monitor.trackers"] == json.dumps(["tensorboard", "mlflow", "wandb"])
    assert SECRET not in json.dumps(params)
    assert params["kafka.sasl_password"] != SECRET and params["kafka.producer.sasl.password"] == "***"
    table_file = Path(client.download_artifacts(run.info.run_id, "eval_table.json", str(tmp_path / "dl")))
    table = json.loads(table_file.read_text())
    assert table == {"columns": ["step", "taskset", "metric", "value"],
                     "data": [[0, "arith", "mean@4", pytest.approx(0.2)], [4, "arith", "mean@4", pytest.approx(0.6)]]}

    # W&B: an offline run under the output dir, its history, config and table in its run file
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    records = _wandb_records(run_file)
    history_rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                    for r in records if r.WhichOneof("record_type") == "history"]
    rewards = {row["step"]: row["rollout/reward_mean"] for row in history_rows if "rollout/reward_mean" in row}
    assert rewards == pytest.approx({s: 0.1 * s for s in range(5)})
    assert {row["step"] for row in history_rows if "actor/kl" in row} == {0, 1, 2, 3}
    assert any("w0/rollout_worker/batch_ms" in row for row in history_rows)
    tables = [row for row in history_rows if "eval_table/_type" in row]
    assert tables and tables[-1]["eval_table/_type"] == "table-file" and tables[-1]["eval_table/nrows"] == 2
    (table_json,) = run_dir.glob("files/media/table/eval_table_*.table.json")
    assert json.loads(table_json.read_text())["data"] == [[0, "arith", "mean@4", pytest.approx(0.2)],
                                                          [4, "arith", "mean@4", pytest.approx(0.6)]]
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    wandb_config = {item.key: item.value_json for item in run_record.config.update}
    assert json.loads(wandb_config["explorer.batch_size"]) == str(config.explorer.batch_size)
    assert json.loads(wandb_config["kafka.producer.sasl.password"]) == "***"
    assert SECRET not in run_file.read_bytes().decode("latin-1")

    # a restarted monitor goes on with the same runs: one more value, no new MLflow run
    _produce(clients, config.topic("metrics"), [Metric("explorer", "explorer", "rollout/reward_mean", 0.5, 5, {},
                                                       T0 + 5000)])
    monitor, exported = _run_monitor(config, clients, max_idle_s=2.0)
    monitor.close()
    assert exported == 1
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "rollout/reward_mean")) == 6
    clients.close()


def test_config_params_redact_secrets_and_flatten():
    from streamrft.config import load_config

    config = load_config(overrides={"name": "params", "kafka": {"sasl_password": SECRET, "producer": {
        "sasl.password": SECRET, "linger.ms": 5}}}, env={})
    params = config_params(config)
    assert SECRET not in json.dumps(params)
    assert params["kafka.producer.linger.ms"] == "5"
    assert params["name"] == config.name and params["monitor.metrics_port"] == "9100"
