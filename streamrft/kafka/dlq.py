"""Dead letters: a record that cannot be decoded or processed goes to ``<topic>.dlq`` unchanged, with headers
saying why and where it came from. Nothing is dropped silently."""
from __future__ import annotations

import traceback
from dataclasses import dataclass

HEADER_PREFIX = "streamrft."


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record bound for a dead-letter topic."""

    topic: str  # the dead-letter topic
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == HEADER_PREFIX + name:
                return value.decode()
        return None


def dlq_topic_of(topic: str) -> str:
    return f"{topic}.dlq"


def dead_letter(
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    error: BaseException | str,
    reason: str,
    stage: str,
    group: str = "",
    original_headers: list[tuple[str, bytes]] | None = None,
) -> DeadLetter:
    """Build the dead letter of the record at ``topic[partition]@offset``.

    ``stage`` is where it failed (``decode`` or ``process``); ``reason`` is a short tag (``unknown-magic``,
    ``truncated``, ``workflow-error`` ...) that tools can group by; ``error`` is the full explanation.
    """
    if isinstance(error, BaseException):
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
    else:
        detail = error
    headers = list(original_headers or [])
    headers += [
        (HEADER_PREFIX + "error", detail.encode()),
        (HEADER_PREFIX + "reason", reason.encode()),
        (HEADER_PREFIX + "stage", stage.encode()),
        (HEADER_PREFIX + "source.topic", topic.encode()),
        (HEADER_PREFIX + "source.partition", str(partition).encode()),
        (HEADER_PREFIX + "source.offset", str(offset).encode()),
        (HEADER_PREFIX + "consumer.group", group.encode()),
    ]
    return DeadLetter(topic=dlq_topic_of(topic), key=key, value=value, headers=headers)


class DeadLetterLedger:
    """Which records of a topic one consumer group has already dead-lettered, so that a record is sent to
    the DLQ once: not again when an aborted transaction or a restart makes the group read it a second time.

    Built at start from the DLQ topic itself (its letters carry source coordinates and group in their
    headers), then kept up to date as letters are made durable. Two members of one group reading the same
    partition at once (the overlap of a rebalance) can still both send a letter; tools that count letters
    should group them by ``source.*`` headers."""

    def __init__(self, group: str, seen: set[tuple[str, int, int]] | None = None):
        self.group = group
        self._seen = seen or set()

    @classmethod
    def from_letters(cls, group: str, letters) -> "DeadLetterLedger":
        """From the raw records of a DLQ topic (anything with ``headers``); letters of other groups are not ours."""
        seen = set()
        for raw in letters:
            headers = {k: v for k, v in raw.headers or []}
            try:
                if headers.get(HEADER_PREFIX + "consumer.group", b"").decode() != group:
                    continue
                seen.add((headers[HEADER_PREFIX + "source.topic"].decode(),
                          int(headers[HEADER_PREFIX + "source.partition"]),
                          int(headers[HEADER_PREFIX + "source.offset"])))
            except (KeyError, ValueError, UnicodeDecodeError):
                continue  # a foreign record on the DLQ topic: not one of our letters
        return cls(group, seen)

    def __contains__(self, where: tuple[str, int, int]) -> bool:
        return where in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, where: tuple[str, int, int]) -> None:
        self._seen.add(where)
