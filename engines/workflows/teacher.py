"""Teacher forcing for on-policy distillation: a teacher's logprobs of tokens the student already sampled.

The student samples; the teacher reads prompt + response in one forward pass (nothing is generated) and gives
``log_softmax(teacher_logits / T)`` of each response token -- the numbers the trainer compares with the
student's own (``advantage: distill``, ``engines/algorithms/advantages.py``). Token ids are compared position by
position, so teacher and student must share one tokenizer: :func:`check_same_tokenizer` refuses any other at
the worker's start.

A scorer has the calls interface a lane of the workflow scheduler drives (``submit`` / ``step`` / ``abort``, a
batch backend): the teacher calls of every workflow that has finished sampling go through one batched forward.
The transformers engine's model is teacher-forced in-process, in chunks of at most ``max_tokens`` tokens (the
logits of a chunk are tokens x vocabulary floats).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ..inference.base import EngineError, Finished, InferenceEngine

MAX_TOKENS_PER_FORWARD = 4096


def check_same_tokenizer(policy: Any, teacher: Any, teacher_name: str) -> None:
    """Raise :class:`EngineError` unless ``teacher`` maps every token to the same id as ``policy`` does."""
    mine, theirs = policy.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    differ = sorted(token for token in set(mine) | set(theirs) if mine.get(token) != theirs.get(token))
    raise EngineError(
        f"auxiliary model {teacher_name!r} cannot be the teacher: its tokenizer is not the policy's "
        f"({len(theirs)} tokens against {len(mine)}; {len(differ)} differ, e.g. {differ[:3]}). Distillation "
        "scores the student's token ids under the teacher, so both must share one vocabulary: choose a teacher "
        "of the policy's model family (distillation.teacher names it)")


def scorer_for(engine: InferenceEngine) -> "TransformersScorer":
    """The scorer that teacher-forces ``engine``'s model."""
    if engine.kind == "transformers":
        return TransformersScorer(engine)
    raise EngineError(f"a {engine.kind} engine cannot score given tokens; the teacher's auxiliary model needs "
                      "engine: transformers")


def teacher_forced_logprobs(model: Any, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                            temperature: float = 1.0, *, pad_token_id: int = 0,
                            max_tokens: int = MAX_TOKENS_PER_FORWARD) -> list[list[float]]:
    """Per sequence, ``log_softmax(logits / temperature)`` (fp32) of each token after its prompt under ``model``,
    in forward passes of at most ``max_tokens`` padded tokens (one sequence when it is longer alone)."""
    import torch

    out: list[list[float]] = []
    for rows in _chunks([len(s) for s in sequences], max_tokens):
        width = max(len(sequences[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):  # right-padded: a causal model's real tokens never see the padding
            ids[r, : len(sequences[i])] = torch.tensor(list(sequences[i]))
            attention[r, : len(sequences[i])] = 1
        device = next(model.parameters()).device
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
            logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
            chosen = logprobs.gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
        for r, i in enumerate(rows):  # logit at position t - 1 predicts token t
            out.append(chosen[r, prompt_lengths[i] - 1 : len(sequences[i]) - 1].tolist())
    return out


def _chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive row indices, each chunk's rows x longest row at most ``max_tokens`` (at least one row)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(length, *(lengths[j] for j in current)) > max_tokens:
            chunks.append(current)
            current = []
        current.append(i)
    return chunks + [current] if current else chunks


class TransformersScorer:
    """Teacher forcing on a transformers engine's model, as a batch backend of a scheduler lane."""

    incremental = False

    def __init__(self, engine: InferenceEngine, max_tokens: int = MAX_TOKENS_PER_FORWARD) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self._calls: list[tuple[Hashable, list[list[int]], list[int], float]] = []

    def submit(self, key: Hashable, sequences: list[list[int]], prompt_lengths: list[int],
               temperature: float) -> None:
        self._calls.append((key, sequences, prompt_lengths, temperature))

    def step(self) -> list[Finished]:
        """Every submitted call, one batch per temperature; when a batch fails, each call again alone, so the
        call that breaks the model fails alone."""
        calls, self._calls = self._calls, []
        finished: list[Finished] = []
        for temperature in sorted({call[3] for call in calls}):
            group = [call for call in calls if call[3] == temperature]
            try:
                finished += self._score(group, temperature)
            except Exception:
                for call in group:
                    try:
                        finished += self._score([call], temperature)
                    except Exception as exc:
                        finished.append((call[0], exc))
        return finished

    def _score(self, calls: list, temperature: float) -> list[Finished]:
        rows = teacher_forced_logprobs(self.engine.model, [s for c in calls for s in c[1]],
                                       [p for c in calls for p in c[2]], temperature,
                                       pad_token_id=self.engine.pad_token_id, max_tokens=self.max_tokens)
        finished, start = [], 0
        for key, sequences, _, _ in calls:
            finished.append((key, rows[start : start + len(sequences)]))
            start += len(sequences)
        return finished

    def abort(self, keys: Sequence[Hashable]) -> None:
        dropped = set(keys)
        self._calls = [call for call in self._calls if call[0] not in dropped]


def reverse_kl(student: Any, teacher: Any, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
               temperature: float = 1.0) -> float:
    """The exact per-token reverse KL, ``KL(π_student ‖ π_teacher) = Σ_v p_s(v) (log p_s(v) − log p_t(v))`` over
    the whole vocabulary, averaged over the response positions of ``sequences`` (both models teacher-forced; the
    responses are best the student's own samples: that is the KL on-policy distillation minimises)."""
    import torch

    total, count = 0.0, 0
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        ids = torch.tensor([list(sequence)])
        with torch.inference_mode():
            span = slice(prompt_length - 1, len(sequence) - 1)
            log_s = torch.log_softmax(student(input_ids=ids).logits[0, span].float() / temperature, -1)
            log_t = torch.log_softmax(teacher(input_ids=ids).logits[0, span].float() / temperature, -1)
            total += float((log_s.exp() * (log_s - log_t)).sum())
            count += log_s.shape[0]
    return total / max(count, 1)
