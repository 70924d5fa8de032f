"""``monitor.trackers``: the experiment trackers the monitor logs a run to, besides its CSV files and Prometheus."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

TrackerName = Literal["tensorboard", "mlflow", "wandb"]


class MlflowTrackerConfig(Section):
    """``mlflow`` in ``monitor.trackers`` (``pip install 'streamrft[mlflow]'``)."""

    tracking_uri: str | None = Field(
        default=None, min_length=1,
        description="where runs go: a tracking server (http://host:5000) or a store URI; none = a file store in "
                    "<output_dir>/mlruns (read it with `mlflow ui --backend-store-uri <output_dir>/mlruns`)")
    experiment: str | None = Field(default=None, min_length=1,
                                   description="the MLflow experiment; none = the run's name")


class WandbTrackerConfig(Section):
    """``wandb`` in ``monitor.trackers`` (``pip install 'streamrft[wandb]'``): an offline run under
    ``<output_dir>/wandb``, uploaded later with ``wandb sync <output_dir>/wandb/offline-run-*``."""

    project: str = Field(default="streamrft", min_length=1, max_length=128,
                         description="the W&B project the run is synced to")
    entity: str | None = Field(default=None, min_length=1, description="the W&B team or user; none = yours")
