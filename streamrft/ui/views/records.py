"""The last records of a topic, decoded, with a search by key."""
from __future__ import annotations

from ..html import Markup, esc, join, num, page, table, tag
from ..records import ShownRecord


def records_page(topics: list[str], topic: str | None, key: str | None, records: list[ShownRecord],
                 scanned: int) -> str:
    options = join(tag("option", name, value=name, selected="selected" if name == topic else None)
                   for name in topics)
    form = tag("form", join([
        tag("label", join(["topic ", tag("select", options, name="topic")])), " ",
        tag("label", join(["key contains ", Markup(_input("key", key or ""))])), " ",
        Markup('<button type="submit">show</button>'),
    ]), method="get", action="/records")
    if topic is None:
        return page("Records", "/records", join([form, tag("p", "pick a topic", class_="empty")]))
    what = (f"records of {topic} whose key contains {key!r}, in the last {scanned} offsets of each partition"
            if key else f"the last {scanned} records of each partition of {topic}, newest last")
    rows = [[num(r.raw.partition), num(r.raw.offset), r.time, r.key, r.type or tag("span", "undecodable",
             class_="bad"), tag("pre", r.value)] for r in records]
    body = join([form, tag("p", what, class_="muted"),
                 table(["partition", "offset", "time (UTC)", "key", "type", "value"], rows,
                       empty="no record found")])
    return page(f"Records · {topic}", "/records", body)


def _input(name: str, value: str) -> str:
    return f'<input type="search" name="{esc(name)}" value="{esc(value)}" size="30">'
