"""What a checkpoint keeps of a trained model (the policy, the critic): all of its state, or under LoRA only the
tensors that train (the adapters, and a critic's value head); the frozen base is the model directory's."""
from __future__ import annotations

import torch


def trained_state(model: torch.nn.Module, adapters_only: bool) -> dict[str, torch.Tensor]:
    """``model``'s state dict, or (``adapters_only``) its entries whose parameters require gradients."""
    state = model.state_dict()
    if not adapters_only:
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trained}


def load_trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor], adapters_only: bool) -> None:
    """Load what :func:`trained_state` gave; under LoRA, ValueError when it is not this model's trained tensors."""
    if not adapters_only:
        model.load_state_dict(state)
        return
    expected = set(trained_state(model, adapters_only=True))
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"the checkpoint's adapters do not match model.lora: missing {missing[:3]}, "
                         f"unknown {unknown[:3]} (was it written with other lora settings, or without LoRA?)")
    model.load_state_dict(state, strict=False)
