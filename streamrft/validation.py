"""What each record type promises, checked once where a role reads it (``RecordConsumer(check=...)``).

One function per record type; each raises :class:`InvalidRecordError` with a short ``reason`` (the DLQ's
``streamrft.reason`` header) and a sentence saying what is wrong. They check what the record itself promises —
lengths that line up, finite numbers, ids that are present, JSON that parses — never the run's policy on
work (how many samples a task may ask for is a cap, checked by the worker, which FAILS the request with the
reason so the explorer still accounts for it).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from collections.abc import Callable

import numpy as np

from streamrft.explorer_state import ExplorerState
from streamrft.engines.weights.locations import check_lineage, check_manifest_uri, is_sha256
from streamrft.engines.weights.signal_state import Announcement, DeliveryState
from streamrft.schemas import (Experience, FeedbackReceipt, InvalidRecordError, Metric, Objective, RolloutRequest,
                               RolloutResult, SyncKind, SyncMethod, SyncSignal, Task, unpack_f32)
from streamrft.schemas.experience_extras import check_extras
from streamrft.schemas.payload_contract import PayloadError, check_payload

MAX_ID_CHARS = 512  # task_id, request_id, group_id, eid: they are keys and appear in the explorer's state
MAX_VERSION = 2**31 - 1  # weights versions and steps; anything above is a forged or corrupted record
MAX_METRIC_NAME = 256
MAX_ERROR_CHARS = 64 * 1024  # a result's error text (workers keep the last 8,000 characters)
MAX_STATE_BYTES = 256 * 1024  # a sync signal's state: the explorer's references, a group's address


def _fail(reason: str, detail: str) -> None:
    raise InvalidRecordError(reason, detail)


def _check_id(value: str, what: str) -> None:
    if not value:
        _fail("missing-id", f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        _fail("id-too-long", f"{what} has {len(value)} characters (at most {MAX_ID_CHARS})")


def _check_count(value: int, what: str, minimum: int = 0) -> None:
    if not minimum <= value <= MAX_VERSION:
        _fail("out-of-range", f"{what} = {value} is outside [{minimum}, {MAX_VERSION}]")


# -- tasks ----------------------------------------------------------------------------------------------------
def check_task(task: Task, max_bytes: int | None = None) -> None:
    """A task as a producer wrote it (the ``tasks`` topics): :func:`check_task_fields`, and its payload as the
    JSON Schemas of its workflow and of its reward describe it (``schemas/payloads/``; the reason names the
    key)."""
    payload = check_task_fields(task, max_bytes)
    try:
        check_payload(task.workflow, task.reward_fn, payload)
    except PayloadError as exc:
        _fail("bad-payload", f"task {task.task_id!r}: {exc}")


def check_task_fields(task: Task, max_bytes: int | None = None) -> dict:
    """Ids present, payload a JSON object (returned), repeat_times positive when given, size within
    ``max_bytes``."""
    _check_id(task.task_id, "task_id")
    if not task.workflow:
        _fail("missing-workflow", f"task {task.task_id!r} names no workflow")
    size = len(task.payload) + len(task.task_id) + len(task.workflow) + len(task.taskset)
    if max_bytes is not None and size > max_bytes:
        _fail("oversized", f"task {task.task_id!r} is {size:,} bytes (limits.max_task_bytes = {max_bytes:,})")
    if task.repeat_times is not None and task.repeat_times < 1:
        _fail("out-of-range", f"task {task.task_id!r} asks for repeat_times = {task.repeat_times} (>= 1)")
    try:
        payload = json.loads(task.payload) if task.payload else {}
    except (json.JSONDecodeError, RecursionError) as exc:
        _fail("bad-payload", f"task {task.task_id!r}: payload is not JSON ({exc})")
    if not isinstance(payload, dict):
        _fail("bad-payload", f"task {task.task_id!r}: payload must be a JSON object, not {type(payload).__name__}")
    return payload


def check_request(request: RolloutRequest, max_task_bytes: int | None = None) -> None:
    """Ids and counts in range and the task's fields. Not its payload's schema: a request is the explorer's,
    and a payload its workflow cannot use (a task of a file taskset) FAILS with a result the explorer counts,
    where a dead letter would leave its step waiting."""
    _check_id(request.request_id, "request_id")
    _check_count(request.step, f"request {request.request_id!r}: step")
    _check_count(request.repeat_times, f"request {request.request_id!r}: repeat_times", minimum=1)
    _check_count(request.min_model_version, f"request {request.request_id!r}: min_model_version")
    check_task_fields(request.task, max_task_bytes)


# -- experiences ----------------------------------------------------------------------------------------------
def check_experience(experience: Experience, vocab_size: int | None = None, max_tokens: int | None = None) -> None:
    """Packed arrays that line up with ``prompt_length``, token ids inside the vocabulary, no more tokens than
    the model has positions (``max_tokens``), finite numbers."""
    e = experience
    _check_id(e.eid, "eid")
    _check_id(e.group_id, f"experience {e.eid!r}: group_id")
    where = f"experience {e.eid!r}"
    _check_count(e.step, f"{where}: step")
    _check_count(e.model_version, f"{where}: model_version")
    if e.last_model_version != -1 and e.last_model_version < e.model_version:
        _fail("out-of-range", f"{where}: last_model_version {e.last_model_version} is older than its first "
                              f"version {e.model_version}")
    _check_count(e.run_index, f"{where}: run_index")
    _check_count(e.group_size, f"{where}: group_size")
    if len(e.tokens) % 4:
        _fail("experience-lengths", f"{where}: tokens has {len(e.tokens)} bytes, not a multiple of 4 (int32)")
    n_tokens = len(e.tokens) // 4
    if max_tokens is not None and n_tokens > max_tokens:
        _fail("oversized", f"{where}: {n_tokens} tokens; the model has {max_tokens} positions")
    if not 1 <= e.prompt_length < n_tokens:
        _fail("experience-lengths", f"{where}: prompt_length {e.prompt_length} of {n_tokens} tokens leaves no "
                                    "prompt or no response")
    response = n_tokens - e.prompt_length
    for name, data, width in (("logprobs", e.logprobs, 4), ("action_mask", e.action_mask, 1),
                              ("token_rewards", e.token_rewards, 4), ("teacher_logprobs", e.teacher_logprobs, 4)):
        if data is not None and len(data) != response * width:
            _fail("experience-lengths", f"{where}: {name} has {len(data)} bytes for {response} response tokens "
                                        f"({response * width} expected)")
    if not math.isfinite(e.reward):
        _fail("non-finite", f"{where}: reward is {e.reward}")
    ids = e.token_array
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        _fail("token-out-of-vocab", f"{where}: token ids span [{ids.min()}, {ids.max()}], the vocabulary "
                                    f"has {vocab_size} ids")
    logprobs = e.logprob_array
    if not np.all(np.isfinite(logprobs)) or np.any(logprobs > 1e-3):
        _fail("bad-logprobs", f"{where}: logprobs must be finite and <= 0")
    if e.token_rewards is not None and not np.all(np.isfinite(e.token_reward_array)):
        _fail("non-finite", f"{where}: token_rewards are not all finite")
    if e.teacher_logprobs is not None:
        teacher = unpack_f32(e.teacher_logprobs)
        if not np.all(np.isfinite(teacher)) or np.any(teacher > 1e-3):
            _fail("bad-logprobs", f"{where}: teacher_logprobs must be finite and <= 0")
    try:  # what the advantage estimators read of its metrics and info (ReMax's baseline, GiGPO's turns)
        check_extras(e.metrics, e.info, response)
    except ValueError as exc:
        _fail("bad-extras", f"{where}: {exc}")
    if e.objective != Objective.RL:
        _check_supervised(e, where)


def _check_supervised(e: Experience, where: str) -> None:
    """An SFT or DPO record (``streamrft data produce``): something to train on, and a DPO record one side of a
    pair (its group is the pair: group_size 2, run_index 0 the chosen response, 1 the rejected)."""
    if e.objective == Objective.DPO and (e.group_size != 2 or e.run_index not in (0, 1)):
        _fail("bad-pair", f"{where}: a DPO record is one side of a pair (group_size 2, run_index 0 chosen or 1 "
                          f"rejected), not group_size {e.group_size}, run_index {e.run_index}")
    if e.objective == Objective.SFT and e.group_size < 1:
        _fail("out-of-range", f"{where}: an SFT record names its group's size (1 for a conversation of its own)")
    if not e.action_mask_array.any():
        _fail("no-trained-tokens", f"{where}: its action_mask trains no token ({e.objective.value} learns from the "
                                   "assistant's tokens)")


# -- results and metrics ----------------------------------------------------------------------------------------
def check_result(result: RolloutResult) -> None:
    _check_id(result.request_id, "request_id")
    if result.error is not None and len(result.error) > MAX_ERROR_CHARS:
        _fail("oversized", f"result {result.request_id!r}: error text of {len(result.error):,} characters")
    _check_count(result.step, f"result {result.request_id!r}: step")
    _check_count(result.n, f"result {result.request_id!r}: n")
    for name in ("reward_mean", "reward_std", "reward_min", "reward_max", "accuracy", "response_length_mean"):
        if not math.isfinite(getattr(result, name)):
            _fail("non-finite", f"result {result.request_id!r}: {name} is {getattr(result, name)}")


def check_receipt(receipt: FeedbackReceipt) -> None:
    """Ids present, counts in range, a finite reward, the run index inside its group."""
    _check_id(receipt.response_id, "response_id")
    _check_id(receipt.eid, f"receipt of {receipt.response_id!r}: eid")
    _check_id(receipt.group_id, f"receipt of {receipt.response_id!r}: group_id")
    _check_count(receipt.choice, f"receipt of {receipt.response_id!r}: choice")
    _check_count(receipt.model_version, f"receipt of {receipt.response_id!r}: model_version")
    _check_count(receipt.group_size, f"receipt of {receipt.response_id!r}: group_size", minimum=1)
    if not 0 <= receipt.run_index < receipt.group_size:
        _fail("out-of-range", f"receipt of {receipt.response_id!r}: run_index {receipt.run_index} outside its "
                              f"group of {receipt.group_size}")
    if not math.isfinite(receipt.reward):
        _fail("non-finite", f"receipt of {receipt.response_id!r}: reward {receipt.reward}")


def check_metric(metric: Metric) -> None:
    """Names the monitor can export; the value may be NaN (a metric with no samples) but not infinite."""
    if not metric.name:
        _fail("bad-metric-name", "metric has no name")
    if len(metric.name) > MAX_METRIC_NAME:
        _fail("oversized", f"metric name of {len(metric.name):,} characters (at most {MAX_METRIC_NAME})")
    if not metric.source or not metric.role:
        _fail("missing-id", f"metric {metric.name!r} has no source or role")
    if math.isinf(metric.value):
        _fail("non-finite", f"metric {metric.name!r} = {metric.value}")
    if not -1 <= metric.step <= MAX_VERSION:
        _fail("out-of-range", f"metric {metric.name!r}: step {metric.step} outside [-1, {MAX_VERSION}]")


# -- sync signals -----------------------------------------------------------------------------------------------
TRAINER_SIGNALS = frozenset({SyncKind.WEIGHTS_PUBLISHED, SyncKind.SYNC_REQUEST, SyncKind.NCCL_READY})
EXPLORER_SIGNALS = frozenset({SyncKind.EXPLORER_STATE, SyncKind.CANCEL_STEP})


def _check_signal_kind(signal: SyncSignal, kinds: frozenset[SyncKind], topic: str) -> None:
    if signal.kind not in kinds:
        other = "control (the explorer's)" if topic == "sync" else "sync (the trainer's)"
        _fail("wrong-topic", f"a {signal.kind.value} signal on {topic}: that kind belongs on {other}")
    _check_count(signal.version, f"{signal.kind.value} signal: version")
    _check_count(signal.step, f"{signal.kind.value} signal: step", minimum=-1)
    if kinds is EXPLORER_SIGNALS:
        _check_count(signal.explorer_step, f"{signal.kind.value} signal: explorer step")
    if len(signal.state) > MAX_STATE_BYTES:
        _fail("oversized", f"{signal.kind.value} signal: state of {len(signal.state):,} characters")


def check_control(signal: SyncSignal) -> None:
    """An explorer signal (on ``control``): its kind, versions in range, explorer state that parses."""
    _check_signal_kind(signal, EXPLORER_SIGNALS, "control")
    if signal.kind == SyncKind.EXPLORER_STATE:
        ExplorerState.from_json(signal.state)


def check_sync(signal: SyncSignal, weights_method: str | None = None, weights_url: str | None = None) -> None:
    """A trainer signal (on ``sync``): its kind, versions in range, only the transport this run uses
    (``weights_method``: ``object_store`` or ``collective``) and, for object-store weights, a sha256 and a URI
    that is exactly where this run's store (``weights_url``) keeps that version of that lineage, and for the
    collective kinds the state the trainer writes (``engines.weights.signal_state``). A forged signal
    must not become the roles' newest weights even for a moment: it would hide the real signal of the same
    version. What only the bytes can tell (the manifest's own version, its sha256, the shards) the weight
    follower checks when it loads."""
    _check_signal_kind(signal, TRAINER_SIGNALS, "sync")
    if signal.kind in (SyncKind.WEIGHTS_PUBLISHED, SyncKind.NCCL_READY) and weights_method is not None:
        expected = "COLLECTIVE" if weights_method == "collective" else "OBJECT_STORE"
        if signal.kind == SyncKind.NCCL_READY and expected != "COLLECTIVE":
            _fail("wrong-transport", "NCCL_READY in a run whose trainer.weights.method is object_store")
        if signal.method.value != expected:
            _fail("wrong-transport", f"{signal.kind.value} v{signal.version} by {signal.method.value}; this run's "
                                     f"trainer.weights.method is {weights_method}")
    if signal.kind == SyncKind.WEIGHTS_PUBLISHED:
        _check_weights(signal, weights_url)
    if signal.kind == SyncKind.NCCL_READY:
        _check_announcement(signal)


def _check_weights(signal: SyncSignal, weights_url: str | None) -> None:
    """An object-store version is exactly where this run's store keeps it; a collective one's delivery state is
    what the trainer writes, and its catch-up copy (if any) is where an object-store signal of that version
    would be. ``weights_url`` None: the location is not checked."""
    if signal.method == SyncMethod.OBJECT_STORE:
        if weights_url is not None:
            _check_weights_location(signal, weights_url)
        return
    try:
        delivery = DeliveryState.parse(signal.state)
    except ValueError as exc:
        _fail("bad-state", f"WEIGHTS_PUBLISHED v{signal.version} (collective): {exc}")
    if delivery.catch_up and weights_url is not None:
        _check_weights_location(replace(signal, method=SyncMethod.OBJECT_STORE, uri=delivery.catch_up), weights_url)


def _check_announcement(signal: SyncSignal) -> None:
    """An NCCL_READY names the membership store (a tcp:// address) and carries what the trainer writes."""
    if not signal.uri.startswith("tcp://"):
        _fail("bad-announcement", f"NCCL_READY: its membership store {signal.uri!r} is not a tcp:// address")
    try:
        Announcement.parse(signal.state)
    except ValueError as exc:
        _fail("bad-announcement", f"NCCL_READY: {exc}")


def _check_weights_location(signal: SyncSignal, weights_url: str) -> None:
    if not is_sha256(signal.sha256):
        _fail("missing-sha256", f"WEIGHTS_PUBLISHED v{signal.version} carries no sha256 of its manifest")
    try:
        check_lineage(signal.lineage)
        check_manifest_uri(weights_url, signal.uri, signal.version, signal.lineage)
    except Exception as exc:  # ForeignUriError, ValueError of a lineage, a protocol fsspec does not know
        _fail("foreign-uri", f"WEIGHTS_PUBLISHED v{signal.version}: {exc}")


# The check of what each topic kind holds (streamrft/config/topics.py): one per kind, applied where a role reads
# it (RoleRuntime.consumer and SyncView bind the run's options: sizes, the model's vocabulary, the weights store).
TOPIC_CHECKS: dict[str, Callable[..., None]] = {
    "tasks": check_task,
    "rollouts": check_request,
    "experiences": check_experience,
    "results": check_result,
    "sync": check_sync,
    "control": check_control,
    "metrics": check_metric,
    "feedback": check_receipt,
}
