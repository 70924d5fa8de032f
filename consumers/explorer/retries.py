"""Retries (``explorer.max_retries``): a FAILED or TIMEOUT task with retries left is published again under a new
request id (``<first attempt>-retryN``), which replaces the failed one in its round — and in the explorer's state,
in the same transaction. The failed attempt is kept for the step's metrics (``rollout/retries``,
``retried_failed``, ``retried_timeout``). After an explorer restart the rounds in flight know their requests by id
only: their failures are not retried."""
from __future__ import annotations

import dataclasses

from streamrft.schemas import RolloutRequest, RolloutResult, RolloutStatus

from .rounds import Round

RETRIED = (RolloutStatus.FAILED, RolloutStatus.TIMEOUT)


class Retries:
    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries

    def retry(self, round_: Round, result: RolloutResult, deadline_ms: int | None) -> RolloutRequest | None:
        """The request to publish again for ``result``, already put in its round in place of the failed one;
        None when ``result`` is final (it succeeded, was cancelled, has no retries left, or its request is
        known by id only)."""
        request = round_.requests.get(result.request_id)
        if request is None or result.status not in RETRIED:
            return None
        first = round_.first_attempt.get(result.request_id, result.request_id)
        attempts = round_.retries.get(first, 0) + 1
        if attempts > self.max_retries:
            return None
        retry = dataclasses.replace(request, request_id=f"{first}-retry{attempts}", deadline_ms=deadline_ms)
        del round_.requests[result.request_id]
        round_.requests[retry.request_id] = retry
        round_.first_attempt[retry.request_id] = first
        round_.retries[first] = attempts
        round_.attempts.append(result)
        return retry
