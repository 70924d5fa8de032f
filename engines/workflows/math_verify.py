r"""``reward_fn: math_verify``: symbolic equivalence of the response's final answer and the payload's ``answer``
with HuggingFace's ``math-verify`` (``pip install 'streamrft[math]'``), so ``\frac{1}{2}``, ``0.5`` and ``1/2``
are one answer, ``x = 2`` answers ``2``, and ``\boxed{}`` answers are read.

math-verify bounds its own time with signals, which only work on a process's main thread; rewards run on the
rollout core's thread. So it is called with its timeouts off, in a child process of its own that is killed when
an answer takes longer than :data:`TIME_LIMIT_S` (sympy can spin on a pathological expression; a thread could
not be stopped). Such an answer scores 0, as math-verify scores its own timeouts, and says so in its metrics.
"""
from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from .registry import register_reward
from .rewards import Reward

logger = logging.getLogger(__name__)

TIME_LIMIT_S = 5.0  # per answer; a first call also waits for the child to import sympy (START_LIMIT_S)
START_LIMIT_S = 60.0


def equivalent(gold: str, answer: str) -> bool:
    """Whether ``answer`` (a model's text) states ``gold`` (a reference, LaTeX or plain). Runs math-verify in
    the calling thread with no time limit: for the child process, and for callers on a main thread."""
    from math_verify import parse, verify

    # the reference as a boxed answer, so a bare "\frac{1}{2}" or "2" is read whole whatever its delimiters
    reference = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    given = parse(answer, parsing_timeout=None)
    return bool(reference and given and verify(reference, given, timeout_seconds=None))


def serve_stdio() -> None:
    """The child: one JSON ``[gold, answer]`` a line on stdin, one JSON verdict a line on stdout (true, false,
    or a string: the error that made the answer unreadable), until stdin closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the parent keeps time
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            verdict: bool | str = equivalent(gold, answer)
        except Exception as exc:  # an unreadable answer is the answer's problem, not the child's
            verdict = f"{type(exc).__name__}: {exc}"
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


class Verifier:
    """One child process running :func:`equivalent`, restarted after a timeout. A child of its own rather than
    multiprocessing's, which would run the parent's main module again. Thread-safe: one answer at a time."""

    def __init__(self, time_limit_s: float = TIME_LIMIT_S) -> None:
        self.time_limit_s = time_limit_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None

    def check(self, gold: str, answer: str) -> bool | None:
        """True or False, or None when the answer took longer than the time limit."""
        with self._lock:
            first = self._process is None
            process = self._process = self._process or self._start()
            process.stdin.write(json.dumps([gold, answer]) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], START_LIMIT_S if first else self.time_limit_s)
            line = process.stdout.readline() if ready else ""
            if not line:
                logger.warning("math_verify: no verdict in %.0f s for answer %.80r; restarting its process",
                               self.time_limit_s, answer)
                self.close()
                return None
        verdict = json.loads(line)
        if isinstance(verdict, str):
            logger.debug("math_verify: %s (answer %.80r): scored as wrong", verdict, answer)
            return False
        return verdict

    @staticmethod
    def _start() -> subprocess.Popen:
        try:
            import math_verify  # noqa: F401  (fail here, with the fix, rather than in the child)
        except ImportError as exc:
            raise ImportError(f"reward_fn math_verify needs the math-verify package ({exc}); install it with "
                              "`pip install 'streamrft[math]'`") from exc
        command = [sys.executable, "-c", f"from {__name__} import serve_stdio; serve_stdio()"]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def close(self) -> None:
        if self._process is None:
            return
        self._process.kill()
        self._process.wait(timeout=5)
        for pipe in (self._process.stdin, self._process.stdout):
            pipe.close()
        self._process = None


_verifier = Verifier()


@register_reward("math_verify")
def math_verify(response: str, payload: Mapping[str, Any]) -> Reward:
    r"""1.0 when the response's final answer (its last ``\boxed{}``, else its last expression) equals the
    payload's ``answer`` symbolically, else 0.0; an answer that is not checked in :data:`TIME_LIMIT_S` scores 0
    with ``reward/math_verify_timeout`` = 1."""
    if "answer" not in payload:
        raise KeyError("the task payload has no 'answer'")
    verdict = _verifier.check(str(payload["answer"]), response)
    correct = bool(verdict)
    return Reward(1.0 if correct else 0.0, correct=correct,
                  metrics={"reward/math_verify_timeout": float(verdict is None)})
