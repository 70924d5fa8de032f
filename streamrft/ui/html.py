"""HTML built from Python strings: every value is escaped unless it is ``Markup`` (HTML this package made)."""
from __future__ import annotations

import html
from typing import Iterable
from urllib.parse import urlencode


class Markup(str):
    """A string of HTML that is already safe: ``esc`` leaves it as it is."""


def esc(value: object) -> Markup:
    if isinstance(value, Markup):
        return value
    return Markup(html.escape("" if value is None else str(value), quote=True))


def tag(name: str, content: object = "", /, **attrs: object) -> Markup:
    """``<name attrs>content</name>``; attribute names take ``class_`` for ``class``, values are escaped."""
    shown = "".join(f' {key.rstrip("_").replace("_", "-")}="{esc(value)}"'
                    for key, value in attrs.items() if value is not None)
    return Markup(f"<{name}{shown}>{esc(content)}</{name}>")


def join(parts: Iterable[object]) -> Markup:
    return Markup("".join(esc(part) for part in parts))


def link(href: str, text: object, **query: object) -> Markup:
    target = href + ("?" + urlencode({k: v for k, v in query.items() if v is not None}) if query else "")
    return tag("a", text, href=target)


def table(headers: list[str], rows: Iterable[Iterable[object]], class_: str | None = None,
          empty: str = "nothing yet") -> Markup:
    body = [tag("tr", join(tag("td", cell) for cell in row)) for row in rows]
    if not body:
        return tag("p", empty, class_="empty")
    head = tag("tr", join(tag("th", h) for h in headers))
    return tag("table", join([tag("thead", head), tag("tbody", join(body))]), class_=class_)


NAV = (("/", "topics"), ("/groups", "consumer groups"), ("/records", "records"), ("/dlq", "dead letters"),
       ("/run", "run"))

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2430; background: #f6f7f9; }
header { background: #1f3a5f; color: #fff; padding: 10px 20px; display: flex; gap: 24px; align-items: baseline; }
header b { font-size: 16px; }
header a { color: #cfe0ff; text-decoration: none; }
header a.here { color: #fff; border-bottom: 2px solid #7fb2ff; }
main { padding: 16px 20px; }
h1 { font-size: 20px; margin: 0 0 12px; }
h2 { font-size: 16px; margin: 20px 0 8px; }
table { border-collapse: collapse; background: #fff; margin-bottom: 12px; }
th, td { border: 1px solid #d5dae1; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #e8edf3; }
.num { display: block; text-align: right; font-variant-numeric: tabular-nums; }
pre { margin: 0; white-space: pre-wrap; word-break: break-all; max-width: 900px; font-size: 12px; }
.empty { color: #6b7480; font-style: italic; }
.bad { color: #a4161a; font-weight: 600; }
.ok { color: #2b7a0b; }
.muted { color: #6b7480; }
form { margin-bottom: 12px; }
input, select { font: inherit; padding: 2px 4px; }
svg.chart { background: #fff; border: 1px solid #d5dae1; }
"""


def page(title: str, here: str, body: object, refresh_s: int | None = None) -> str:
    nav = join(tag("a", text, href=href, class_="here" if href == here else None) for href, text in NAV)
    refresh = Markup(f'<meta http-equiv="refresh" content="{int(refresh_s)}">') if refresh_s else ""
    return ("<!doctype html>" + tag("html", join([
        tag("head", join([Markup('<meta charset="utf-8">'), refresh, tag("title", f"{title} · streamrft ui"),
                          Markup('<link rel="stylesheet" href="/static/style.css">')])),
        tag("body", join([tag("header", join([tag("b", "streamrft ui"), nav])),
                          tag("main", join([tag("h1", title), body]))])),
    ]), lang="en"))


def num(value: object) -> Markup:
    """A right-aligned table cell's content (``table`` wraps it in its own td)."""
    return tag("span", value, class_="num")
