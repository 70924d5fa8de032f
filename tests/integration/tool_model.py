"""A tiny model that has seen tool use: the tiny random model, fine-tuned for a few seconds on scripted calculator
episodes, so that it calls the calculator (not always well) and multi-turn tool episodes run through the loop."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.models import build_tiny_model
from streamrft.engines.tasks import make_word_problems
from streamrft.engines.workflows import run_workflow
from streamrft.engines.workflows.calculator import calculate


def scripted_episodes(model_dir: Path, n: int, seed: int):
    """``n`` calculator episodes in which the model calls the tool with the question's expression, then answers
    with the tool's result: tokens and action masks exactly as the workflow writes them."""
    samples = []
    for task in make_word_problems(n, seed=seed):
        question = json.loads(task.payload)["question"]
        a, b, c = (int(x) for x in __import__("re").findall(r"\d+", question)[:3])
        sign = "-" if "left" in question or "break" in question else "+"
        expression = f"{a} * {b} {sign} {c}"
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        replies = [f"<tool_call>{call}</tool_call>", f"The answer is {calculate(expression)}."]
        engine = create_engine("fake", model_dir,
                               responder=lambda prompt, j: replies[prompt.count("<|im_start|>assistant") - 1])
        samples += run_workflow(task, engine, 1, SamplingParams(max_tokens=200))
    return samples


def build_tool_model(path: Path, steps: int = 500, seed: int = 0) -> Path:
    """Fine-tune the tiny model on scripted episodes (loss on the model's tokens only) and save it to ``path``."""
    build_tiny_model(path, seed=seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    samples = scripted_episodes(path, 16, seed=seed + 100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        sample = samples[int(torch.randint(len(samples), (1,), generator=generator))]
        ids = torch.tensor([sample.tokens])
        labels = ids.clone()
        trained = torch.tensor([0] * sample.prompt_length + sample.action_mask, dtype=torch.bool)
        labels[0, ~trained] = -100
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path
