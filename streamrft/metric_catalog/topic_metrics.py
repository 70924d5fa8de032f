"""The names the roles write to the run's ``metrics`` topic (``Metric.name``), declared once with their unit,
meaning and the roles that emit them, and the check applied where the records are built
(:class:`streamrft.telemetry.MetricsPublisher`).

A name with a part that varies declares it as a placeholder: ``eval/{taskset}/mean@{k}``. A placeholder matches
one path segment (no ``/``); ``{k}`` and ``{n}`` match a number. A name no declaration of its role covers is an
:class:`UndeclaredMetric` when ``STREAMRFT_STRICT_METRICS`` is set (the test suite sets it), else a warning,
once per name and role, and the record is written all the same: a dashboard gap is no reason to stop a run.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from .errors import UndeclaredMetric

logger = logging.getLogger(__name__)

HOME = "streamrft/metric_catalog/topic_metrics.py"
STRICT_ENV = "STREAMRFT_STRICT_METRICS"
PLACEHOLDERS = {"taskset": r"[^/]+", "reward": r"[^/]+", "k": r"[0-9]+", "n": r"[0-9]+"}
TOPIC_ROLES = ("explorer", "rollout", "trainer")  # the roles that write to the metrics topic


@dataclass(frozen=True)
class TopicMetric:
    name: str  # a name, or a pattern with {placeholders} of PLACEHOLDERS
    unit: str
    meaning: str
    roles: tuple[str, ...]

    @cached_property
    def regex(self) -> re.Pattern:
        parts = re.split(r"\{(\w+)\}", self.name)
        return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p]})"
                                  for i, p in enumerate(parts)))

    def covers(self, name: str, role: str) -> bool:
        return role in self.roles and self.regex.fullmatch(name) is not None


def _explorer(name: str, unit: str, meaning: str) -> TopicMetric:
    return TopicMetric(name, unit, meaning, ("explorer",))


def _worker(name: str, unit: str, meaning: str) -> TopicMetric:
    return TopicMetric(name, unit, meaning, ("rollout",))


def _trainer(name: str, unit: str, meaning: str) -> TopicMetric:
    return TopicMetric(name, unit, meaning, ("trainer",))


EXPLORER = (
    # one training step's results (streamrft/rollout_stats.py), at the step the explorer finished
    _explorer("rollout/tasks", "tasks", "tasks the step published"),
    _explorer("rollout/ok", "tasks", "tasks whose result is OK"),
    _explorer("rollout/failed", "tasks", "tasks whose result is FAILED"),
    _explorer("rollout/cancelled", "tasks", "tasks cancelled, or without a result when the step finished"),
    _explorer("rollout/timeout", "tasks", "tasks whose result is TIMEOUT"),
    _explorer("rollout/model_version", "version", "newest published weights version when the step finished"),
    _explorer("rollout/staleness", "versions", "the step minus rollout/model_version"),
    _explorer("rollout/samples", "samples", "samples of the OK tasks"),
    _explorer("rollout/reward_mean", "reward", "mean reward over the samples of the OK tasks"),
    _explorer("rollout/reward_std", "reward", "pooled standard deviation of those rewards"),
    _explorer("rollout/reward_min", "reward", "lowest reward of a sample"),
    _explorer("rollout/reward_max", "reward", "highest reward of a sample"),
    _explorer("rollout/accuracy", "fraction", "share of the samples that are correct"),
    _explorer("rollout/pass_rate", "fraction", "share of the OK tasks with a sample of positive reward"),
    _explorer("rollout/response_length", "tokens", "mean response length of a sample"),
    _explorer("rollout/staleness_mean", "versions", "mean over the samples of the step minus the version that "
              "sampled it"),
    _explorer("time/rollout_task_ms", "milliseconds", "mean time a worker took for an OK task"),
    _explorer("time/step_s", "seconds", "from the step's publication to its finish"),
    _explorer("time/step_interval_s", "seconds", "since the previous step finished (the pace: steps overlap)"),
    _explorer("explorer/steps_in_flight", "steps", "training steps in flight, this one included"),
    # explorer.max_retries
    _explorer("rollout/retries", "requests", "attempts that failed and were published again"),
    _explorer("rollout/retried_failed", "requests", "retried attempts that had FAILED"),
    _explorer("rollout/retried_timeout", "requests", "retried attempts that had timed out"),
    # dynamic sampling (consumers/explorer/dynamic_sampling.py)
    _explorer("rollout/informative_groups", "groups", "groups whose rewards differ (trained)"),
    _explorer("rollout/filtered_groups", "groups", "OK groups left out: their rewards are all equal"),
    _explorer("rollout/oversample_rounds", "rounds", "extra rounds of tasks the step took to fill its batch"),
    # explorer.tasksets
    _explorer("rollout/taskset/{taskset}/tasks", "tasks", "the taskset's tasks in the step"),
    _explorer("rollout/taskset/{taskset}/samples", "samples", "samples of its OK tasks"),
    _explorer("rollout/taskset/{taskset}/reward_mean", "reward", "mean reward of those samples"),
    _explorer("rollout/taskset/{taskset}/accuracy", "fraction", "share of those samples that are correct"),
    _explorer("explorer/taskset/{taskset}/skipped_solved", "tasks", "solved tasks the taskset has passed over "
              "so far"),
    # eval rounds (consumers/explorer/evals.py), k = the eval taskset's repeat_times
    _explorer("eval/{taskset}/mean@{k}", "reward", "mean reward over all samples of the eval round"),
    _explorer("eval/{taskset}/best@{k}", "reward", "mean over tasks of the best sample's reward"),
    _explorer("eval/{taskset}/accuracy@{k}", "fraction", "share of the samples that are correct"),
    _explorer("eval/{taskset}/tasks", "tasks", "eval tasks with an OK result"),
    _explorer("eval/{taskset}/failed", "tasks", "eval tasks, when none had an OK result"),
    _explorer("eval/{taskset}/timeout", "tasks", "eval tasks without a result at explorer.step_timeout_s"),
)

WORKER = (
    _worker("rollout_worker/requests", "requests", "requests the commit finished"),
    _worker("rollout_worker/samples", "samples", "experiences the commit wrote"),
    _worker("rollout_worker/in_flight", "requests", "requests running in the engine at the commit"),
    _worker("rollout_worker/samples_per_s", "samples/second", "samples committed per second since the last "
            "commit"),
    _worker("rollout_worker/overlong_penalty_mean", "reward", "mean overlong penalty of the samples shaped since "
            "the last commit (rollout.overlong_penalty)"),
    _worker("rollout_worker/overlong_punished_frac", "fraction", "share of those samples given a penalty"),
    _worker("{reward}/failed_samples", "samples", "samples the reward could not score since the last commit"),
)

TRAINER = (
    # the policy loss (engines/training/loss.py, engines/algorithms/)
    _trainer("actor/loss", "loss", "the step's total RL loss"),
    _trainer("actor/pg_loss", "loss", "its policy-gradient part"),
    _trainer("actor/pg_clipfrac", "fraction", "share of trained tokens on the clipped branch"),
    _trainer("actor/pg_clipfrac_lower", "fraction", "share of trained tokens held at dual-clip's lower bound "
             "(clip_ratio_c)"),
    _trainer("actor/entropy", "nats/token", "mean entropy of the policy over the trained tokens"),
    _trainer("actor/ppo_kl", "nats/token", "mean KL of the old policy to the new over the trained tokens"),
    _trainer("actor/ratio_mean", "ratio", "mean importance ratio new/old over the trained tokens"),
    _trainer("actor/ratio_max", "ratio", "largest such ratio"),
    _trainer("actor/kl", "nats/token", "mean KL to the reference policy (with a reference)"),
    _trainer("actor/kl_loss", "loss", "the KL loss term (with a reference)"),
    _trainer("actor/cispo_clip_frac", "fraction", "share of tokens whose CISPO weight was clipped"),
    _trainer("actor/sapo_gate_mean", "ratio", "mean SAPO soft gate"),
    _trainer("actor/topr_tapered_frac", "fraction", "share of sequences TOPR tapered"),
    _trainer("actor/sft_phi_weight_mean", "ratio", "mean token weight p(1-p) of the phi-weighted SFT loss"),
    _trainer("actor/grad_norm", "norm", "gradient norm before clipping"),
    _trainer("actor/lr", "learning rate", "learning rate of the step"),
    _trainer("actor/skipped_step", "0/1", "1 when a non-finite gradient norm skipped the update"),
    # the batch (engines/training/advantage_step.py)
    _trainer("actor/kl_penalty", "nats/token", "mean KL reward penalty (trainer.kl_penalty_coef)"),
    _trainer("actor/kl_coef", "coefficient", "KL penalty coefficient used (adaptive with a KL controller)"),
    _trainer("actor/num_masked_truncated", "sequences", "truncated samples left out of the loss "
             "(mask_truncated)"),
    _trainer("actor/reward_mean", "reward", "mean reward of the RL rows"),
    _trainer("actor/reward_std", "reward", "standard deviation of those rewards"),
    _trainer("actor/advantage_mean", "advantage", "mean advantage over the trained tokens"),
    _trainer("actor/advantage_abs_mean", "advantage", "mean absolute advantage over the trained tokens"),
    _trainer("actor/response_length_mean", "tokens", "mean response length of the RL rows"),
    _trainer("actor/num_sequences", "sequences", "RL rows trained"),
    _trainer("actor/num_tokens", "tokens", "trained tokens of the RL rows"),
    _trainer("actor/num_corrected", "sequences", "rows given importance weights (stale or off-policy)"),
    # behaviour vs. trainer logprobs (engines/algorithms/importance.py, engines/training/proximal.py)
    _trainer("actor/is_ratio_mean", "ratio", "mean ratio trainer/rollout probability over the corrected tokens"),
    _trainer("actor/is_ratio_min", "ratio", "smallest such ratio"),
    _trainer("actor/is_ratio_max", "ratio", "largest such ratio"),
    _trainer("actor/is_truncated_frac", "fraction", "share of those tokens above the truncation cap"),
    _trainer("actor/is_weight_mean", "ratio", "mean importance weight applied to the corrected tokens"),
    _trainer("actor/is_token_truncated_frac", "fraction", "share of tokens whose weight the correction truncated"),
    _trainer("actor/is_token_masked_frac", "fraction", "share of tokens the correction masked out"),
    _trainer("actor/is_seq_truncated_frac", "fraction", "share of sequences whose weight the correction "
             "truncated"),
    _trainer("actor/is_seq_masked_frac", "fraction", "share of sequences the correction masked out"),
    # the critic (advantage: gae; engines/training/critic.py)
    _trainer("critic/vf_loss", "loss", "value loss"),
    _trainer("critic/vf_clipfrac", "fraction", "share of tokens on the value clip"),
    _trainer("critic/vpred_mean", "value", "mean predicted value over the trained tokens"),
    _trainer("critic/value_explained_var", "fraction", "share of the returns' variance the values explain"),
    _trainer("critic/values_mean", "value", "mean value the advantages used"),
    _trainer("critic/returns_mean", "return", "mean return"),
    _trainer("critic/grad_norm", "norm", "critic gradient norm before clipping"),
    _trainer("critic/lr", "learning rate", "critic learning rate"),
    _trainer("critic/skipped_step", "0/1", "1 when a non-finite gradient norm skipped the critic's update"),
    _trainer("critic/warmup", "0/1", "1 on a step that trained the critic alone (critic warm-up)"),
    # on-policy distillation (engines/training/distillation.py)
    _trainer("distill/kl", "nats/token", "mean reverse KL to the teacher over the trained tokens"),
    _trainer("distill/teacher_rows", "sequences", "rows with the teacher's logprobs"),
    _trainer("distill/rows_without_teacher", "sequences", "rows left out: the teacher did not score them"),
    # supervised rows (engines/training/supervised.py, consumers/trainer/mix.py)
    _trainer("sft/loss", "loss", "SFT loss"),
    _trainer("sft/num_tokens", "tokens", "SFT tokens trained"),
    _trainer("sft/num_sequences", "sequences", "SFT rows trained"),
    _trainer("dpo/loss", "loss", "DPO loss"),
    _trainer("dpo/reward_margin", "reward", "mean implicit reward of the chosen minus the rejected"),
    _trainer("dpo/accuracy", "fraction", "share of pairs whose chosen side has the higher implicit reward"),
    _trainer("dpo/chosen_reward", "reward", "mean implicit reward of the chosen sides"),
    _trainer("dpo/rejected_reward", "reward", "mean implicit reward of the rejected sides"),
    _trainer("dpo/num_pairs", "pairs", "DPO pairs trained"),
    _trainer("dpo/num_tokens", "tokens", "DPO tokens trained"),
    _trainer("mix/rl_share", "fraction", "RL rows' share of the step's rows"),
    _trainer("mix/sft_share", "fraction", "SFT rows' share"),
    _trainer("mix/dpo_share", "fraction", "DPO rows' share"),
    _trainer("mix/rl_weight", "weight", "weight of the RL loss"),
    _trainer("mix/sft_weight", "weight", "weight of the SFT loss"),
    _trainer("mix/chord_mu", "weight", "CHORD's mu at this step (mix_weighting: chord)"),
    _trainer("mix/sft_rows", "sequences", "SFT rows trainer.mix added to the batch"),
    _trainer("mix/sft_missing", "groups", "SFT groups wanted but not available"),
    _trainer("mix/dpo_pairs", "pairs", "DPO pairs trainer.mix added to the batch"),
    _trainer("mix/dpo_missing", "pairs", "DPO pairs wanted but not available"),
    _trainer("mix/pooled", "groups", "supervised groups read and waiting"),
    # the trainer role (consumers/trainer/)
    _trainer("trainer/staleness", "versions", "mean of the step minus the version of each experience read"),
    _trainer("trainer/staleness_max", "versions", "largest such lag"),
    _trainer("trainer/spanning_versions", "experiences", "experiences whose tokens span weight versions "
             "(rollout.weight_update: in_flight)"),
    _trainer("trainer/dropped_stale", "experiences", "dropped past the staleness bound since the last step"),
    _trainer("trainer/dropped_incomplete", "experiences", "dropped in incomplete groups since the last step"),
    _trainer("trainer/passed_over", "experiences", "not trained by this trainer, since its start"),
    _trainer("trainer/groups", "groups", "groups in the step's batch"),
    _trainer("trainer/short_batch", "0/1", "1 when the batch had fewer groups than train_batch_size"),
    _trainer("trainer/buffered", "experiences", "experiences read and not yet trained"),
    _trainer("time/train_step", "seconds", "duration of the optimiser step"),
    _trainer("time/publish_weights", "seconds", "duration of publishing the weights"),
    _trainer("weights/broadcast_receivers", "workers", "receivers that got the weights by broadcast "
             "(collective)"),
    _trainer("weights/epoch", "epoch", "the weight-sync group's epoch of the broadcast"),
    _trainer("weights/broadcast_failed", "0/1", "1 when the broadcast failed (receivers catch up from the store)"),
)

TOPIC_METRICS: tuple[TopicMetric, ...] = EXPLORER + WORKER + TRAINER

_checked: set[tuple[str, str]] = set()  # (name, role) pairs already found declared or warned about


def declaration_of(name: str, role: str) -> TopicMetric | None:
    return next((m for m in TOPIC_METRICS if m.covers(name, role)), None)


def check_emitted(names: Iterable[str], role: str) -> None:
    """Each of ``names``, emitted by ``role``, is declared: else :class:`UndeclaredMetric` in strict mode
    (``STREAMRFT_STRICT_METRICS``), a warning once per name and role otherwise."""
    for name in names:
        if (name, role) in _checked:
            continue
        if declaration_of(name, role) is None:
            message = (f"metric {name!r} written by the {role} role to the metrics topic is not declared: declare "
                       f"it in {HOME} (TOPIC_METRICS) with its unit and meaning")
            if os.environ.get(STRICT_ENV, "") not in ("", "0"):
                raise UndeclaredMetric(message)
            logger.warning("%s", message)
        _checked.add((name, role))
