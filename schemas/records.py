"""Typed records, one class per ``.avsc`` file. Field names and order follow the schemas exactly.

Timestamps are integer milliseconds since the epoch (the schemas mark them ``timestamp-millis`` so tools such as
Kafka UI show dates); packed arrays stay ``bytes`` and are viewed through the ``*_array`` helpers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta, timezone
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

from .packing import unpack_f32, unpack_i32, unpack_u8


def now_ms() -> int:
    return time.time_ns() // 1_000_000


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)


def _millis(value: Any) -> Any:
    """fastavro returns timestamp-millis as datetime; records keep integer milliseconds."""
    if isinstance(value, datetime):
        return (value - _EPOCH) // _ONE_MS  # exact, unlike float timestamp() * 1000
    return value


class RolloutKind(StrEnum):
    TRAIN = "TRAIN"
    EVAL = "EVAL"


class Objective(StrEnum):
    """What the trainer learns from an experience (``schemas/Objective.avsc``)."""

    RL = "RL"
    SFT = "SFT"
    DPO = "DPO"


class RolloutStatus(StrEnum):
    OK = "OK"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"


class SyncKind(StrEnum):
    WEIGHTS_PUBLISHED = "WEIGHTS_PUBLISHED"
    SYNC_REQUEST = "SYNC_REQUEST"
    NCCL_READY = "NCCL_READY"
    EXPLORER_STATE = "EXPLORER_STATE"
    CANCEL_STEP = "CANCEL_STEP"


class SyncMethod(StrEnum):
    OBJECT_STORE = "OBJECT_STORE"
    COLLECTIVE = "COLLECTIVE"
    NONE = "NONE"


class Record:
    """Base of the record classes: conversion to and from the dicts fastavro reads and writes."""

    schema_name: ClassVar[str]
    # field name -> converter applied to the decoded value (enums, nested records, timestamps)
    _converters: ClassVar[dict[str, Any]] = {}
    _field_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        if not cls.__dict__.get("_field_names"):
            cls._field_names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
        return cls._field_names

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in self._names():
            value = getattr(self, name)
            out[name] = value.to_dict() if isinstance(value, Record) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Record":
        conv = cls._converters
        kwargs = {}
        for name in cls._names():
            if name in data:
                value = data[name]
                kwargs[name] = conv[name](value) if name in conv and value is not None else value
        return cls(**kwargs)

    @property
    def key(self) -> str:
        """The Kafka record key (docs/architecture.md, "Topics")."""
        raise NotImplementedError


@dataclass(slots=True)
class Task(Record):
    schema_name: ClassVar[str] = "Task"
    _converters: ClassVar[dict[str, Any]] = {"created_at": _millis}

    task_id: str
    workflow: str
    payload: str
    taskset: str = "default"
    reward_fn: str | None = None
    repeat_times: int | None = None
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return self.task_id


@dataclass(slots=True)
class RolloutRequest(Record):
    schema_name: ClassVar[str] = "RolloutRequest"
    _converters: ClassVar[dict[str, Any]] = {
        "kind": RolloutKind,
        "task": Task.from_dict,
        "created_at": _millis,
        "deadline_ms": _millis,
    }

    request_id: str
    step: int
    kind: RolloutKind
    task: Task
    repeat_times: int
    min_model_version: int = 0
    deadline_ms: int | None = None
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return self.request_id


@dataclass(slots=True)
class Experience(Record):
    schema_name: ClassVar[str] = "Experience"
    _converters: ClassVar[dict[str, Any]] = {"kind": RolloutKind, "objective": Objective, "created_at": _millis}

    eid: str
    group_id: str
    task_id: str
    step: int
    kind: RolloutKind
    run_index: int
    model_version: int
    tokens: bytes
    prompt_length: int
    logprobs: bytes
    reward: float
    group_size: int = 0
    last_model_version: int = -1
    action_mask: bytes | None = None
    token_rewards: bytes | None = None
    truncated: bool = False
    prompt_text: str = ""
    response_text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    worker_id: str = ""
    objective: Objective = Objective.RL
    teacher_logprobs: bytes | None = None
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return self.group_id

    @property
    def newest_version(self) -> int:
        """The weights version of its last token (the same as ``model_version`` unless newer weights took over
        mid-response)."""
        return self.last_model_version if self.last_model_version >= 0 else self.model_version

    @property
    def token_array(self) -> np.ndarray:
        return unpack_i32(self.tokens)

    @property
    def logprob_array(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    @property
    def response_length(self) -> int:
        return len(self.tokens) // 4 - self.prompt_length

    @property
    def action_mask_array(self) -> np.ndarray:
        """1 for every response token that is trained on; all ones when the record carries no mask."""
        if self.action_mask is None:
            return np.ones(self.response_length, dtype=np.uint8)
        return unpack_u8(self.action_mask)

    @property
    def token_reward_array(self) -> np.ndarray | None:
        return None if self.token_rewards is None else unpack_f32(self.token_rewards)


@dataclass(slots=True)
class RolloutResult(Record):
    schema_name: ClassVar[str] = "RolloutResult"
    _converters: ClassVar[dict[str, Any]] = {
        "kind": RolloutKind,
        "status": RolloutStatus,
        "created_at": _millis,
    }

    request_id: str
    step: int
    task_id: str
    status: RolloutStatus
    n: int
    model_version: int
    duration_ms: int
    kind: RolloutKind = RolloutKind.TRAIN
    reward_mean: float = 0.0
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    accuracy: float = 0.0
    response_length_mean: float = 0.0
    error: str | None = None
    taskset: str = ""
    worker_id: str = ""
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return self.request_id


@dataclass(slots=True)
class SyncSignal(Record):
    schema_name: ClassVar[str] = "SyncSignal"
    _converters: ClassVar[dict[str, Any]] = {
        "kind": SyncKind,
        "method": SyncMethod,
        "created_at": _millis,
    }

    kind: SyncKind
    version: int = 0  # model version (the trainer's kinds)
    step: int = -1  # explorer step (the explorer's kinds)
    trainer_step: int = 0  # deprecated, unused (it equalled version); kept for schema compatibility
    method: SyncMethod = SyncMethod.NONE
    uri: str = ""
    sha256: str = ""
    nbytes: int = 0
    source: str = ""
    state: str = ""
    created_at: int = field(default_factory=now_ms)
    lineage: str = ""  # trainer lifetime of WEIGHTS_PUBLISHED / NCCL_READY (see SyncSignal.avsc)

    @property
    def explorer_step(self) -> int:
        """EXPLORER_STATE: the explorer's next step; CANCEL_STEP: the cancelled step. A record written before
        ``step`` existed carried it in ``version``."""
        return self.step if self.step >= 0 else self.version

    @property
    def key(self) -> str:
        # One key per kind, so compaction keeps the latest signal of each kind.
        return f"policy.{self.kind.value.lower()}"


@dataclass(slots=True)
class Metric(Record):
    schema_name: ClassVar[str] = "Metric"
    _converters: ClassVar[dict[str, Any]] = {"created_at": _millis}

    source: str
    role: str
    name: str
    value: float
    step: int
    tags: dict[str, str] = field(default_factory=dict)
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return self.source


@dataclass(slots=True)
class FeedbackReceipt(Record):
    schema_name: ClassVar[str] = "FeedbackReceipt"
    _converters: ClassVar[dict[str, Any]] = {"created_at": _millis}

    response_id: str
    choice: int
    reward: float
    eid: str
    group_id: str
    group_size: int
    run_index: int
    model_version: int
    server_id: str = ""
    created_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> str:
        return f"{self.response_id}/{self.choice}"


RECORD_TYPES: dict[str, type[Record]] = {
    cls.schema_name: cls
    for cls in (Task, RolloutRequest, Experience, RolloutResult, SyncSignal, Metric, FeedbackReceipt)
}
