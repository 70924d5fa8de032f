"""Fixtures of the interop tests: the published contract as the file the clients read, the Go and Java clients
(built once, ``toolchains.py``; a language whose toolchain is missing has its tests skipped with the reason), and
an embedded schema registry."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from .toolchains import BUILDERS, Client, ToolchainMissing


def published_contract() -> tuple[dict, str]:
    """Each record type's self-contained schema, parsing canonical form, fingerprint (a number, in hex) and
    single-object header (C3 01 + the fingerprint little-endian), as `streamrft schemas --json` prints them, and
    where they came from: that command, or (where the command does not exist) the Python contract the roles
    encode with."""
    done = subprocess.run([sys.executable, "-m", "streamrft.cli", "schemas", "--json"], capture_output=True,
                          text=True, timeout=60)
    if done.returncode == 0:
        return json.loads(done.stdout), "`streamrft schemas --json`"
    if "invalid choice: 'schemas'" not in done.stderr:
        raise AssertionError(f"`streamrft schemas --json` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    from streamrft.schemas import RECORD_NAMES, canonical_form, fingerprint64, schema_json

    contract = {}
    for name in RECORD_NAMES:
        schema = schema_json(name)
        wire = fingerprint64(schema)  # the 8 bytes of the header, little-endian
        contract[name] = {"schema": schema, "canonical_form": canonical_form(schema),
                          "fingerprint_hex": f"{int.from_bytes(wire, 'little'):016x}",
                          "header_hex": "c301" + wire.hex()}
    return contract, "streamrft.schemas (the command `streamrft schemas` is not there)"


@pytest.fixture(scope="session")
def contract_file(tmp_path_factory) -> str:
    contract, source = published_contract()
    print(f"\ninterop: the contract from {source}")
    path = tmp_path_factory.mktemp("contract") / "contract.json"
    path.write_text(json.dumps(contract))
    return str(path)


@pytest.fixture(scope="session")
def interop_clients() -> dict[str, Client | str]:
    """language -> its built client, or the reason there is none."""
    clients: dict[str, Client | str] = {}
    for language, build in BUILDERS.items():
        try:
            clients[language] = build()
        except ToolchainMissing as missing:
            clients[language] = str(missing)
    return clients


@pytest.fixture(scope="module")
def interop_registry():
    from streamrft.config import SchemaRegistryConfig
    from streamrft.registry import EmbeddedRegistry, registry_ready

    if not registry_ready(SchemaRegistryConfig().embedded_version):
        pytest.skip("Apicurio Registry is not resolved; run `streamrft registry setup` (scripts/setup.sh --dev does)")
    if shutil.which("java") is None:
        pytest.skip("the embedded registry needs Java 17+")
    with EmbeddedRegistry() as server:
        yield server
