"""The run's topics: partitions, offsets, records, replicas and in-sync replicas."""
from __future__ import annotations

from ...kafka.inspection import TopicState
from ..html import Markup, join, link, num, page, table, tag


def topics_page(topics: list[TopicState], prefix: str) -> str:
    rows = [[link(f"/topics/{t.name}", t.name), num(len(t.partitions)), num(t.replication_factor),
             num(t.records), _replication(t), link("/records", "records", topic=t.name)] for t in topics]
    body = join([
        tag("p", f"Topics whose name starts with {prefix!r}. Records: end offset minus start offset, summed over "
                 "partitions (transaction markers count).", class_="muted"),
        table(["topic", "partitions", "replicas", "records", "in sync", ""], rows, empty="no topics yet"),
    ])
    return page("Topics", "/", body)


def topic_page(topic: TopicState) -> str:
    rows = [[num(p.partition), num(p.start), num(p.end), num(p.records), num(p.leader),
             ", ".join(map(str, p.replicas)), _isr(p.isr, p.under_replicated)] for p in topic.partitions]
    body = join([
        tag("p", link("/records", "last records of this topic", topic=topic.name)),
        table(["partition", "start offset", "end offset", "records", "leader", "replicas", "in-sync replicas"],
              rows),
    ])
    return page(f"Topic {topic.name}", "/", body)


def _replication(topic: TopicState) -> Markup:
    behind = [p.partition for p in topic.partitions if p.under_replicated]
    if behind:
        return tag("span", f"under-replicated: {', '.join(map(str, behind))}", class_="bad")
    return tag("span", "all", class_="ok")


def _isr(isr: tuple[int, ...], under: bool) -> Markup:
    return tag("span", ", ".join(map(str, isr)), class_="bad" if under else None)
