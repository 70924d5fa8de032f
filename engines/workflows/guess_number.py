"""``guess_number``: a multi-turn text environment.

Payload ``{"target": 37, "low": 1, "high": 100, "max_turns": 6}`` (``low``/``high``/``max_turns`` optional).
The model guesses; the environment answers "Higher." / "Lower." / "Correct!" (or asks for a number when the
reply has none) as a user turn; the episode ends when the guess is right or after ``max_turns`` model turns.

One sample is the whole conversation: the prompt is the opening question, the response is model turns and
environment turns interleaved, and ``action_mask`` is 1 exactly on the tokens the model sampled (environment
tokens get mask 0 and logprob 0.0). Reward: 1.0 when the number was found, else 0.0 (a reward named by the task
is applied to the last model turn instead). ``truncated`` is true when any model turn hit ``max_tokens``.
The ``repeat_times`` episodes advance together, one batched engine call per turn; episode ``k`` samples turn
``t`` with seed ``seed + t * repeat_times + k`` when a seed is set.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..inference.base import Completion, Message
from .base import Workflow, WorkflowSample, chat_suffix_ids
from .registry import register_workflow
from .rewards import Reward, final_number


@dataclass
class _Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    invalid: int = 0
    found: bool = False
    truncated: bool = False
    last_text: str = ""
    transcript: list[str] = field(default_factory=list)
    model_version: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, completion: Completion) -> None:
        self.response_ids += completion.response_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.response_ids)
        self.turns += 1
        self.truncated |= completion.truncated
        self.last_text = completion.text
        self.transcript.append(f"assistant: {completion.text}")
        self.model_version = completion.model_version

    def add_env_turn(self, ids: list[int], text: str) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.transcript.append(f"user: {text}")


@register_workflow("guess_number")
class GuessNumberWorkflow(Workflow):
    default_reward = None  # the environment's own outcome, unless the task names a reward

    def opening(self, low: int, high: int) -> list[Message]:
        return [
            {
                "role": "user",
                "content": f"I am thinking of a whole number from {low} to {high}. Guess it. After each guess I "
                "will say whether my number is higher or lower. Reply with just your guess.",
            }
        ]

    @staticmethod
    def reply(guess: Any, target: int) -> str:
        if guess is None or guess.denominator != 1:
            return "Please reply with a whole number."
        if guess < target:
            return "Higher."
        if guess > target:
            return "Lower."
        return "Correct!"

    def run(self, task, payload, engine, repeat_times, sampling):
        if "target" not in payload:
            raise KeyError("the task payload has no 'target'")
        target = int(payload["target"])
        low, high = int(payload.get("low", 1)), int(payload.get("high", 100))
        max_turns = int(payload.get("max_turns", 6))
        self.limits.check_turns(max_turns)
        opening = self.opening(low, high)
        prompt_ids = engine.prompt_ids(opening)
        episodes = [_Episode(prompt_ids=list(prompt_ids)) for _ in range(repeat_times)]

        for turn in range(max_turns):
            active = [k for k, ep in enumerate(episodes) if not ep.found]
            if not active:
                break
            params = [
                sampling.replace(seed=None if sampling.seed is None else sampling.seed + turn * repeat_times + k)
                for k in active
            ]
            outputs = engine.generate([episodes[k].context for k in active], params, n=1)
            for k, (completion,) in zip(active, outputs):
                episode = episodes[k]
                episode.add_model_turn(completion)
                guess = final_number(completion.text)
                answer = self.reply(guess, target)
                episode.invalid += answer.startswith("Please")
                episode.found = answer == "Correct!"
                if episode.found or turn == max_turns - 1:
                    continue  # the episode ends on the model's turn
                suffix = chat_suffix_ids(
                    engine, opening, [{"role": "user", "content": answer}], after_eos=completion.ended_with_eos
                )
                episode.add_env_turn(suffix, answer)

        return [self._sample(ep, opening, payload) for ep in episodes]

    def _sample(self, episode: _Episode, opening: list[Message], payload: Mapping[str, Any]) -> WorkflowSample:
        if self.reward_fn is not None:
            reward = self.score(episode.last_text, payload)
        else:
            reward = Reward(1.0 if episode.found else 0.0, correct=episode.found)
        return WorkflowSample(
            tokens=episode.context,
            prompt_length=len(episode.prompt_ids),
            logprobs=episode.logprobs,
            action_mask=episode.mask,
            reward=reward.value,
            truncated=episode.truncated,
            prompt_text=opening[-1]["content"],
            response_text="\n".join(episode.transcript),
            metrics={
                "turns": float(episode.turns),
                "invalid_guesses": float(episode.invalid),
                "response_length": float(len(episode.response_ids)),
                **reward.metrics,
            },
            info={"found": str(episode.found).lower()},
            correct=reward.correct,
            model_version=episode.model_version,
        )
