"""``streamrft schemas``: the contract as a writer in another language needs it, for each record type: its
self-contained schema, its Parsing Canonical Form, its CRC-64-AVRO fingerprint and the single-object header
(``C3 01`` + the fingerprint's 8 bytes little-endian). ``--json`` prints the same as one object by record type
(keys ``schema``, ``canonical_form``, ``fingerprint_hex``, ``fingerprint_int64``, ``header_hex``).
``--payloads`` prints the JSON Schemas of the tasks' payloads instead, by workflow and by reward."""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("schemas", help="each record type's schema, canonical form and fingerprint")
    parser.add_argument("records", nargs="*", metavar="RECORD", help="record types to show (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object by record type, for programs")
    parser.add_argument("--payloads", action="store_true",
                        help="the JSON Schemas of task payloads (schemas/payloads/), by workflow and by reward")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from streamrft.schemas import RECORD_NAMES
    from streamrft.schemas.payload_contract import payload_schemas
    from streamrft.schemas.published import published

    if args.payloads:
        sys.stdout.write(json.dumps(payload_schemas(), indent=2) + "\n")
        return 0
    unknown = [name for name in args.records if name not in RECORD_NAMES]
    if unknown:
        raise ConfigError(f"unknown record type {', '.join(unknown)}; the contract has {', '.join(RECORD_NAMES)}")
    contract = {name: published(name) for name in (args.records or RECORD_NAMES)}
    if args.json:
        sys.stdout.write(json.dumps(contract, indent=2) + "\n")
        return 0
    for name, entry in contract.items():
        header = entry["header_hex"]
        sys.stdout.write(
            f"== {name}\n"
            f"fingerprint (CRC-64-AVRO of the canonical form): {entry['fingerprint_hex']} "
            f"(signed 64-bit {entry['fingerprint_int64']})\n"
            f"single-object header on the wire: {' '.join(header[i:i + 2] for i in range(0, len(header), 2))} "
            "(C3 01, then the fingerprint's 8 bytes little-endian)\n"
            f"canonical form:\n{entry['canonical_form']}\n"
            f"schema (self-contained):\n{json.dumps(entry['schema'], indent=2)}\n\n")
    return 0
