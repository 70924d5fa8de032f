"""The UI's HTTP app: GET pages over a ClusterView, a LagHistory and the monitor's steps file. Read-only by
design: any method but GET and HEAD is answered 405 before routing, whatever the path."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from .cluster import ClusterView
from .html import STYLE, page, tag
from .lag_history import LagHistory
from .settings import UiSettings
from .views.dlq import dlq_page
from .views.groups import groups_page
from .views.records import records_page
from .views.run import run_page
from .views.topics import topic_page, topics_page

logger = logging.getLogger(__name__)
READ_METHODS = ("GET", "HEAD")


@dataclass
class UiState:
    view: ClusterView
    history: LagHistory
    settings: UiSettings
    steps_csv: Path | None  # the monitor's steps.csv of the run


def create_app(state: UiState) -> FastAPI:
    app = FastAPI(title="streamrft ui", docs_url=None, redoc_url=None, openapi_url=None)
    view, settings = state.view, state.settings

    @app.middleware("http")
    async def read_only(request: Request, call_next):
        if request.method not in READ_METHODS:
            return PlainTextResponse("streamrft ui is read-only: only GET and HEAD are served\n", status_code=405,
                                     headers={"Allow": ", ".join(READ_METHODS)})
        return await call_next(request)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        logger.warning("%s failed: %s", request.url.path, exc)
        body = tag("p", f"this page could not be made ({type(exc).__name__}: {exc}). If the cluster is down "
                        "(a broker restart), start it and reload the page.", class_="bad")
        return HTMLResponse(page("Page unavailable", "", body), status_code=503)

    @app.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok\n"

    @app.get("/static/style.css")
    def style() -> Response:
        return Response(STYLE, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    @app.get("/", response_class=HTMLResponse)
    def topics() -> str:
        return topics_page(view.topics(), view.topic_prefix)

    @app.get("/topics/{name}", response_class=HTMLResponse)
    def topic(name: str) -> str:
        found = [t for t in view.topics() if t.name == name]
        if not found:
            raise HTTPException(404, f"{name} is not a topic of this run")
        return topic_page(found[0])

    @app.get("/groups", response_class=HTMLResponse)
    def groups() -> str:
        return groups_page(view.groups(), state.history, view.short, settings.sample_s)

    @app.get("/records", response_class=HTMLResponse)
    def records(topic: str | None = None, key: str | None = None) -> str:
        names = view.topic_names()
        if topic and topic not in names:
            raise HTTPException(404, f"{topic} is not a topic of this run")
        if not topic:
            return records_page(names, None, key, [], 0)
        per_partition = settings.scan if key else settings.records
        found = view.records(topic, per_partition, key)
        return records_page(names, topic, key, found[-settings.records:], per_partition)

    @app.get("/dlq", response_class=HTMLResponse)
    def dlq() -> str:
        return dlq_page({name: view.records(name, settings.records)[-settings.records:]
                         for name in view.dlq_topics()})

    @app.get("/run", response_class=HTMLResponse)
    def run() -> str:
        return run_page(state.steps_csv)

    return app
