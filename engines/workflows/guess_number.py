"""``guess_number``: a multi-turn text game, run as an episode (:mod:`.episode`).

Payload ``{"target": 37, "low": 1, "high": 100, "max_turns": 6}`` (``low``/``high``/``max_turns`` optional).
The model guesses; the environment answers "Higher." / "Lower." / "Correct!" (or asks for a number when the
reply has none) as a user turn. The game ends when the guess is right or after ``max_turns`` guesses (its own
rule: not a truncation). Reward: 1.0 when the number was found, else 0.0 (a reward named by the task is applied
to the last model turn instead). Metrics: ``invalid_guesses`` besides the episode's own.
"""
from __future__ import annotations

from typing import Any

from .episode import Environment, Turn
from .registry import register_environment
from .rewards import Reward, final_number


@register_environment("guess_number")
class GuessNumber(Environment):
    def __init__(self, payload) -> None:
        super().__init__(payload)
        if "target" not in payload:
            raise KeyError("the task payload has no 'target'")
        self.target = int(payload["target"])
        self.low, self.high = int(payload.get("low", 1)), int(payload.get("high", 100))
        self.max_turns = int(payload.get("max_turns", 6))
        self.guesses = 0
        self.invalid = 0
        self.found = False

    def opening(self):
        return [
            {
                "role": "user",
                "content": f"I am thinking of a whole number from {self.low} to {self.high}. Guess it. After each "
                "guess I will say whether my number is higher or lower. Reply with just your guess.",
            }
        ]

    def step(self, text: str) -> Turn:
        self.guesses += 1
        answer = self.reply(final_number(text), self.target)
        self.invalid += answer.startswith("Please")
        self.found = answer == "Correct!"
        return Turn([{"role": "user", "content": answer}], done=self.found or self.guesses >= self.max_turns)

    @staticmethod
    def reply(guess: Any, target: int) -> str:
        if guess is None or guess.denominator != 1:
            return "Please reply with a whole number."
        if guess < target:
            return "Higher."
        if guess > target:
            return "Lower."
        return "Correct!"

    def outcome(self) -> Reward:
        return Reward(1.0 if self.found else 0.0, correct=self.found)

    def metrics(self) -> dict[str, float]:
        return {"invalid_guesses": float(self.invalid)}

    def info(self) -> dict[str, str]:
        return {"found": str(self.found).lower()}
