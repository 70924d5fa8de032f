"""``streamrft tasks produce FILE|-``: inject tasks into a run's ``tasks`` topic."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from streamrft.errors import ConfigError, StreamrftError

from .common import add_config_argument, config_from, console, open_run

SHOW_REJECTED = 20


def register(subparsers) -> None:
    parser = subparsers.add_parser("tasks", help="inject tasks into a run")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    produce = actions.add_parser(
        "produce", help="produce tasks from a JSONL, JSON-array, CSV or Parquet file, or - for stdin",
        description="Each row becomes a Task whose payload holds the row's fields, with the prompt under "
                    "'question' and the reference under 'answer'. Rows that cannot become a Task are reported "
                    "with their line number and reason (all of them, with the rows, in --rejects FILE); the exit "
                    "code is 1 if there were any.")
    produce.add_argument("source", metavar="FILE|-")
    add_config_argument(produce)
    produce.add_argument("--prompt-key", default="question", help="field holding the prompt (default: question)")
    produce.add_argument("--answer-key", default="answer", help="field holding the reference answer (default: answer)")
    produce.add_argument("--no-answer", action="store_true", help="tasks have no reference answer")
    produce.add_argument("--id-key", default=None, help="field holding a task id (default: <taskset>-<line>)")
    produce.add_argument("--workflow", default="arithmetic", help="workflow that runs these tasks")
    produce.add_argument("--taskset", default=None, help="taskset name (default: the file name without suffix); "
                                                         "a taskset of explorer.tasksets fed through a topic of "
                                                         "its own gets them there")
    produce.add_argument("--reward-fn", default=None, help="reward function (default: the workflow's own)")
    produce.add_argument("--repeat-times", type=int, default=None, help="samples per task (default: the run's)")
    produce.add_argument("--rejects", metavar="FILE", default=None,
                         help="write every rejected row to FILE (JSONL: line, reason, row) to fix and produce again")
    produce.set_defaults(func=run_produce)


def check_writable(path: str) -> None:
    """Fail before producing anything rather than lose the rejected rows after the good ones went out."""
    try:
        Path(path).open("w").close()
    except OSError as exc:
        raise StreamrftError(f"--rejects {path}: cannot write it ({exc.strerror}); pass a writable path") from None


def _topic_of(config, taskset: str) -> str:
    """Where tasks of ``taskset`` go: its own topic when ``explorer.tasksets`` feeds it through one
    (``tasks.<topic>``), else the run's ``tasks`` topic."""
    configured = {t.name: t for t in config.explorer.tasksets}
    if taskset in configured:
        if configured[taskset].topic_suffix is None:
            raise ConfigError(f"taskset {taskset!r} is read from the file {configured[taskset].path} by the explorer, "
                              "not from a topic: add tasks to that file, or configure the taskset with `topic:`")
        return config.topic_prefix + configured[taskset].topic_suffix
    return config.topic("tasks")


def run_produce(args: argparse.Namespace) -> int:
    from streamrft.producers.task_files import FieldMapping, count_rows, read_tasks, write_rejects
    from streamrft.producers.task_producer import produce_tasks

    config = config_from(args)
    taskset = args.taskset or ("stdin" if args.source == "-" else Path(args.source).stem)
    mapping = FieldMapping(prompt_key=args.prompt_key, answer_key=None if args.no_answer else args.answer_key,
                           id_key=args.id_key, workflow=args.workflow, taskset=taskset,
                           reward_fn=args.reward_fn, repeat_times=args.repeat_times)
    topic = _topic_of(config, taskset)
    if args.rejects is not None:
        check_writable(args.rejects)
    with open_run(config) as clients:
        producer = clients.producer(client_id="task-producer")
        with Progress(TextColumn("[bold]producing {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            bar = progress.add_task(f"{args.source} → {topic}", total=count_rows(args.source))
            summary = produce_tasks(producer, topic, read_tasks(args.source, mapping),
                                    on_item=lambda: progress.advance(bar))
    console.print(f"[green]{summary.produced} task(s) produced[/] to {topic}"
                  + (f", [red]{len(summary.rejected)} row(s) rejected[/]:" if summary.rejected else ""))
    for rejected in summary.rejected[:SHOW_REJECTED]:
        console.print(f"  line {rejected.line}: {rejected.reason}")
    hidden = len(summary.rejected) - SHOW_REJECTED
    if args.rejects is not None:  # written even when empty: an empty file says no row was rejected
        written = write_rejects(args.rejects, summary.rejected)
        console.print(f"{written} rejected row(s) written to {args.rejects}")
    elif hidden > 0:
        console.print(f"  ... and {hidden} more (--rejects FILE writes every one)")
    return 1 if summary.rejected else 0
