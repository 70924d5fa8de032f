"""Settings of the roles (explorer, rollout workers, trainer, monitor) and of what they share (model,
sampling, weight sync). Cross-field checks live in RunConfig, which sees all of them."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from streamrft.engines.settings.lora import LoraSettings
from streamrft.engines.settings.reward_shaping import OverlongPenalty
from streamrft.engines.settings.training import AlgorithmSettings, OptimizerSettings

from .base import Section
from .dynamic_sampling import DynamicSamplingConfig
from .engine_choice import resolve_auto_engine
from .object_store import S3Config, check_s3_store, is_s3_url
from .supervision import RestartConfig
from .tasksets import TasksetConfig, check_tasksets
from .trackers import MlflowTrackerConfig, TrackerName, WandbTrackerConfig


class ModelConfig(Section):
    """The policy. ``path`` is a local Hugging Face model directory, or ``smollm2-135m`` for the demo model
    prepared by ``streamrft model prepare smollm2-135m``."""

    path: str = Field(default="smollm2-135m",
                      description="the policy: a local Hugging Face model directory, or smollm2-135m (the demo model "
                                  "of `streamrft model prepare smollm2-135m`)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the weights' dtype in the rollout engines (the trainer keeps float32 "
                                    "master weights: trainer.mixed_precision); auto = the checkpoint's own on a "
                                    "GPU, and on a CPU bfloat16 where a probe at start measures bf16 matmuls at "
                                    "least 1.3x as fast as float32, else float32")
    lora: LoraSettings | None = Field(default=None, description="train LoRA adapters (peft) instead of the whole "
                                      "model; only the adapters are checkpointed and published")


class SamplingConfig(Section):
    """``rollout.sampling``: how the rollout engines sample a training or eval response."""

    temperature: float = Field(default=1.0, ge=0, description="softmax temperature of the rollouts; 0 = greedy "
                                                              "(the trainer divides logits by it too)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling: keep the smallest set of tokens "
                                                              "whose probability reaches top_p; 1 = off")
    top_k: int = Field(default=0, description="sample among the k likeliest tokens; 0 = off (vllm and openai "
                                              "engines need 0)")
    max_tokens: int = Field(default=64, ge=1, description="response tokens per sample; a sample cut here is "
                                                          "truncated")
    seed: int | None = Field(default=None, description="reproducible rollouts: a request's samples are seeded from "
                                                       "(seed, request_id), whichever worker runs it")


class OverRolloutConfig(Section):
    """Finish a step after ceil((1 − ratio) · batch_size) results; the rest are cancelled and reported as
    CANCELLED. ``wait_after_min_s`` gives stragglers a grace period once the minimum has arrived."""

    ratio: float = Field(default=0.0, ge=0, lt=1, description="share of a step's tasks whose results the step may "
                                                              "finish without; 0 = wait for every result")
    wait_after_min_s: float = Field(default=0.0, ge=0, description="seconds the step still waits for stragglers "
                                                                   "once the minimum of results has arrived")


class TaskFile(Section):
    """A task file (JSONL, JSON array, CSV, Parquet) and how its rows map onto tasks."""

    path: str = Field(description="the task file")
    workflow: str = Field(default="arithmetic", description="the workflow every task of the file runs (its "
                                                            "registered name)")
    prompt_key: str = Field(default="question", description="the row's column that holds the prompt")
    answer_key: str | None = Field(default="answer", description="the row's column that holds the reference "
                                                                 "answer; none = the tasks have none")
    taskset: str | None = Field(default=None, description="the tasks' taskset name; default the file name "
                                                          "without its suffix")


class EvalTaskset(TaskFile):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the eval taskset's name, in its metrics and "
                                                                "request ids")
    repeat_times: int = Field(default=1, ge=1, description="samples per eval task")
    max_tasks: int | None = Field(default=None, ge=1, description="evaluate the first this many tasks of the file; "
                                                                  "none = all")


class DataFile(Section):
    """A chat or preference file (JSONL, JSON array, CSV, Parquet) that ``streamrft run`` produces to
    ``experiences`` as supervised experiences, as ``streamrft data produce FILE --as OBJECTIVE`` does."""

    path: str = Field(description="the data file")
    objective: Literal["sft", "dpo"] = Field(description="sft: conversations (messages, or prompt + completion); "
                                                         "dpo: preference pairs (prompt, chosen, rejected)")
    dataset: str | None = Field(default=None, description="prefix of the experiences' ids; default the file name")
    messages_key: str = Field(default="messages", description="sft: the column of a conversation's chat messages")
    prompt_key: str = Field(default="prompt", description="the prompt's column (sft without messages, dpo)")
    completion_key: str = Field(default="completion", description="sft: the completion's column (without messages)")
    chosen_key: str = Field(default="chosen", description="dpo: the preferred response's column")
    rejected_key: str = Field(default="rejected", description="dpo: the other response's column")


class LaunchConfig(Section):
    """What ``streamrft run`` starts on this machine."""

    rollout_workers: int = Field(default=1, ge=0, description="rollout worker processes `streamrft run` starts "
                                                              "here (more can join from elsewhere: one consumer "
                                                              "group)")
    task_files: tuple[TaskFile, ...] = Field(default=(), description="task files produced to the tasks topic "
                                                                     "before the roles start")
    data_files: tuple[DataFile, ...] = Field(
        default=(), description="supervised data produced to experiences before the roles start (trainer.mix, "
                                "mode: train)")
    rollout_metrics_port_base: int = Field(default=9110, ge=0,
                                           description="worker i exposes Prometheus on base + i (0 = any)")
    dashboard_refresh_s: float = Field(default=2.0, gt=0, description="seconds between redraws of `streamrft "
                                                                      "run`'s live dashboard")
    metrics_port: int | None = Field(default=9104, ge=0, le=65535,
                                     description="the launcher's Prometheus endpoint (role restarts, roles up) on "
                                                 "metrics_host; 0 = any free port, null = off")
    restart: RestartConfig = Field(default=RestartConfig(), description="restarting a role process that dies: "
                                   "back-off and the crash-loop limit (streamrft/config/supervision.py)")


class SelectorConfig(Section):
    """Order in which tasks are rolled out. ``sequential`` follows the topic; ``shuffle`` permutes each block of
    ``block_steps`` steps' tasks (seeded, so a restart reproduces it); ``difficulty`` orders each block by the
    pass rate seen so far, hardest-but-learnable (closest to 0.5) first."""

    kind: Literal["sequential", "shuffle", "difficulty"] = Field(
        default="sequential", description="the order of the tasks topic's tasks: sequential, shuffle (seeded, "
                                          "per block) or difficulty (pass rate closest to 0.5 first)")
    block_steps: int = Field(default=4, ge=1, description="steps' worth of tasks read and reordered together")
    seed: int = Field(default=0, description="seed of shuffle")


class ExplorerConfig(Section):
    """``explorer``: the steps of a run (tasks per step, samples per task), their evaluation and pacing."""

    batch_size: int = Field(default=8, ge=1, description="tasks per step")
    repeat_times: int = Field(default=4, ge=1, description="samples per task (GRPO group size)")
    total_epochs: int | None = Field(default=1, ge=1, description="passes over the tasks topic; null = stream")
    max_steps: int | None = Field(default=None, ge=1, description="explorer steps to publish; null = until the "
                                                                 "tasks run out (total_epochs)")
    max_inflight_steps: int = Field(
        default=1, ge=1, le=64,
        description="steps published whose results are still being collected; more than 1 lets the explorer run "
                    "ahead (fully_async, trainer_driven, explore mode) while pacing still bounds it: at most "
                    "sync.max_staleness + 1 steps are in flight when the explorer paces on a trainer")
    over_rollout: OverRolloutConfig = Field(default=OverRolloutConfig(),
                                            description="finishing a step before all its results are in")
    eval_interval: int | None = Field(default=None, ge=1, description="evaluate on eval_tasksets after every this "
                                                                      "many steps; none = no periodic eval")
    eval_on_start: bool = Field(default=False, description="evaluate the base model (the weights of step 0) "
                                                           "before training; its metrics are at step -1")
    eval_tasksets: tuple[EvalTaskset, ...] = Field(default=(), description="task files evaluated without "
                                                                           "training on them (kind EVAL)")
    tasksets: tuple[TasksetConfig, ...] = Field(
        default=(), description="training tasksets mixed by weight, each from a file or a topic "
                                "(streamrft/config/tasksets.py); none: the tasks topic in the selector's order")
    selector: SelectorConfig = Field(default=SelectorConfig(),
                                     description="the order of the tasks topic's tasks (without tasksets)")
    step_timeout_s: float = Field(default=1800.0, gt=0,
                                  description="results missing after this long are reported TIMEOUT")
    max_retries: int = Field(default=0, ge=0, le=10,
                             description="a FAILED or TIMEOUT task is published again (a new request id) up to "
                                         "this many times within its step")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default=DynamicSamplingConfig(), description="DAPO: over-sample tasks until a step holds batch_size groups "
                                                     "whose rewards differ (streamrft/config/dynamic_sampling.py)")
    idle_wait_s: float = Field(default=5.0, gt=0, description="end of topic: wait this long for more tasks")
    metrics_port: int | None = Field(default=9101, description="the explorer's Prometheus endpoint on "
                                                               "metrics_host; 0 = any free port, null = off")

    @model_validator(mode="after")
    def _tasksets_apart(self) -> "ExplorerConfig":
        check_tasksets(self.tasksets)
        if self.dynamic_sampling.enabled and self.over_rollout.ratio > 0:
            raise ValueError("explorer.dynamic_sampling needs every result of a step (its cancel signal would stop "
                             "the tasks it adds): set over_rollout.ratio: 0 or dynamic_sampling.enabled: false")
        return self

    @property
    def min_results(self) -> int:
        """Results needed to finish a step (over-rollout lets the explorer stop waiting for the rest)."""
        import math

        return max(1, math.ceil((1 - self.over_rollout.ratio) * self.batch_size))


class OpenAIEngineConfig(Section):
    """``rollout.engine: openai``: roll out through an OpenAI-compatible endpoint (no weight updates)."""

    base_url: str = Field(default="", description="the endpoint, e.g. http://host:8000/v1")
    model: str = Field(default="", description="the model id the endpoint serves")
    api_key: SecretStr | None = Field(default=None, description="sent as a bearer token "
                                                                "(STREAMRFT_ROLLOUT__OPENAI__API_KEY)")
    timeout_s: float = Field(default=600.0, gt=0, description="per HTTP request")


class VLLMConfig(Section):
    """``rollout.vllm``: options of the vLLM engine of their own. The common ones map onto vLLM's names:
    ``rollout.max_batch_size`` is ``max_num_seqs``, ``model.dtype`` is ``dtype``, ``rollout.device`` must be
    ``auto`` or the device the installed vLLM build runs on."""

    max_model_len: int | None = Field(default=None, ge=16,
                                      description="prompt + response tokens per sequence; default the model's")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="GPU memory share vLLM may take")
    kv_cache_gib: float | None = Field(default=None, gt=0,
                                       description="KV-cache size in GiB; on the CPU build the only bound "
                                                   "(vLLM's VLLM_CPU_KVCACHE_SPACE); default vLLM's choice")
    enforce_eager: bool = Field(default=False, description="no CUDA graphs or compilation: faster start, "
                                                           "slower decoding")
    seed: int = Field(default=0, description="vLLM's engine seed (a request with sampling.seed is seeded on its "
                                             "own)")


class SimulatedEngineConfig(Section):
    """``rollout.simulated``: the model-free engine that decodes in batches as vLLM does (the scale benchmark's
    stand-in for a GPU; ``rollout.max_batch_size`` is its batch, ``sampling.max_tokens`` the longest sample)."""

    step_s: float = Field(default=0.05, ge=0, description="wall time of one decode step of the batch")
    min_tokens: int = Field(default=4, ge=1, description="the shortest sample (lengths are uniform up to "
                                                         "max_tokens)")


class RolloutConfig(Section):
    """``rollout``: the rollout workers: their inference engine, how they batch requests and take new weights."""

    engine: Literal["auto", "transformers", "vllm", "fake", "simulated", "openai"] = Field(
        default="transformers", description="the inference engine: transformers (any device), vllm (the vllm "
                                            "extra), auto (vllm where it is installed, else transformers), openai "
                                            "(a remote endpoint, no weight updates), fake and simulated "
                                            "(model-free, for tests and benchmarks)")
    device: str = Field(default="auto", description="torch device of the engine (cpu, cuda, cuda:1); auto = cuda "
                                                    "when available; vllm: auto or the build's device")
    max_batch_size: int = Field(default=64, ge=1, description="sequences generated together (vLLM: max_num_seqs)")
    vllm: VLLMConfig = Field(default=VLLMConfig(), description="engine vllm: its own options")
    openai: OpenAIEngineConfig = Field(default=OpenAIEngineConfig(),
                                       description="engine openai: the endpoint rolled out through")
    batching: Literal["continuous", "batch"] = Field(
        default="continuous", description="continuous: requests join the running engine batch as they are read "
                                          "and commit as each is done; batch: requests_per_batch at a time")
    requests_in_flight: int = Field(default=16, ge=1, description="continuous: requests rolled out at once")
    requests_per_batch: int = Field(default=8, ge=1,
                                    description="batch: requests taken together and committed together")
    sampling: SamplingConfig = Field(default=SamplingConfig(), description="how responses are sampled")
    fake_latency_s: float = Field(default=0.01, ge=0, description="fake engine: seconds per sample")
    simulated: SimulatedEngineConfig = Field(default=SimulatedEngineConfig(),
                                             description="engine simulated: its decode timing")
    weight_update: Literal["drain", "in_flight"] = Field(
        default="drain", description="drain: new weights wait until the running requests are done (no sample "
                                     "spans two versions); in_flight: they load between engine steps and the "
                                     "running samples go on with them (each experience records the versions "
                                     "it spans; staleness counts from the oldest)")
    task_timeout_s: float | None = Field(default=None, gt=0,
                                         description="a request not done this long after the explorer published "
                                                     "it is stopped and reported TIMEOUT (its samples dropped)")
    transaction_timeout_ms: int = Field(default=30_000, ge=1000,
                                        description="a killed worker's open transaction is aborted after this")
    overlong_penalty: OverlongPenalty | None = Field(
        default=None, description="DAPO's soft overlong punishment of training rewards: {buffer_len, "
                                  "penalty_factor} (streamrft/engines/settings/reward_shaping.py); null = off")
    metrics_port: int | None = Field(default=9102, description="a worker's Prometheus endpoint on metrics_host "
                                                               "(`streamrft run` gives worker i "
                                                               "launch.rollout_metrics_port_base + i); 0 = any free "
                                                               "port, null = off")

    @field_validator("engine")
    @classmethod
    def _settle_auto(cls, engine: str) -> str:
        return resolve_auto_engine() if engine == "auto" else engine

    @model_validator(mode="after")
    def _overlong_within_max_tokens(self) -> "RolloutConfig":
        if self.overlong_penalty and self.overlong_penalty.buffer_len > self.sampling.max_tokens:
            raise ValueError(f"rollout.overlong_penalty.buffer_len ({self.overlong_penalty.buffer_len}) must not "
                             f"exceed rollout.sampling.max_tokens ({self.sampling.max_tokens})")
        return self


class AlgorithmConfig(AlgorithmSettings, Section):
    """``trainer.algorithm``: advantage, policy loss, KL, importance sampling. Every key is declared once, in
    :class:`streamrft.engines.settings.training.AlgorithmSettings`; names are checked against the algorithm
    registries there (plugins included)."""


class WeightSyncConfig(Section):
    """``trainer.weights``: how published weights reach the rollout workers and serve mode."""

    method: Literal["object_store", "collective"] = Field(
        default="object_store", description="object_store: safetensors shards and a manifest written to url, "
                                            "loaded by each worker; collective: a torch.distributed broadcast "
                                            "(NCCL on GPU, gloo on CPU) from the trainer")
    url: str = Field(default="", description="fsspec URL for object_store; empty = <checkpoint_dir>/weights")
    s3: S3Config = Field(default=S3Config(), description="url s3://...: the endpoint, region and access key "
                                                         "every role reaches the store with")
    keep_last: int = Field(default=3, ge=1, description="published versions kept in the object store; older "
                                                        "ones are deleted (`streamrft bench` evaluates the kept "
                                                        "ones)")
    shard_mb: int = Field(default=512, ge=1, description="the largest safetensors shard of a published version, "
                                                         "in MiB")
    bucket_mb: int = Field(default=64, ge=1, description="collective: broadcast bucket size")
    collective_receivers: int = Field(default=1, ge=0,
                                      description="collective: receivers the first broadcast waits for (up to "
                                                  "collective_timeout_s); after it, receivers join and leave freely")
    collective_host: str = Field(default="127.0.0.1",
                                 description="collective: address receivers reach the trainer at (its host's IP "
                                             "when they run elsewhere)")
    collective_port: int = Field(default=0, ge=0, le=65534,
                                 description="collective: group port (the membership store's is the next one); "
                                             "0 = any free ports")
    collective_timeout_s: float = Field(default=300.0, gt=0,
                                        description="collective: how long the first broadcast waits for "
                                                    "collective_receivers to register")
    receiver_timeout_s: float = Field(default=30.0, gt=0,
                                      description="collective: the longest a receiver that died or hangs holds up "
                                                  "a sync, at each phase (gathering, forming the group, "
                                                  "each broadcast); it is then left out and catches up")
    catch_up: Literal["object_store", "none"] = Field(
        default="object_store",
        description="collective: also publish every version to the object store (url), where a worker that "
                    "missed a broadcast or joined late loads it; none = it waits for the next broadcast")
    group_secret: SecretStr | None = Field(
        default=None,
        description="collective: a secret the trainer and every worker share (at least 16 characters); only "
                    "receivers that sign their membership with it join the weight-sync group. Set it through the "
                    "environment (STREAMRFT_TRAINER__WEIGHTS__GROUP_SECRET; streamrft run makes one per run); "
                    "unset = anyone who reaches the membership store may join")

    @field_validator("group_secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters; make one with "
                             "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        return secret

    @model_validator(mode="after")
    def _s3_store(self) -> "WeightSyncConfig":
        check_s3_store(self.url, self.s3)
        return self

    def storage_options(self) -> dict:
        """fsspec storage options of the weight store (the s3 settings for an s3:// url, else none)."""
        return self.s3.storage_options() if is_s3_url(self.url) else {}


class MixConfig(Section):
    """``trainer.mix``: the share of each RL batch's rows that are supervised experiences, by objective. The RL
    rows are one explorer step's groups as always; ``{sft: 0.1}`` adds SFT rows until they are 10 % of the
    batch (7 beside 64 RL rows). DPO rows come in pairs."""

    sft: float = Field(default=0.0, ge=0, lt=1, description="share of a batch's rows that are SFT rows")
    dpo: float = Field(default=0.0, ge=0, lt=1, description="share of a batch's rows that are DPO rows (pairs)")

    @model_validator(mode="before")
    @classmethod
    def _known_objectives(cls, data):
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, dict) else []
        if unknown:
            raise ValueError(f"unknown objective(s) {', '.join(map(repr, unknown))}: trainer.mix takes sft and dpo "
                             "(RL rows are the rest of the batch)")
        return data

    @model_validator(mode="after")
    def _room_for_rl(self) -> "MixConfig":
        if self.sft + self.dpo >= 1:
            raise ValueError(f"sft + dpo is {self.sft + self.dpo:g}: the shares of supervised rows must leave room "
                             "for the RL rows (sum below 1); for supervised data alone use mode: train")
        return self

    @property
    def active(self) -> bool:
        return self.sft > 0 or self.dpo > 0

    def supervised_groups(self, rl_rows: int) -> tuple[int, int]:
        """(SFT conversations, DPO pairs) beside ``rl_rows`` RL rows: each objective's share of the whole batch's
        rows, ``share · rl_rows / (1 − sft − dpo)``, rounded (a conversation is a row, a pair two)."""
        total = rl_rows / (1 - self.sft - self.dpo)
        return round(self.sft * total), round(self.dpo * total / 2)


class TrainerConfig(OptimizerSettings, Section):
    """``trainer``: the optimiser, schedule, batching and precision keys (lr, micro_batch_size, total_steps,
    mixed_precision, ...) are declared once, in :class:`streamrft.engines.settings.training.OptimizerSettings`;
    the keys below are the role's own. ``RunConfig.training_settings`` hands both to the engine."""

    train_batch_size: int | None = Field(default=None, ge=1,
                                         description="experiences per step; default batch_size × repeat_times")
    algorithm: AlgorithmConfig = Field(default=AlgorithmConfig(), description="advantage, policy loss, KL and "
                                                                              "importance sampling")
    staleness_policy: Literal["drop", "importance_weight"] = Field(
        default="drop", description="stale experiences: drop them, or keep them importance-weighted (truncated IS)")
    group_timeout_s: float = Field(default=600.0, gt=0, description="a group still incomplete this many seconds "
                                                                    "after its first experience came is dropped "
                                                                    "(counted and logged)")
    save_interval: int = Field(default=10, ge=1, description="checkpoint every this many optimiser steps (and at "
                                                             "the end)")
    checkpoint_dir: str = Field(default="runs/{name}/checkpoints", min_length=1, max_length=4096,
                                description="a local directory, or s3://bucket/prefix (reached with "
                                            "trainer.weights.s3; trainer.weights.url must then be s3:// too)")
    keep_checkpoints: int = Field(default=2, ge=1, description="checkpoints kept; older ones are deleted")
    weights: WeightSyncConfig = Field(default=WeightSyncConfig(), description="how published weights reach the "
                                                                              "workers and serve mode")
    device: str = Field(default="auto", description="torch device of the policy; auto = cuda when available")
    nproc: int = Field(default=1, ge=1,
                       description="trainer processes on this machine (one per GPU; gloo on CPU): streamrft run "
                                   "starts them with torchrun. Across machines run `torchrun ... -m streamrft.cli "
                                   "train RUN.yaml` on each; checkpoint_dir must then be shared storage")
    parallel: Literal["fsdp", "ddp"] = Field(
        default="fsdp", description="how several trainer processes split the model: fsdp = FSDP2 shards "
                                    "parameters, gradients and optimizer state; ddp = a full replica on each")
    mix: MixConfig = Field(default=MixConfig(), description="supervised rows mixed into each RL batch, by "
                                                            "objective (sft, dpo): their share of the batch's rows")
    metrics_port: int | None = Field(default=9103, description="the trainer's Prometheus endpoint on "
                                                               "metrics_host; 0 = any free port, null = off")

    @model_validator(mode="after")
    def _s3_checkpoints(self) -> "TrainerConfig":
        # one set of S3 settings for both stores: the checkpoints are reached with trainer.weights.s3
        if is_s3_url(self.checkpoint_dir) and not is_s3_url(self.weights.url):
            raise ValueError(f"trainer.checkpoint_dir is {self.checkpoint_dir}: set trainer.weights.url to an "
                             "s3:// URL as well (e.g. the same bucket's weights/ prefix); both stores are reached "
                             "with the endpoint and keys of trainer.weights.s3")
        return self

    @model_validator(mode="after")
    def _chord_has_sft_rows(self) -> "TrainerConfig":
        if self.algorithm.mix_weighting == "chord" and self.mix.sft <= 0:
            raise ValueError("trainer.algorithm.mix_weighting: chord weighs expert SFT rows against the RL rows, but "
                             "trainer.mix.sft is 0, so no step has any; set trainer.mix.sft (e.g. 0.25, the SFT "
                             "data in launch.data_files or `streamrft data produce FILE --as sft`) or "
                             "mix_weighting: rows")
        return self

    @model_validator(mode="after")
    def _critic_has_a_use(self) -> "TrainerConfig":
        # set to other than its defaults (a config written out in full, as role processes load it, holds them)
        if self.critic != type(self.critic)() and not self.algorithm.uses_critic:
            raise ValueError(f"trainer.critic configures the value model of advantage gae (PPO with a critic), but "
                             f"trainer.algorithm.advantage is {self.algorithm.advantage!r}; set advantage: gae, or "
                             "remove trainer.critic")
        return self

    @field_validator("staleness_policy", mode="before")
    @classmethod
    def _old_policy_name(cls, value):
        # 'correct' was this value's name before 0.2; 'correct' now only means a right answer
        return "importance_weight" if value == "correct" else value


class MonitorConfig(Section):
    """``monitor``: where the metrics of every role go (CSV files, Prometheus, experiment trackers)."""

    output_dir: str = Field(default="runs/{name}", description="directory of metrics.csv, steps.csv and the "
                                                               "trackers' files; {name} is the run's name")
    tensorboard: bool = Field(default=True, description="false turns TensorBoard off even when trackers lists it "
                                                        "(the switch of configs older than trackers)")
    metrics_port: int | None = Field(default=9100, description="the monitor's Prometheus endpoint (a gauge per "
                                                               "metric name) on metrics_host; 0 = any free port, "
                                                               "null = off")
    trackers: tuple[TrackerName, ...] = Field(
        default=("tensorboard",),
        description="experiment trackers that get every metric, the run's config and the eval table: tensorboard "
                    "(<output_dir>/tensorboard), mlflow (monitor.mlflow), wandb (offline, monitor.wandb)")
    mlflow: MlflowTrackerConfig = Field(default=MlflowTrackerConfig(), description="the mlflow tracker")
    wandb: WandbTrackerConfig = Field(default=WandbTrackerConfig(), description="the wandb tracker")

    @field_validator("trackers")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"lists a tracker twice ({list(value)}); name each once")
        return value

    @property
    def active_trackers(self) -> tuple[str, ...]:
        return tuple(t for t in self.trackers if t != "tensorboard" or self.tensorboard)


class ServeConfig(Section):
    """``streamrft serve``: an OpenAI-compatible HTTP server in front of the run's inference engine, whose
    completions become experiences when the client sends feedback."""

    host: str = Field(default="127.0.0.1", min_length=1, description="address the HTTP server binds")
    port: int = Field(default=8000, ge=0, le=65535, description="0 = any free port (printed at start)")
    api_key: SecretStr | None = Field(default=None, description="required as 'Authorization: Bearer <key>' when "
                                                                "set (STREAMRFT_SERVE__API_KEY)")
    model_name: str = Field(default="", description="the model id clients name; empty = the run's name")
    grouping: Literal["request", "count", "client", "conversation"] = Field(
        default="request",
        description="GRPO groups of the experiences: request = the n choices of one request; count = every "
                    "group_size responses that get feedback; client = the group_id and group_size the feedback "
                    "names; conversation = the rewarded responses of one conversation (conversation_id in the "
                    "requests), written when a feedback says end_conversation")
    group_size: int = Field(default=4, ge=1, description="grouping: count")
    pending_ttl_s: float = Field(default=900.0, gt=0,
                                 description="a completion without feedback after this long is dropped (counted)")
    max_pending: int = Field(default=100_000, ge=1, description="completions kept for feedback; the oldest go first")
    max_tokens: int = Field(default=512, ge=1, description="upper bound of a request's max_tokens")
    sync_poll_s: float = Field(default=1.0, gt=0, description="how often the server looks for new weights")
    server_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$",
                                  description="this server's id (its transactional id: a restarted server with the "
                                              "same id fences its predecessor); default a random one")
    max_running: int = Field(default=64, ge=1, description="requests in the engine at once (each with its n "
                                                           "choices; vLLM's max_num_seqs bounds the sequences)")
    max_waiting: int = Field(default=64, ge=0, description="requests queued for the engine; beyond: 429 with "
                                                           "Retry-After")
    request_timeout_s: float = Field(default=120.0, gt=0,
                                     description="a request not done this long after it came is stopped (504)")
    batch_window_ms: float = Field(default=0.0, ge=0, le=10_000,
                                   description="transformers engine: an idle engine waits this long for more "
                                               "requests to batch with the first")
    max_n: int = Field(default=16, ge=1, description="choices one request may ask for")
    max_prompt_tokens: int | None = Field(default=None, ge=1,
                                          description="prompt tokens one request may send; default "
                                                      "limits.max_prompt_tokens")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest request body (413 beyond)")
    feedback_timeout_s: float = Field(default=90.0, gt=0,
                                      description="how long a /feedback waits for its experience to be committed "
                                                  "before it answers 503 (send it again: it is never written twice)")
    tls_cert: str | None = Field(default=None, min_length=1,
                                 description="PEM certificate file: the server speaks HTTPS (with serve.tls_key)")
    tls_key: str | None = Field(default=None, min_length=1, description="PEM private key file of serve.tls_cert")
    header_timeout_s: float = Field(default=10.0, gt=0, le=600,
                                    description="a client has this long from a request's first byte to its last "
                                                "header; then 408 and the connection is closed (slow clients "
                                                "cannot hold sockets)")
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600,
                                  description="a client has this long from a request's headers to the end of its "
                                              "body; then 408 and the connection is closed")
    max_connections: int = Field(default=1024, ge=1, le=1_000_000,
                                 description="connections and requests the HTTP server holds at once; beyond: 503")

    @model_validator(mode="after")
    def _tls_pair(self) -> "ServeConfig":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("serve.tls_cert and serve.tls_key go together: set both (HTTPS) or neither (HTTP)")
        return self
