"""Apache Avro (Java) against the contract, live: its canonical form, fingerprint and single-object encoding of
each record type (tests/integration/avro_java/Fingerprints.java) are what `streamrft schemas` publishes and what
the codec reads, and the vectors the unit tests compare with (tests/unit/avro_java_vectors.json) are current.
Needs Java 17+ and Maven (Avro's jars are resolved once into the streamrft cache)."""
from __future__ import annotations

import json
import shutil

import pytest

from streamrft.schemas import RECORD_NAMES, RECORD_TYPES, SingleObjectCodec, schema_json
from streamrft.schemas.published import contract

from .avro_java.reference import VECTORS, java_answers


def test_java_computes_what_the_contract_publishes():
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("needs Java 17+ and Maven (Apache Avro's reference implementation runs on the JVM)")
    answers = java_answers({name: schema_json(name) for name in RECORD_NAMES})
    published = contract()
    codec = SingleObjectCodec()
    for name in RECORD_NAMES:
        assert answers[name]["canonical_form"] == published[name]["canonical_form"], name
        assert answers[name]["fingerprint_hex"] == published[name]["fingerprint_hex"], name
        encoded = bytes.fromhex(answers[name]["encoded_hex"])
        assert encoded[:10].hex() == published[name]["header_hex"], name
        assert type(codec.decode(encoded, RECORD_TYPES[name])) is RECORD_TYPES[name]
    shipped = json.loads(VECTORS.read_text())["records"]
    assert shipped == answers, ("tests/unit/avro_java_vectors.json is stale: run "
                                "`python -m tests.integration.avro_java.reference`")
