"""The monitor role on the real broker: CSV (long and wide, no duplicate rows), Prometheus, TensorBoard; then
``streamrft report`` on what it wrote. The last tests need no broker."""
from __future__ import annotations

import csv
import urllib.request
from pathlib import Path

import pytest
import yaml

from streamrft.cli import main
from streamrft.consumers.monitor import MetricTable, Monitor, prometheus_name
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Metric

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000_000


def _metrics() -> list[Metric]:
    """Five explorer steps, four trainer steps (one behind), two rollout workers, one eval taskset."""
    out = []
    for step in range(5):
        at = T0 + step * 1000
        for name, value in {"rollout/reward_mean": 0.1 * step, "rollout/accuracy": 0.05 * step,
                            "rollout/samples": 32.0, "time/step_s": 2.0 + step, "rollout/staleness": 1.0}.items():
            out.append(Metric("explorer", "explorer", name, value, step, {}, at))
        for worker in ("w0", "w1"):
            out.append(Metric(worker, "rollout", "rollout_worker/batch_ms", 100.0 + step, step, {}, at))
    for step in (0, 4):
        out.append(Metric("explorer", "explorer", "eval/arith/mean@4", 0.2 + step / 10, step, {}, T0 + step * 1000))
    for step in range(4):
        at = T0 + step * 1000 + 500
        for name, value in {"actor/pg_loss": -0.01 * step, "actor/kl": 0.001 * step, "actor/entropy": 1.5 - step / 10,
                            "actor/grad_norm": 0.5, "actor/num_sequences": 32.0, "trainer/staleness": 0.5,
                            "time/train_step": 1.0 + step / 2}.items():
            out.append(Metric("trainer", "trainer", name, value, step, {}, at))
    return out


def _produce(clients: KafkaClients, topic: str, metrics: list[Metric]) -> None:
    producer = clients.producer()
    for metric in metrics:
        producer.produce(topic, metric)
    producer.flush()


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _run_monitor(config, clients, max_idle_s: float = 3.0) -> tuple[Monitor, int]:
    """Run a monitor until idle; the caller closes it (its Prometheus endpoint lives until then)."""
    with StopSignal() as stop:
        monitor = Monitor(config, clients, stop)
        try:
            exported = monitor.run(max_idle_s=max_idle_s)
        except BaseException:
            monitor.close()
            raise
    return monitor, exported


@pytest.mark.kafka
def test_monitor_exports_each_value_once_and_report_draws_it(run_config, tmp_path, capsys):
    config = run_config(monitor={"output_dir": str(tmp_path / "{name}"), "metrics_port": 0})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    metrics = _metrics()
    duplicate = next(m for m in metrics if m.name == "rollout/reward_mean" and m.step == 2)
    correction = Metric("trainer", "trainer", "actor/pg_loss", -0.5, 1, {}, T0 + 9000)  # same key, new value
    _produce(clients, config.topic("metrics"), metrics + [duplicate, correction])

    monitor, exported = _run_monitor(config, clients)
    out = config.output_dir
    assert exported == len(metrics) + 1  # every value, the changed one again, the duplicate not

    # metrics.csv: long form, one row per (source, name, step), last value kept
    rows = _read_csv(out / "metrics.csv")
    assert list(rows[0]) == ["step", "role", "source", "name", "value", "created_at"]
    keys = [(r["source"], r["name"], int(r["step"])) for r in rows]
    assert len(keys) == len(set(keys)) == len(metrics)
    by_key = {(r["source"], r["name"], int(r["step"])): r for r in rows}
    assert float(by_key[("trainer", "actor/pg_loss", 1)]["value"]) == -0.5
    assert float(by_key[("explorer", "rollout/reward_mean", 2)]["value"]) == pytest.approx(0.2)
    assert by_key[("w1", "rollout_worker/batch_ms", 3)]["role"] == "rollout"
    assert int(by_key[("explorer", "time/step_s", 0)]["created_at"]) == T0

    # steps.csv: wide form, one row per step, explorer's rollout/time/eval and trainer's actor columns
    steps = _read_csv(out / "steps.csv")
    assert [int(r["step"]) for r in steps] == [0, 1, 2, 3, 4]
    assert {"rollout/reward_mean", "rollout/accuracy", "time/step_s", "eval/arith/mean@4", "actor/pg_loss",
            "actor/kl"} <= set(steps[0])
    assert "trainer/staleness" in steps[0]
    assert not any(c.startswith("rollout_worker/") for c in steps[0])
    assert "time/train_step" not in steps[0]  # the wide form's time/* columns are the explorer's
    assert float(steps[3]["rollout/reward_mean"]) == pytest.approx(0.3)
    assert float(steps[1]["actor/pg_loss"]) == -0.5
    assert steps[4]["actor/pg_loss"] == "" and steps[1]["eval/arith/mean@4"] == ""
    assert float(steps[4]["eval/arith/mean@4"]) == pytest.approx(0.6)

    # Prometheus: latest step's value per (role, source), and that step
    samples = _scrape(monitor.metrics_port)
    explorer = frozenset({"role": "explorer", "source": "explorer"}.items())
    assert samples[(prometheus_name("rollout/reward_mean"), explorer)] == pytest.approx(0.4)
    assert samples[(prometheus_name("eval/arith/mean@4"), explorer)] == pytest.approx(0.6)
    assert prometheus_name("eval/arith/mean@4") == "streamrft_eval_arith_mean_4"
    trainer = frozenset({"role": "trainer", "source": "trainer"}.items())
    assert samples[("streamrft_actor_kl", trainer)] == pytest.approx(0.003)
    step_labels = frozenset({"metric": "actor/kl", "role": "trainer", "source": "trainer"}.items())
    assert samples[("streamrft_metric_step", step_labels)] == 3
    monitor.close()
    with pytest.raises(OSError):  # closing the role releases its endpoint
        _scrape(monitor.metrics_port)
    w0 = frozenset({"role": "rollout", "source": "w0"}.items())
    assert samples[("streamrft_rollout_worker_batch_ms", w0)] == 104
    assert samples[("streamrft_monitor_records_total", frozenset({"outcome": "duplicate"}.items()))] == 1

    # TensorBoard: one point per step (the duplicate added none), wall time from created_at
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(out / "tensorboard"))
    accumulator.Reload()
    points = accumulator.Scalars("rollout/reward_mean")
    assert [p.step for p in points] == [0, 1, 2, 3, 4]
    assert points[2].value == pytest.approx(0.2) and points[2].wall_time == pytest.approx((T0 + 2000) / 1000)

    # the offsets were committed: a restarted monitor (`streamrft monitor CONFIG`) reads only what came since;
    # a redelivered record that the files already hold is skipped, a new one appended
    late = Metric("explorer", "explorer", "rollout/reward_mean", 0.5, 5, {}, T0 + 5000)
    _produce(clients, config.topic("metrics"), [duplicate, late])
    before = (out / "metrics.csv").read_text()
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({
        "name": config.name, "kafka": {"bootstrap_servers": config.kafka.bootstrap_servers},
        "monitor": {"output_dir": config.monitor.output_dir, "metrics_port": None, "tensorboard": False}}))
    assert main(["monitor", str(config_file), "--max-idle-s", "2"]) == 0
    after = (out / "metrics.csv").read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 1
    assert [int(r["step"]) for r in _read_csv(out / "steps.csv")] == [0, 1, 2, 3, 4, 5]

    # the report: a PNG with every panel's data
    png = tmp_path / "report.png"
    assert main(["report", str(out), "--output", str(png)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(png)  # logs may come first
    _assert_png(png)
    clients.close()


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 800 and image.size[1] > 500


def test_table_reloads_and_rewrites_only_on_change(tmp_path):
    table = MetricTable(tmp_path)
    first = Metric("explorer", "explorer", "rollout/reward_mean", 0.1, 0, {}, T0)
    assert table.add(first) is not None
    assert table.add(first) is None
    table.flush()
    # a torn last line (a crash while appending) is dropped on reload and the file rewritten clean
    with (tmp_path / "metrics.csv").open("a") as f:
        f.write("1,explorer,explorer,rollout/rew")
    again = MetricTable(tmp_path)
    assert list(again.rows) == [("explorer", "rollout/reward_mean", 0)]
    assert again.add(first) is None
    again.add(Metric("explorer", "explorer", "rollout/reward_mean", 0.3, 0, {}, T0 + 1))
    again.flush()
    rows = _read_csv(tmp_path / "metrics.csv")
    assert [(r["step"], r["value"]) for r in rows] == [("0", "0.3")]
    assert _read_csv(tmp_path / "steps.csv") == [{"step": "0", "rollout/reward_mean": "0.3"}]


def test_report_resolves_a_config_and_says_no_data(tmp_path, capsys):
    out = tmp_path / "out" / "r1"
    table = MetricTable(out)
    for step in range(3):
        table.add(Metric("explorer", "explorer", "rollout/reward_mean", step / 4, step, {}, T0))
    table.flush()
    config = tmp_path / "run.yaml"
    config.write_text(f"name: r1\nmonitor:\n  output_dir: {tmp_path}/out/{{name}}\n")
    assert main(["report", str(config)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out / "report.png")
    _assert_png(out / "report.png")

    from streamrft.commands.report import panels, read_metrics

    drawn = {title: lines for title, _, _, lines in panels(read_metrics(out / "metrics.csv"))}
    assert [line.label for line in drawn["Reward & accuracy"]] == ["reward mean"]
    assert drawn["Policy loss"] == drawn["KL"] == drawn["Throughput"] == []  # drawn as "no data"


def test_report_without_metrics_explains(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "streamrft monitor" in capsys.readouterr().err
