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
