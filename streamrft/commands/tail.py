"""``streamrft tail TOPIC``: decoded records of a run's topic as JSON lines on stdout."""
from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import TYPE_CHECKING, Any

from ..config import TOPIC_NAMES
from streamrft.schemas import DecodeError, Experience
from streamrft.schemas.packing import unpack_f32, unpack_i32, unpack_u8
from .common import add_config_argument, config_from, open_run

if TYPE_CHECKING:
    from ..kafka.reader import RawRecord

# Packed array fields of Experience and how to show them.
_PACKED = {"tokens": unpack_i32, "logprobs": unpack_f32, "action_mask": unpack_u8, "token_rewards": unpack_f32}


def register(subparsers) -> None:
    parser = subparsers.add_parser("tail", help="print a topic's records, decoded, as JSON lines")
    parser.add_argument("topic", metavar="TOPIC",
                        help=f"one of {', '.join(TOPIC_NAMES)} (optionally with .dlq), or a full topic name")
    add_config_argument(parser)
    parser.add_argument("--from-beginning", action="store_true", help="start at the oldest record")
    parser.add_argument("-n", "--limit", type=int, default=None, help="stop after N records")
    parser.add_argument("--idle-timeout", type=float, default=None,
                        help="stop after this many seconds without a new record (default: follow)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..kafka.reader import read_topic

    config = config_from(args)
    topic = resolve_topic(config, args.topic)
    with open_run(config, create_topics=False) as clients:
        for raw in read_topic(config.kafka, clients.bootstrap, topic, from_beginning=args.from_beginning,
                              idle_timeout=args.idle_timeout, limit=args.limit):
            sys.stdout.write(json.dumps(render(raw, clients.serde), ensure_ascii=False) + "\n")
            sys.stdout.flush()
    return 0


def resolve_topic(config, name: str) -> str:
    """``experiences`` -> ``rft.<run>.experiences``; ``tasks.dlq`` -> ``rft.<run>.tasks.dlq``; full names pass."""
    short = name.removesuffix(".dlq")
    return config.topic(short) + name[len(short):] if short in TOPIC_NAMES else name


def render(raw: "RawRecord", serde) -> dict[str, Any]:
    out: dict[str, Any] = {
        "topic": raw.topic, "partition": raw.partition, "offset": raw.offset,
        "key": raw.key.decode(errors="replace") if raw.key else None, "timestamp": raw.timestamp_ms,
    }
    if raw.headers:
        out["headers"] = {k: v.decode(errors="replace") if v is not None else None for k, v in raw.headers}
    try:
        record = serde.decode(raw.value, raw.topic)
    except DecodeError as exc:
        out["undecodable"] = str(exc)
        out["value_base64"] = base64.b64encode(raw.value or b"").decode()
        return out
    value = record.to_dict()
    out["type"] = record.schema_name
    if isinstance(record, Experience):
        for name, unpack in _PACKED.items():
            if value.get(name) is not None:
                value[name] = unpack(value[name]).tolist()
    out["value"] = value
    return out
