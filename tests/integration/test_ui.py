"""``streamrft ui`` against a live run on the embedded broker, looked at in headless Chromium (Debian's
``chromium``: scripts/setup.sh --dev installs it): tasks read by the explorer's group with a lag left, a bad
task dead-lettered by the real consumer, the monitor's files written from metrics records. Each page's DOM shows
what the run holds, and each page's screenshot is a real, non-blank image. The UI writes nothing to the cluster
and answers every method but GET and HEAD with 405."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Metric, Task

pytestmark = pytest.mark.kafka

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: scripts/setup.sh "
                                                             "--dev installs it (apt-get, as root)")
WINDOW = (1280, 900)
HOSTILE_KEY = "<script>alert('x')</script>"
PAGES = {"topics": "/", "groups": "/groups", "records": "/records?topic={tasks}&key=ui-task-7", "dlq": "/dlq",
         "run": "/run"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics() -> list[Metric]:
    out = []
    for step in range(4):
        for name, value in {"rollout/reward_mean": 0.1 * step, "rollout/accuracy": 0.2 * step,
                            "time/step_s": 1.5}.items():
            out.append(Metric("explorer", "explorer", name, value, step, {}, 0))
        out.append(Metric("trainer", "trainer", "actor/pg_loss", -0.01 * step, step, {}, 0))
    out.append(Metric("explorer", "explorer", "eval/arith/mean@4", 0.375, 2, {}, 0))
    return out


def _produce_tasks(producer, topic: str, ids) -> None:
    for i in ids:
        producer.produce(topic, Task(task_id=f"ui-task-{i}", workflow="arithmetic", payload=f'{{"a": {i}}}'))
    producer.flush()


def _explorer_reads(clients, config, topic: str, expected: int) -> None:
    """The explorer's group reads the tasks (the real checked consumer: the bad one goes to the DLQ) and commits."""
    consumer = clients.consumer([topic], Task, config.consumer_group("explorer"))
    read, deadline = 0, time.monotonic() + 60
    while read + consumer.dead_lettered < expected:
        assert time.monotonic() < deadline, "the explorer's group stalled"
        read += len(consumer.poll(max_records=100, timeout=1.0))
        consumer.commit()
    consumer.close()


def _write_monitor_files(config, clients) -> None:
    from streamrft.consumers.monitor import Monitor

    producer = clients.producer()
    for metric in _metrics():
        producer.produce(config.topic("metrics"), metric)
    producer.flush()
    with StopSignal() as stop:
        monitor = Monitor(config, clients, stop)
        try:
            monitor.run(max_idle_s=2.0)
        finally:
            monitor.close()


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, data=b"{}" if method in ("POST", "PUT", "PATCH") else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def live_run(kafka_bootstrap, tmp_path_factory):
    from streamrft.config import load_config

    out = tmp_path_factory.mktemp("ui-run")
    settings = {"name": f"ui{int(time.time() * 1000) % 10**9}", "kafka": {"bootstrap_servers": kafka_bootstrap},
                "monitor": {"output_dir": str(out / "{name}"), "metrics_port": None, "tensorboard": False}}
    config = load_config(overrides=settings, env={})
    clients = KafkaClients(config, kafka_bootstrap)
    clients.ensure_topics()
    tasks = config.topic("tasks")
    producer = clients.producer()
    _produce_tasks(producer, tasks, range(20))
    producer.produce_raw(tasks, b"not avro \xff\xfe", b"broken-task")
    producer.produce(tasks, Task(task_id=HOSTILE_KEY, workflow="arithmetic", payload="{}"))
    producer.flush()
    _explorer_reads(clients, config, tasks, expected=22)
    _write_monitor_files(config, clients)

    config_file = out / "run.yaml"
    config_file.write_text(yaml.safe_dump(settings))
    port = _free_port()
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "ui", "-c", str(config_file), "--port",
                                str(port), "--sample-s", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if _get(base + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, f"streamrft ui exited: {process.stdout.read()}"
            assert time.monotonic() - started < 60, "streamrft ui did not come up in 60 s"
            time.sleep(0.2)
        up_s = time.monotonic() - started
        print(f"\nstreamrft ui: up in {up_s:.1f} s, RSS {_rss_mib(process.pid):.0f} MiB")
        time.sleep(1.2)  # a few lag samples with the group caught up ...
        _produce_tasks(producer, tasks, range(20, 25))  # ... then 5 more behind: the chart has to move
        time.sleep(1.5)
        yield {"config": config, "clients": clients, "base": base, "process": process, "tasks": tasks}
    finally:
        process.terminate()
        process.wait(timeout=30)
        clients.close()


def _url(run, page: str) -> str:
    return run["base"] + PAGES[page].format(tasks=run["tasks"])


def _dom(url: str, tmp_path: Path) -> str:
    result = subprocess.run([CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox",
                             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", url],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _text(dom: str) -> str:
    """The page's text, tags removed and whitespace folded (entities left as they are)."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@needs_chromium
def test_pages_show_the_live_run(live_run, tmp_path):
    config, tasks = live_run["config"], live_run["tasks"]
    topics = _text(_dom(_url(live_run, "topics"), tmp_path))
    for name in ("tasks", "rollouts", "experiences", "metrics", "tasks.dlq"):
        assert config.topic_prefix + name in topics

    groups = _dom(_url(live_run, "groups"), tmp_path)
    explorer = config.consumer_group("explorer")
    # 22 read and committed, then 5 more produced: the explorer's group is 5 behind on tasks
    assert f"{explorer} · empty · lag 5" in _text(groups)
    assert f"{config.consumer_group('monitor')}" in groups
    chart = re.search(r'<svg class="chart".*?</svg>', groups, re.S).group(0)
    assert "<polyline" in chart and "tasks: 5" in chart  # lag over time, last sample 5

    records = _text(_dom(_url(live_run, "records"), tmp_path))
    assert "ui-task-7" in records and '"payload": "{\\"a\\": 7}"' in records.replace("&quot;", '"')
    assert "ui-task-8" not in records  # the search by key kept the one asked for
    everything = _text(_dom(f"{live_run['base']}/records?topic={tasks}", tmp_path))
    assert "ui-task-24" in everything and "Task" in everything and "undecodable" in everything

    dlq = _text(_dom(_url(live_run, "dlq"), tmp_path))
    assert f"{tasks}.dlq" in dlq
    letter = re.search(r"unknown-magic decode (\S+) (\d+) (\d+) (\S+) broken-task", dlq)
    assert letter is not None, dlq
    assert letter.group(1) == tasks and letter.group(4) == explorer

    run = _text(_dom(_url(live_run, "run"), tmp_path))
    assert "Evals" in run and "eval/arith/mean@4" in run and "0.375" in run
    assert "rollout/reward_mean" in run and "actor/pg_loss" in run


@needs_chromium
def test_record_keys_are_escaped(live_run, tmp_path):
    dom = _dom(f"{live_run['base']}/records?topic={live_run['tasks']}", tmp_path)
    assert "&lt;script&gt;alert('x')&lt;/script&gt;" in dom
    assert "<script" not in dom  # the page itself has no script either


@needs_chromium
@pytest.mark.parametrize("page", sorted(PAGES))
def test_screenshots(live_run, tmp_path, page):
    from PIL import Image

    shot = tmp_path / f"ui-{page}.png"
    result = subprocess.run([CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                             f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={WINDOW[0]},"
                             f"{WINDOW[1]}", f"--screenshot={shot}", _url(live_run, page)],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size == WINDOW
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 40, f"{page}: {len(colours)} colours, a blank page?"
    keep = os.environ.get("STREAMRFT_UI_SCREENSHOTS")  # a directory to keep them in, for a person to look at
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)


def test_read_only(live_run):
    base, clients, config = live_run["base"], live_run["clients"], live_run["config"]
    ends = clients.offsets(live_run["tasks"])
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        for path in ("/", "/records", "/groups", "/no-such-page"):
            status, body = _get(base + path, method)
            assert status == 405 and "read-only" in body, (method, path, status)
    for page in PAGES:
        assert _get(_url(live_run, page))[0] == 200
    assert _get(base + "/topics/" + live_run["tasks"])[0] == 200
    assert _get(base + "/topics/not-a-topic")[0] == 404
    assert _get(base + "/records?topic=__consumer_offsets")[0] == 404  # only the run's topics
    print(f"\nstreamrft ui: RSS {_rss_mib(live_run['process'].pid):.0f} MiB after serving every page")
    # reading the pages wrote nothing and joined no group
    assert clients.offsets(live_run["tasks"]) == ends
    listing = clients.admin().list_consumer_groups(request_timeout=10).result()
    ours = {g.group_id for g in listing.valid if g.group_id.startswith(config.name + ".")}
    assert ours == {config.consumer_group("explorer"), config.consumer_group("monitor")}
