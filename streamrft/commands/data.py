"""``streamrft data produce FILE|- --as sft|dpo``: supervised data (chat conversations, preference pairs) into a
run's ``experiences`` topic, where the trainer mixes it into RL batches (``trainer.mix``) or trains it alone
(``mode: train``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from streamrft.config import RunConfig
from streamrft.errors import ConfigError
from streamrft.producers.chat_rows import ChatMapping
from streamrft.producers.task_files import count_rows, write_rejects
from streamrft.producers.task_producer import ProduceSummary, produce_records

from .common import add_config_argument, config_from, console, open_run
from .tasks import SHOW_REJECTED, check_writable


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="inject supervised data (SFT, DPO) into a run")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    produce = actions.add_parser(
        "produce", help="produce SFT conversations or DPO pairs from a JSONL, JSON-array, CSV or Parquet file, or -",
        description="Each row becomes experiences on the run's experiences topic, tokenised with the model's chat "
                    "template (model.path), trained on the assistant's tokens only: --as sft takes 'messages' or "
                    "'prompt' + 'completion'; --as dpo takes 'prompt', 'chosen', 'rejected' (text or messages) "
                    "and scores both responses with the model, the reference policy of DPO. Rows that cannot be "
                    "used are reported with their line number and reason (all of them, with the rows, in "
                    "--rejects FILE); the exit code is 1 if there were any.")
    produce.add_argument("source", metavar="FILE|-")
    produce.add_argument("--as", dest="objective", choices=("sft", "dpo"), required=True,
                         help="sft: conversations; dpo: preference pairs")
    add_config_argument(produce)
    produce.add_argument("--dataset", default=None, help="prefix of the experiences' ids (default: the file name)")
    produce.add_argument("--messages-key", default="messages", help="field holding a conversation (sft)")
    produce.add_argument("--prompt-key", default="prompt", help="field holding the prompt")
    produce.add_argument("--completion-key", default="completion", help="field holding the completion (sft)")
    produce.add_argument("--chosen-key", default="chosen", help="field holding the chosen response (dpo)")
    produce.add_argument("--rejected-key", default="rejected", help="field holding the rejected response (dpo)")
    produce.add_argument("--id-key", default=None, help="field holding a row's id (default: <dataset>-<line>)")
    produce.add_argument("--max-tokens", type=int, default=None,
                         help="longest conversation in tokens (default: the model's positions)")
    produce.add_argument("--device", default="cpu", help="device of the reference model (dpo)")
    produce.add_argument("--batch-size", type=int, default=8, help="sequences the reference model scores at once")
    produce.add_argument("--rejects", metavar="FILE", default=None,
                         help="write every rejected row to FILE (JSONL: line, reason, row) to fix and produce again")
    produce.set_defaults(func=run_produce)


def run_produce(args: argparse.Namespace) -> int:
    config = config_from(args)
    dataset = args.dataset or ("stdin" if args.source == "-" else Path(args.source).stem)
    mapping = ChatMapping(dataset=dataset, messages_key=args.messages_key, prompt_key=args.prompt_key,
                          completion_key=args.completion_key, chosen_key=args.chosen_key,
                          rejected_key=args.rejected_key, id_key=args.id_key)
    if args.rejects is not None:
        check_writable(args.rejects)
    with console.status(f"loading {config.model.path}'s tokenizer" + (" and model" if args.objective == "dpo" else "")):
        items = supervised_items(config, args.source, args.objective, mapping, max_tokens=args.max_tokens,
                                 device=args.device, batch_size=args.batch_size)
    with open_run(config) as clients:
        summary = produce_with_progress(clients.producer(client_id="data-producer"), config, args.source, items)
    console.print(f"[green]{summary.produced} {args.objective.upper()} experience(s) produced[/] to "
                  f"{config.topic('experiences')}"
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


def supervised_items(config: RunConfig, source: str, objective: str, mapping: ChatMapping, *,
                     max_tokens: int | None = None, device: str = "cpu", batch_size: int = 8):
    """The rows of ``source`` as experiences (a DPO row: its pair) or rejections, tokenised with the run's model
    (``streamrft run`` produces ``launch.data_files`` with this too)."""
    from transformers import AutoConfig, AutoTokenizer

    from streamrft.model_paths import resolve_model_path
    from streamrft.producers.supervised_data import read_dpo, read_sft

    model_dir = resolve_model_path(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not tokenizer.is_fast or not tokenizer.chat_template:
        raise ConfigError(f"{model_dir}: supervised data needs a fast tokenizer with a chat template (to find the "
                          "assistant's tokens); this model's tokenizer has "
                          f"{'no chat template' if tokenizer.is_fast else 'no fast implementation'}")
    positions = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)
    limit = min(filter(None, (max_tokens, positions)), default=None)
    if objective == "sft":
        return read_sft(source, mapping, tokenizer, max_tokens=limit)
    from streamrft.engines.training.reference import ReferencePolicy

    reference = ReferencePolicy(model_dir, device=device, batch_size=batch_size)
    return read_dpo(source, mapping, tokenizer, reference, max_tokens=limit)


def produce_with_progress(producer, config: RunConfig, source: str, items) -> ProduceSummary:
    topic = config.topic("experiences")
    with Progress(TextColumn("[bold]producing {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        bar = progress.add_task(f"{source} → {topic}", total=count_rows(source))
        return produce_records(producer, topic, items, on_item=lambda: progress.advance(bar))
