"""The run's consumer groups: state, lag per partition now, and each topic's lag over time."""
from __future__ import annotations

from ...kafka.inspection import GroupState
from ..html import join, num, page, table, tag
from ..svg import line_chart

REFRESH_S = 10


def groups_page(groups: list[GroupState], history, short, sample_s: float) -> str:
    """``history``: a LagHistory; ``short``: full topic name -> the run's name for it."""
    sections = [tag("p", f"Lag = end offset − committed offset. Sampled every {sample_s:g} s since the UI "
                         f"started; this page reloads every {REFRESH_S} s.", class_="muted")]
    for group in groups:
        lags = group.lag_by_topic()
        sections.append(tag("h2", f"{group.group} · {group.state.lower()} · lag {sum(lags.values())}",
                            id=group.group))
        over_time = {short(topic): line for topic, line in history.of(group.group).items()}
        sections.append(line_chart(over_time))
        rows = [[short(p.topic), num(p.partition), num(p.committed), num(p.end), num(p.lag)]
                for p in group.partitions]
        sections.append(table(["topic", "partition", "committed", "end", "lag"], rows,
                              empty="no committed offsets on the run's topics"))
    if not groups:
        sections.append(tag("p", "no consumer groups of this run yet", class_="empty"))
    return page("Consumer groups", "/groups", join(sections), refresh_s=REFRESH_S)
