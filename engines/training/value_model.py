"""The critic's network: a transformer backbone and a linear value head, ``V(s_t)`` for every response token.

The backbone is a copy of the policy's own (default: same size, same features, its own weights from then on), or
the backbone of a smaller model named by ``trainer.critic.model_path`` (it must read the policy's token ids). Where
the policy trains LoRA adapters, so does the critic's backbone (the same rank and targets); its value head always
trains whole."""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from ..models import MODEL_LOAD_LOCK
from ..settings.lora import LoraSettings
from ..settings.training import TrainingSettings
from .batch import Batch

logger = logging.getLogger(__name__)

HEAD_SEED = 0  # the value head's initial weights are the same in every process (ranks, a resumed run)


class ValueModel(torch.nn.Module):
    """``backbone`` (a Hugging Face base model: hidden states out, no LM head) and ``value_head``
    (``hidden → 1``)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, no_split_modules: list[str]) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        # small random weights, so that the backbone learns from the first step (a zero head would pass it no
        # gradient); OpenRLHF's std 1/(hidden + 1)
        generator = torch.Generator().manual_seed(HEAD_SEED)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=generator)
            self.value_head.bias.zero_()
        self._no_split_modules = no_split_modules  # the decoder layer class(es): FSDP shards each layer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                keep: int = 0, at: torch.Tensor | None = None) -> torch.Tensor:
        """The values ``[B, keep]`` at the last ``keep`` positions of padded rows; or, on one packed row (no
        attention mask), the values ``[N]`` at its columns ``at``. The head runs on those positions alone."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        chosen = hidden[0, at, :] if at is not None else hidden[:, -keep:, :]
        return self.value_head(chosen).squeeze(-1)


def response_values(model: torch.nn.Module, batch: Batch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``V(s_t)`` ``[B, R]`` in float32: the value of the text before response token ``t``, read where the policy's
    logit for token ``t`` is (column ``P − 1 + t``). Values at padded positions are meaningless (mask them).
    A packed micro-batch (:mod:`.packing`) runs on its one row, and its values go back to the ``[B, R]`` layout."""
    r = batch.response_width
    packed = batch.packed
    device_type = batch.input_ids.device.type
    with torch.autocast(device_type=device_type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        if packed is not None:
            values = model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                           at=packed.logit_index)
        else:
            values = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, keep=r + 1)
    if packed is not None:
        return packed.unpack(values.float())
    return values[:, :r].float()


def build_value_model(policy: torch.nn.Module, settings: TrainingSettings, lora: LoraSettings | None) -> ValueModel:
    """The critic for ``policy`` (a causal LM, before LoRA or a data-parallel wrap touch it): a copy of its backbone,
    or ``settings.critic.model_path``'s; with LoRA adapters where the policy has them."""
    path = settings.critic.model_path
    if path is None:
        backbone = copy.deepcopy(policy.base_model)
    else:
        backbone = _load_backbone(Path(path), policy, settings)
    backbone = backbone.to(next(policy.parameters()).device)
    if settings.gradient_checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    no_split = list(getattr(backbone, "_no_split_modules", None) or ())
    hidden_size = backbone.config.hidden_size
    if lora is not None:
        from peft import get_peft_model

        backbone = get_peft_model(backbone, lora.peft_config(task_type=None))
    return ValueModel(backbone, hidden_size, no_split)


def _load_backbone(path: Path, policy: torch.nn.Module, settings: TrainingSettings) -> torch.nn.Module:
    from transformers import AutoModel

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"trainer.critic.model_path {path} is not a Hugging Face model directory (no "
                                "config.json); name one, or leave it null to copy the policy's backbone")
    with MODEL_LOAD_LOCK:
        backbone = AutoModel.from_pretrained(str(path), dtype=torch.float32, **settings.model_load_kwargs)
    policy_vocab = getattr(getattr(policy, "config", None), "vocab_size", None)
    if policy_vocab is not None and backbone.config.vocab_size < policy_vocab:
        raise ValueError(f"trainer.critic.model_path {path} has a vocabulary of {backbone.config.vocab_size} tokens, "
                         f"the policy {policy_vocab}: the critic reads the policy's token ids, so it needs a model "
                         "of the same tokenizer (e.g. a smaller one of the same family)")
    logger.info("critic: the backbone of %s (%.1fM parameters)", path,
                sum(p.numel() for p in backbone.parameters()) / 1e6)
    return backbone
