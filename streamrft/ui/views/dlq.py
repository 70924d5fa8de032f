"""Dead letters: each with its reason, stage, source coordinates, group and error (kafka/dlq.py's headers)."""
from __future__ import annotations

from ..html import join, link, num, page, table, tag
from ..records import ShownRecord


def dlq_page(letters: dict[str, list[ShownRecord]]) -> str:
    """``letters``: DLQ topic -> its last letters."""
    quiet = [topic for topic, found in letters.items() if not found]
    sections = [tag("p", f"no dead letters in {', '.join(quiet)}", class_="muted")] if quiet else []
    for topic, found in letters.items():
        if not found:
            continue
        sections.append(tag("h2", f"{topic} · {len(found)} shown"))
        rows = [[letter.time, tag("b", letter.header("reason")), letter.header("stage"),
                 link("/records", letter.header("source.topic"), topic=letter.header("source.topic")),
                 num(letter.header("source.partition")), num(letter.header("source.offset")),
                 letter.header("consumer.group"), letter.key, tag("pre", letter.header("error")),
                 f"{len(letter.raw.value or b'')} bytes"] for letter in found]
        sections.append(table(["time (UTC)", "reason", "stage", "source topic", "partition", "offset", "group",
                               "key", "error", "value"], rows, empty="no dead letters"))
    if not letters:
        sections.append(tag("p", "the run has no dead-letter topics yet", class_="empty"))
    return page("Dead letters", "/dlq", join(sections))

