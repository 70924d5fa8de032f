"""Every topic kind is declared once (streamrft/config/topics.py) and has the few places docs/architecture.md's
"Adding a topic kind" lists; a kind that misses one fails here, naming it. No broker."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from streamrft.acls import ROLES, role_acls
from streamrft.config import TOPIC_KINDS, TOPIC_NAMES, TopicConfig, TopicKind, load_config
from streamrft.schemas import RECORD_TYPES, Record, SyncSignal, Task
from streamrft.schemas.contract import SCHEMA_DIR
from streamrft.validation import TOPIC_CHECKS

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROLE_CODE = [p for folder in ("consumers", "producers", "streamrft") for p in (ROOT / folder).rglob("*.py")
             if "config" not in p.parts]
NAMED = re.compile(r"""(?:\.topic|runtime\.consumer)\(\s*["']([a-z_]+)["']""")


def topics_named_in_code() -> set[str]:
    return {name for path in ROLE_CODE for name in NAMED.findall(path.read_text())}


def missing_places(kind: TopicKind, *, record_types=RECORD_TYPES, checks=TOPIC_CHECKS,
                   named_in_code: set[str] | None = None, architecture: str | None = None) -> list[str]:
    """What ``kind`` still lacks, each as the place to add it."""
    named_in_code = topics_named_in_code() if named_in_code is None else named_in_code
    architecture = ARCHITECTURE.read_text() if architecture is None else architecture
    missing = []
    record = kind.record.schema_name
    if record_types.get(record) is not kind.record:
        missing.append(f"schemas/records.py: add {record} to RECORD_TYPES")
    if not (SCHEMA_DIR / f"{record}.avsc").is_file():
        missing.append(f"schemas/{record}.avsc: the record's schema")
    if kind.name not in checks:
        missing.append(f"streamrft/validation.py: TOPIC_CHECKS[{kind.name!r}], the check every reader applies")
    unknown = sorted(set(kind.writers + kind.readers + kind.dead_letters) - set(ROLES))
    if unknown:
        missing.append(f"streamrft/config/topics.py: {kind.name} names roles that do not exist: {unknown}")
    if kind.name not in named_in_code:
        missing.append(f"consumers/ or producers/: no role writes or reads {kind.name} (config.topic"
                       f"({kind.name!r}) / runtime.consumer({kind.name!r}, ...))")
    if not re.search(rf"^\| `{kind.name}` \|", architecture, re.MULTILINE):
        missing.append(f"docs/architecture.md: a row for {kind.name} in the topic table")
    return missing


@pytest.mark.parametrize("kind", TOPIC_KINDS, ids=lambda kind: kind.name)
def test_every_topic_kind_has_its_places(kind):
    assert missing_places(kind) == []


def test_every_topic_the_code_names_is_declared():
    assert topics_named_in_code() - set(TOPIC_NAMES) == set()


@pytest.mark.parametrize("kind", TOPIC_KINDS, ids=lambda kind: kind.name)
def test_the_acls_follow_each_kind(kind):
    config = load_config(overrides={"name": "r"}, env={})
    topic, dlq = config.topic(kind.name), config.dlq_topic(config.topic(kind.name))
    for role in ROLES:
        acls = role_acls(config, role)
        allowed = lambda operation, name: any(a.matches("topic", name, operation) for a in acls)  # noqa: E731
        if role not in ("viewer", "monitor"):  # both read every topic of the run by prefix (the monitor counts lag)
            assert allowed("read", topic) == (role in kind.readers), (role, "read")
            assert allowed("read", dlq) == (role in kind.dead_letters), (role, "read dlq")
        assert allowed("write", topic) == (role in kind.writers), (role, "write")
        assert allowed("write", dlq) == (role in kind.dead_letters), (role, "write dlq")


def test_the_config_section_and_the_layouts_come_from_the_kinds():
    config = load_config(overrides={"name": "r"}, env={})
    layouts = config.topic_layouts()
    for kind in TOPIC_KINDS:
        assert getattr(config.topics, kind.name) == kind.layout
        assert layouts[config.topic(kind.name)] == kind.layout and config.dlq_topic(config.topic(kind.name)) in layouts
    assert len(layouts) == 2 * len(TOPIC_KINDS)


# -- the check names what a new kind misses ---------------------------------------------------------------
@dataclass(slots=True)
class Judgement(Record):
    schema_name = "Judgement"
    verdict: str = ""


NEW = TopicKind("judgements", Judgement, "request_id", writers=("rollout",), readers=("trainer",),
                dead_letters=("trainer",), layout=TopicConfig())


def test_a_new_kind_that_misses_every_place_is_told_each_one():
    missing = missing_places(NEW, named_in_code=set(), architecture="")
    assert [place.split(":")[0] for place in missing] == [
        "schemas/records.py", "schemas/Judgement.avsc", "streamrft/validation.py", "consumers/ or producers/",
        "docs/architecture.md"]


def test_a_new_kind_on_an_existing_record_that_misses_only_its_docs_row_is_told_that():
    kind = replace(NEW, record=Task)
    missing = missing_places(kind, checks={**TOPIC_CHECKS, "judgements": lambda record: None},
                             named_in_code={"judgements"}, architecture=ARCHITECTURE.read_text())
    assert missing == ["docs/architecture.md: a row for judgements in the topic table"]
    assert missing_places(replace(NEW, record=SyncSignal, readers=("judge",)),
                          checks={**TOPIC_CHECKS, "judgements": lambda r: None}, named_in_code={"judgements"},
                          architecture="| `judgements` | x |") == [
        "streamrft/config/topics.py: judgements names roles that do not exist: ['judge']"]
