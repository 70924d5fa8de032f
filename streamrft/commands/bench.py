"""``streamrft bench CONFIG [--versions all|latest|N,M] [--checkpoints DIR] [--workers K] [--lm-eval TASKS]``:
evaluate the base model and published versions (or the trainer's checkpoints) of a run on its eval tasksets,
through rollout workers in a bench namespace of the run's cluster (see :mod:`streamrft.consumers.bench`), and
with ``--lm-eval`` on lm-evaluation-harness tasks against a server of each version
(:mod:`streamrft.consumers.bench_lm_eval`); prints a table and writes ``bench.csv`` and ``bench.png``."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..errors import ConfigError
from ..lifecycle import StopSignal
from .common import add_config_argument, config_from, open_run

console = Console()


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="evaluate the base model and each published version on the "
                                                "run's eval tasksets")
    add_config_argument(bench, positional=True)
    bench.add_argument("--versions", default="all", help="all (default), latest, or N,M,... (0 = the base model)")
    bench.add_argument("--checkpoints", type=Path, default=None,
                       help="evaluate the trainer checkpoints in this directory (step-N = version N) instead of "
                            "the published versions; their weights go to a store under --out")
    bench.add_argument("--workers", type=int, default=1,
                       help="rollout workers this command starts in the bench namespace (0: start your own, "
                            "`streamrft rollout` with the run's name + '-bench')")
    bench.add_argument("--out", type=Path, default=None, help="where bench.csv and bench.png go "
                                                              "(default <monitor.output_dir>/bench)")
    bench.add_argument("--timeout-s", type=float, default=1800, help="per version")
    bench.add_argument("--lm-eval", default=None, metavar="TASKS",
                       help="also run these lm-evaluation-harness tasks (comma-separated) against a server of each "
                            "version; columns lm_eval/<task>/<metric> (needs pip install 'lm-eval[api]')")
    bench.add_argument("--lm-eval-include", type=Path, default=None, metavar="PATH",
                       help="a folder of lm-eval task YAML files of your own (lm-eval's --include_path)")
    bench.add_argument("--lm-eval-limit", type=_limit, default=None, metavar="N",
                       help="the first N documents of each lm-eval task (a number below 1: that share of it)")
    bench.add_argument("--lm-eval-args", default=None, metavar="K=V,...",
                       help="more arguments of lm-eval's local-completions model, e.g. num_concurrent=8,batch_size=4")
    bench.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from streamrft.consumers.bench import bench_config, choose_versions, published_versions, write_outputs

    config = config_from(args)
    if not config.explorer.eval_tasksets:
        raise ConfigError("streamrft bench evaluates explorer.eval_tasksets; add at least one "
                          "({name, path, repeat_times}) to the run config")
    out = args.out or config.output_dir / "bench"
    lm_eval = _lm_eval_plan(args) if args.lm_eval else None  # its mistakes before the bench, not after
    with open_run(config) as clients:
        try:
            if args.checkpoints is not None:
                store_url = (out / "weights").resolve().as_uri()
                lineage, published = _publish_checkpoints(config, args.checkpoints, store_url)
                bench, where = bench_config(config, weights_url=store_url), f"the checkpoints in {args.checkpoints}"
            else:
                lineage, published = published_versions(config, clients)
                bench, where = bench_config(config), "the object store (it keeps trainer.weights.keep_last)"
            versions = choose_versions(sorted(published), args.versions, where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        rows = bench_versions(bench, versions, published, lineage, args.workers, args.timeout_s,
                              bootstrap=clients.bootstrap)
        scores = {}
        if lm_eval is not None:
            scores = _lm_eval(lm_eval, config, versions, published, lineage, bench.weights_url, clients.bootstrap,
                              args.timeout_s)
    print_table(rows)
    if scores:
        print_lm_eval_table(scores)
    table, picture = write_outputs(rows, config.explorer.eval_tasksets, out, scores)
    console.print(f"wrote {table}" + (f" and {picture}" if picture else " (no matplotlib: no PNG)"))
    return 0


def _limit(text: str) -> float | int:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: give a number of documents >= 1, or a share in (0, 1)")
    return int(value) if value >= 1 else value


def _lm_eval_plan(args):
    from streamrft.consumers.bench_lm_eval import LmEvalPlan

    return LmEvalPlan.of([task.strip() for task in args.lm_eval.split(",") if task.strip()],
                         include=args.lm_eval_include, limit=args.lm_eval_limit, model_args=args.lm_eval_args)


def _lm_eval(plan, config, versions, published, lineage, weights_url: str, bootstrap: str, timeout_s: float):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("lm-eval"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("", total=len(versions))
        return plan.run(config, versions, published, lineage, bootstrap=bootstrap, weights_url=weights_url,
                        timeout_s=timeout_s,
                        progress=lambda done, total, what: progress.update(bar, completed=done, description=what))


def _publish_checkpoints(config, directory: Path, store_url: str):
    from rich.progress import Progress

    from streamrft.consumers.bench import checkpoint_versions

    with Progress(console=console) as progress:
        task = progress.add_task(f"publishing the checkpoints of {directory}", total=None)
        return checkpoint_versions(config, directory, store_url,
                                   progress=lambda done, total: progress.update(task, completed=done, total=total))


def bench_versions(config, versions, published, lineage, workers: int, timeout_s: float, *, bootstrap: str):
    """Run the bench in ``config``'s namespace with ``workers`` rollout workers of this process."""
    from streamrft.consumers.bench import Bench
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.kafka import KafkaClients

    clients = KafkaClients(config, bootstrap)
    clients.ensure_topics()
    with StopSignal() as stop:
        threads = [_worker_thread(RolloutWorker(config, clients, stop, f"bench-{i}")) for i in range(workers)]
        bench = Bench(config, clients, stop, timeout_s=timeout_s)
        try:
            with console.status(f"evaluating {len(versions)} version(s)"):
                return bench.run(versions, published, lineage)
        finally:
            stop.request()
            bench.close()
            for thread, worker in threads:
                thread.join(60)
                worker.close()
            clients.close()


def _worker_thread(worker):
    import threading

    thread = threading.Thread(target=worker.run, name=worker.worker_id, daemon=True)
    thread.start()
    return thread, worker


def print_table(rows) -> None:
    table = Table(title="bench: eval tasksets per weights version")
    for column in ("version", "taskset", "mean@n", "best@n", "accuracy@n", "tasks"):
        table.add_column(column, justify="right")
    for row in rows:
        n = next((k.rpartition("@")[2] for k in row.metrics if "@" in k), "?")
        get = lambda kind: row.metrics.get(f"eval/{row.taskset}/{kind}@{n}", float("nan"))  # noqa: E731
        table.add_row(str(row.version), row.taskset, f"{get('mean'):.3f}", f"{get('best'):.3f}",
                      f"{get('accuracy'):.3f}", f"{row.metrics.get(f'eval/{row.taskset}/tasks', 0):.0f}")
    console.print(table)


def print_lm_eval_table(scores: dict[int, dict[str, float]]) -> None:
    columns = sorted({column for values in scores.values() for column in values})
    table = Table(title="bench: lm-eval tasks per weights version")
    table.add_column("version", justify="right")
    for column in columns:
        table.add_column(column.removeprefix("lm_eval/"), justify="right")
    for version, values in scores.items():
        table.add_row(str(version), *(f"{values[c]:.4f}" if c in values else "" for c in columns))
    console.print(table)
