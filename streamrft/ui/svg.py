"""A small line chart as inline SVG (no script): one polyline per series over a shared time axis."""
from __future__ import annotations

from .html import Markup, join, tag

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def line_chart(series: dict[str, list[tuple[float, float]]], width: int = 560, height: int = 150) -> Markup:
    """``series``: label -> [(time_s, value)], oldest first. The y axis starts at 0; the legend names each line
    with its last value."""
    points = [p for line in series.values() for p in line]
    if not points:
        return tag("p", "no samples yet", class_="empty")
    left, right, top, bottom = 48, 210, 10, 22
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    top_value = max(max(v for _, v in points), 1.0)
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return left + (t - t0) / span * (width - left - right)

    def y(v: float) -> float:
        return top + (1 - v / top_value) * (height - top - bottom)

    parts = [
        Markup(f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - right}" y2="{y(0):.1f}" stroke="#888"/>'),
        Markup(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(0):.1f}" stroke="#888"/>'),
        tag("text", f"{top_value:g}", x=left - 4, y=top + 4, text_anchor="end", font_size=11),
        tag("text", "0", x=left - 4, y=f"{y(0) + 4:.1f}", text_anchor="end", font_size=11),
        tag("text", f"last {t1 - t0:.0f} s", x=left, y=height - 6, font_size=11, fill="#666"),
    ]
    for i, (label, line) in enumerate(sorted(series.items())):
        colour = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in line)
        if len(line) == 1:
            parts.append(Markup(f'<circle cx="{x(line[0][0]):.1f}" cy="{y(line[0][1]):.1f}" r="3" '
                                f'fill="{colour}"/>'))
        else:
            parts.append(Markup(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>'))
        legend_y = top + 14 * i + 8
        parts.append(Markup(f'<rect x="{width - right + 8}" y="{legend_y - 8}" width="10" height="10" '
                            f'fill="{colour}"/>'))
        parts.append(tag("text", f"{label}: {line[-1][1]:g}", x=width - right + 22, y=legend_y + 1, font_size=11))
    return Markup(f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                  f'viewBox="0 0 {width} {height}" role="img">{join(parts)}</svg>')


