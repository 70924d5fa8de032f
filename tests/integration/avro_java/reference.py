"""Apache Avro (Java) as the reference for the contract: its Parsing Canonical Form, its fingerprint
(``SchemaNormalization.parsingFingerprint64``) and its single-object encoding of each record type, from
``Fingerprints.java`` run with Avro's jars (resolved with Maven into the streamrft cache, as the broker's are).

``python -m tests.integration.avro_java.reference`` writes the answers to ``tests/unit/avro_java_vectors.json``,
the vectors the unit tests compare with when no JVM is at hand.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

AVRO_VERSION = "1.12.0"
HERE = Path(__file__).resolve().parent
VECTORS = HERE.parents[1] / "unit" / "avro_java_vectors.json"
POM = f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.streamrft</groupId>
  <artifactId>avro-reference</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.avro</groupId><artifactId>avro</artifactId><version>{AVRO_VERSION}</version></dependency>
  </dependencies>
</project>
"""


def avro_jars() -> Path:
    from streamrft.broker.jars import cache_root, resolve_maven_jars

    return resolve_maven_jars(cache_root() / f"avro-java-{AVRO_VERSION}", POM, f"Apache Avro {AVRO_VERSION}",
                              setup_hint="this test again once Maven can reach its repository", quiet=True)


def java_answers(schemas: dict[str, dict]) -> dict[str, dict]:
    """Record name -> ``{"fingerprint_hex", "encoded_hex", "canonical_form"}`` as Apache Avro computes them."""
    from streamrft.broker.jars import find_java

    lib = avro_jars()
    with tempfile.TemporaryDirectory() as tmp:
        args = []
        for name, schema in schemas.items():
            path = Path(tmp) / f"{name}.avsc"
            path.write_text(json.dumps(schema))
            args.append(f"{name}={path}")
        done = subprocess.run([str(find_java().path), "-cp", f"{lib}/*", str(HERE / "Fingerprints.java"), *args],
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"Fingerprints.java failed ({done.returncode}): {done.stderr[-2000:]}")
    answers = {}
    for line in done.stdout.splitlines():
        name, fingerprint, encoded, canonical = line.split("\t")
        answers[name] = {"fingerprint_hex": fingerprint, "encoded_hex": encoded, "canonical_form": canonical}
    return answers


def main() -> None:
    from streamrft.schemas import RECORD_NAMES, schema_json

    answers = java_answers({name: schema_json(name) for name in RECORD_NAMES})
    VECTORS.write_text(json.dumps({"source": f"Apache Avro {AVRO_VERSION} (Java), "
                                             "tests/integration/avro_java/Fingerprints.java",
                                   "records": answers}, indent=2) + "\n")
    print(f"wrote {len(answers)} records' answers to {VECTORS}", file=sys.stderr)


if __name__ == "__main__":
    main()
