"""LoRA adapters: what the trainer trains and publishes instead of the whole model, and how the inference side
turns a published adapter into the weights it serves.

The trainer wraps the policy with ``peft`` (only the adapters' ``lora_A`` / ``lora_B`` matrices train) and
publishes the adapter tensors alone, under the base model's names with the ``lora_A`` / ``lora_B`` part kept:
``model.layers.0.self_attn.q_proj.lora_A.weight`` is ``A`` of the module whose base weight is
``model.layers.0.self_attn.q_proj.weight``. Every published version is a whole adapter (all its pairs), never a
delta on the previous one, so a worker that missed versions loses nothing.

**The inference side merges** (:class:`AdapterMerger`): it keeps the base model's weights, read from the model
directory, and loads them with ``W = W0 + (alpha / rank) · B @ A`` in place of each adapted module's weight
into the engine through the engine's ordinary ``load_weights``. The whole model is loaded, not only the adapted
tensors, because vLLM fuses projections (``qkv_proj``, ``gate_up_proj``) and loads complete weight sets only. We chose that over each engine's own LoRA runtime (vLLM's ``LoRARequest`` with adapter
slots) because:

* delivery is checked like any weights: the engine refuses unknown names or shapes before it changes anything,
  and the merged tensors are what it then serves (an adapter cannot be "loaded" yet silently unused);
* one version is served at a time, as with full fine-tuning, so there are no adapter slots to size for the
  staleness window and no per-request adapter routing;
* a merged model generates at the base model's speed (no extra LoRA matmuls per token), and the payload on the
  wire — the point of LoRA here — stays adapter-only.

The cost is one ``B @ A`` per adapted module per swap (rank × in × out multiply-adds: milliseconds), a local
whole-model copy into the engine per swap (what full fine-tuning does too, but without the network), and the
base weights held once more in the worker's CPU memory.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .settings.lora import LoraSettings

if TYPE_CHECKING:
    import torch

_ADAPTER_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
# peft names what it wraps ``base_model.model.<the model's own names>``
PEFT_PREFIX = "base_model.model."


def adapter_module(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of an adapter tensor's name; None for any other name."""
    match = _ADAPTER_NAME.match(name)
    return (match["module"], match["part"]) if match else None


def published_name(peft_name: str) -> str:
    """The name an adapter tensor of a peft state dict is published under (the base model's naming)."""
    return peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name


def adapter_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{module: (A name, B name)}``; ValueError naming what is not part of a complete pair."""
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        found = adapter_module(name)
        if found is None:
            raise ValueError(f"{name!r} is not a LoRA adapter tensor (<module>.lora_A.weight / .lora_B.weight), "
                             "but model.lora is set: this worker serves adapters only")
        parts.setdefault(found[0], {})[found[1]] = name
    incomplete = sorted(module for module, pair in parts.items() if len(pair) != 2)
    if incomplete:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {', '.join(incomplete[:5])}")
    return {module: (pair["A"], pair["B"]) for module, pair in parts.items()}


class AdapterMerger:
    """Turns a published adapter into the whole set of base-model tensors an inference engine loads (see the
    module doc). ``base`` is the base model's tensors as :func:`read_base_weights` reads them; it is never
    changed."""

    def __init__(self, settings: LoraSettings, base: Mapping[str, "torch.Tensor"]):
        self.settings = settings
        self.base = dict(base)

    def merged_shapes(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """The tensors (name → shape) an adapter of these tensor shapes is loaded as; ValueError when the
        adapter does not fit the base model (a module it lacks or not targeted, wrong dimensions, another rank)."""
        suffixes = tuple(f".{module}" for module in self.settings.target_modules)
        for module, (a_name, b_name) in adapter_pairs(shapes).items():
            base = self.base.get(f"{module}.weight")
            if base is None or not module.endswith(suffixes):
                raise ValueError(f"the adapter adapts {module!r}, which is not among this model's "
                                 f"{', '.join(self.settings.target_modules)} modules (model.lora.target_modules)")
            a_shape, b_shape = tuple(shapes[a_name]), tuple(shapes[b_name])
            out_features, in_features = base.shape
            expected = ((self.settings.rank, in_features), (out_features, self.settings.rank))
            if (a_shape, b_shape) != expected:
                raise ValueError(f"adapter of {module!r} has A {list(a_shape)} and B {list(b_shape)}; this model with "
                                 f"model.lora.rank {self.settings.rank} needs A {list(expected[0])} and B "
                                 f"{list(expected[1])}")
        return {name: tuple(tensor.shape) for name, tensor in self.base.items()}

    def merge(self, adapter: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """The base model's tensors with ``<module>.weight = W0 + scaling · B @ A`` for every adapted module
        (new tensors there; the others are the base's own, to be copied by the engine)."""
        import torch

        self.merged_shapes({name: tuple(t.shape) for name, t in adapter.items()})
        out = dict(self.base)
        with torch.no_grad():
            for module, (a_name, b_name) in adapter_pairs(adapter).items():
                base = self.base[f"{module}.weight"]
                a = adapter[a_name].to(device=base.device, dtype=torch.float32)
                b = adapter[b_name].to(device=base.device, dtype=torch.float32)
                # one pass over the base weight: W0 + scaling · (B @ A), in fp32
                merged = torch.addmm(base.to(torch.float32), b, a, alpha=self.settings.scaling)
                out[f"{module}.weight"] = merged.to(base.dtype)
        return out


def read_base_weights(model_dir: str | os.PathLike, settings: LoraSettings) -> dict[str, "torch.Tensor"]:
    """Every tensor of a model directory's safetensors files; ValueError when no module is named in
    ``settings.target_modules`` (nothing for an adapter to adapt)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors files to read the LoRA base weights from")
    base = {}
    for file in files:
        base.update(load_file(str(file)))
    suffixes = tuple(f".{module}.weight" for module in settings.target_modules)
    if not any(name.endswith(suffixes) for name in base):
        raise ValueError(f"no module of {model_dir} is named {', '.join(settings.target_modules)} "
                         "(model.lora.target_modules): nothing for an adapter to adapt")
    return base
