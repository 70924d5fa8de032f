"""GiGPO and step-wise GRPO (engines/algorithms/gigpo.py) against the paper's formulas by hand, and on a scripted
set of multi-turn episodes through the real pieces: the episode workflow records each turn's state, the record
carries it, the trainer's collate and advantage step turn it into anchor groups."""
from __future__ import annotations

import json
import math

import pytest
import torch

from streamrft.engines.algorithms.catalog import ADVANTAGES
from streamrft.engines.inference import SamplingParams
from streamrft.engines.inference.fake import FakeEngine
from streamrft.engines.settings.training import TrainingSettings
from streamrft.engines.training.advantage_step import fill_advantages
from streamrft.engines.training.batch import collate
from streamrft.engines.workflows import Environment, Turn, register_environment, run_workflow, unregister_environment
from streamrft.engines.workflows.rewards import Reward
from streamrft.schemas import InvalidRecordError, RolloutKind, Task
from streamrft.schemas.experience_extras import TURN_STATES, decode_turn_states
from streamrft.validation import check_experience

from .test_episodes import spans

S3 = 1 / math.sqrt(3)  # 0.577…


def _three_episodes():
    """Group g: three episodes of two model turns (token 2 is the environment's), states A=0, B=1, C=2:
    episode 0: A then B, outcome 1; episode 1: A then C, outcome 0; episode 2: A (with a turn reward 0.5 on its
    token 0) then B, outcome 0. Group h: one episode in state A, which is not g's A (another task)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    token_rewards = torch.zeros(4, 5)
    token_rewards[2, 0] = 0.5
    turn_index = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, -1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    turn_state = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 2, -1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    inputs = dict(token_rewards=token_rewards, turn_index=turn_index, turn_state=turn_state)
    return rewards, mask, ["g", "g", "g", "h"], inputs


def test_gigpo_adds_the_anchor_state_advantage_to_the_episodes():
    """Feng et al. 2025 §4: A = A^E + ω·A^S, γ = 0.5, ω = 1. By hand:
    A^E (§4.1): scores 1, 0, 0.5 (0 + its turn reward): mean 0.5, std 0.5 -> 1, −1, 0; h alone -> 0.
    Returns R_t = Σ γ^(k−t) r_k (§4.2): episode 0: r = (0, 1) -> R = (0.5, 1); 1: (0, 0); 2: r = (0.5, 0) ->
    (0.5, 0). Anchor groups: A = {0.5, 0, 0.5}: mean 1/3, std 1/√12 -> (1/√3, −2/√3, 1/√3); B = {1, 0}: ±1/√2;
    C = {0} alone -> 0; h's A alone -> 0."""
    rewards, mask, groups, inputs = _three_episodes()
    adv = ADVANTAGES.get("gigpo")(rewards, mask, groups, **inputs, gamma=0.5, step_weight=1.0)
    r2 = 1 / math.sqrt(2)
    expected = torch.tensor([
        [1 + S3, 1 + S3, 0, 1 + r2, 1 + r2],
        [-1 - 2 * S3, -1 - 2 * S3, 0, -1, 0],
        [S3, 0, 0, -r2, -r2],
        [0, 0, 0, 0, 0],
    ])
    assert torch.allclose(adv, expected, atol=1e-4)


def test_step_grpo_is_the_anchor_state_advantage_alone_and_normalize_false_drops_the_std():
    rewards, mask, groups, inputs = _three_episodes()
    step = ADVANTAGES.get("step_grpo")(rewards, mask, groups, **inputs, gamma=0.5)
    r2 = 1 / math.sqrt(2)
    assert torch.allclose(step, torch.tensor([[S3, S3, 0, r2, r2], [-2 * S3, -2 * S3, 0, 0, 0],
                                              [S3, 0, 0, -r2, -r2], [0, 0, 0, 0, 0]]), atol=1e-4)
    # F_norm = 1: A^E = s − mean = (0.5, −0.5, 0); A^S: A = (1/6, −1/3, 1/6), B = ±0.5; ω = 2
    raw = ADVANTAGES.get("gigpo")(rewards, mask, groups, **inputs, gamma=0.5, step_weight=2.0, normalize=False)
    assert torch.allclose(raw, torch.tensor([[0.5 + 1 / 3, 0.5 + 1 / 3, 0, 1.5, 1.5],
                                             [-0.5 - 2 / 3, -0.5 - 2 / 3, 0, -0.5, 0],
                                             [1 / 3, 0, 0, -1, -1], [0, 0, 0, 0, 0]]), atol=1e-5)


def test_without_turns_each_row_is_one_turn_in_its_prompts_state():
    """A single-turn group: every answer is taken in the same state, so A^S = A^E and GiGPO is (1 + ω)·GRPO."""
    rewards, mask = torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 2)
    grpo = ADVANTAGES.get("grpo")(rewards, mask, ["g"] * 3)
    assert torch.allclose(ADVANTAGES.get("gigpo")(rewards, mask, ["g"] * 3, step_weight=0.5), 1.5 * grpo)


# -- a scripted set of episodes, from the workflow to the advantage -----------------------------------------------

ACTIONS = [["right", "right", "stay"], ["stay", "right", "right"], ["right", "left", "right"]]


class Corridor(Environment):
    """Positions 0..; the goal is position 2. The state is the position (not the way there)."""

    def __init__(self, payload) -> None:
        super().__init__(payload)
        self.position, self.max_turns = 0, 3

    def opening(self):
        return [{"role": "user", "content": "Walk to position 2: say left, right or stay."}]

    def step(self, text: str) -> Turn:
        self.position = max(0, self.position + {"left": -1, "right": 1}.get(text.strip(), 0))
        return Turn([{"role": "user", "content": f"You are at {self.position}."}], done=self.position == 2)

    def outcome(self) -> Reward:
        return Reward(float(self.position == 2))

    def state(self) -> str:
        return str(self.position)


class Scripted(FakeEngine):
    """Episode k says ACTIONS[k][t] at turn t (the episode workflow seeds turn t of episode k with t·3 + k)."""

    def _sample(self, prompt_ids, index, params):
        turn, episode = divmod(params.seed, len(ACTIONS))
        self.responder = lambda prompt, j: ACTIONS[episode][turn]
        return super()._sample(prompt_ids, index, params)


@pytest.fixture
def corridor():
    register_environment("test_corridor")(Corridor)
    yield Task(task_id="c1", workflow="test_corridor", payload=json.dumps({}))
    unregister_environment("test_corridor")


def _experiences(task, **environment):
    samples = run_workflow(task, Scripted(), repeat_times=3, sampling=SamplingParams(seed=0))
    experiences = [s.to_experience(eid=f"c/{k}", group_id="c", task_id="c1", step=0, kind=RolloutKind.TRAIN,
                                   run_index=k) for k, s in enumerate(samples)]
    for e in experiences:
        check_experience(e)
    return experiences


def test_gigpo_on_scripted_episodes_groups_turns_by_the_environments_state(corridor):
    """Episodes (0 = position 0): k0: 0 -right-> 1 -right-> 2 (done, reward 1); k1: 0 -stay-> 0 -right-> 1
    -right-> 2 (reward 1); k2: 0 -right-> 1 -left-> 0 -right-> 1 (cut after 3 turns, reward 0). With γ = 0.5:
    returns k0 (0.5, 1), k1 (0.25, 0.5, 1), k2 (0, 0, 0). Anchor state 0 = {k0t0 0.5, k1t0 0.25, k1t1 0.5,
    k2t0 0, k2t2 0}: mean 0.25, std 0.25 -> (1, 0, 1, −1, −1); state 1 = {k0t1 1, k1t2 1, k2t1 0}: mean 2/3,
    std 1/√3 -> (1/√3, 1/√3, −2/√3). A^E: scores (1, 1, 0) -> (1/√3, 1/√3, −2/√3). ω = 0.5."""
    experiences = _experiences(corridor)
    states = [[state for _, state in decode_turn_states(e.info[TURN_STATES], e.response_length)]
              for e in experiences]
    assert [len(s) for s in states] == [2, 3, 3]
    at0, at1 = states[0]
    assert states == [[at0, at1], [at0, at0, at1], [at0, at1, at0]] and at0 != at1
    batch = collate(experiences)
    fill_advantages(batch, TrainingSettings(advantage="gigpo", gigpo_step_weight=0.5, advantage_params={"gamma": 0.5}))
    per_turn = [[batch.advantages[k, a:b].unique().tolist() for a, b in spans(batch.response_mask[k].int().tolist())]
                for k in range(3)]
    e = [S3, S3, -2 * S3]
    expected = [[e[0] + 0.5, e[0] + 0.5 * S3], [e[1], e[1] + 0.5, e[1] + 0.5 * S3],
                [e[2] - 0.5, e[2] - 0.5 * 2 * S3, e[2] - 0.5]]
    for got, want in zip(per_turn, expected):
        assert [len(values) for values in got] == [1] * len(want)  # one advantage per turn
        assert [values[0] for values in got] == pytest.approx(want, abs=1e-4)


def test_without_a_state_of_its_own_an_environments_state_is_the_conversation(corridor, monkeypatch):
    """The same first turn for every episode (the same opening); later turns meet only after the same words."""
    monkeypatch.setattr(Corridor, "state", lambda self: None)
    experiences = _experiences(corridor)
    states = [[state for _, state in decode_turn_states(e.info[TURN_STATES], e.response_length)]
              for e in experiences]
    assert len({s[0] for s in states}) == 1
    assert states[0][1] == states[2][1]  # both said "right" at turn 0: the same conversation
    assert len({states[0][1], states[1][1]}) == 2 and len({*states[1][1:], *states[2][2:]}) == 3


def test_malformed_turn_states_are_refused_where_the_record_is_read(corridor):
    experience = _experiences(corridor)[0]
    for bad in ("0:ab,0:cd", "x:ab", f"{experience.response_length}:ab", "0:a-b"):
        experience.info[TURN_STATES] = bad
        with pytest.raises(InvalidRecordError, match=TURN_STATES) as caught:
            check_experience(experience)
        assert caught.value.reason == "bad-extras"
