"""Per-token log-probabilities (and entropies) of the response tokens of a :class:`Batch`, padded or packed."""
from __future__ import annotations

import torch

from .batch import Batch
from .micro_batches import MicroBatching


def entropy_from_logprobs(log_probs: torch.Tensor) -> torch.Tensor:
    """``H = −Σ_v p_v · log p_v`` over the last dimension, from the log-softmax the loss computes anyway (one
    exp pass instead of a second softmax and logsumexp over the vocabulary). Needs finite log-probs: the
    trainer never masks logits with −inf."""
    return -(log_probs.exp() * log_probs).sum(-1)


def response_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [B, R], entropy [B, R] or None)`` of the response tokens under ``model``.

    Only the logits that predict response tokens are materialised (``logits_to_keep``: the last ``R + 1``
    columns of padded rows, or the response tokens' own of packed ones, ``batch.packed``); the softmax runs in
    float32 even under bf16 autocast. With ``entropy_grad=False`` the entropy is computed on detached logits (a
    metric, no extra graph). Values at padded positions are meaningless: multiply by ``batch.response_mask``.
    """
    device_type = batch.input_ids.device.type
    with torch.autocast(device_type=device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        logits, targets = _response_logits(model, batch)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logprobs(log_probs if entropy_grad else log_probs.detach()) if with_entropy else None
    if batch.packed is not None:
        token_logprobs = batch.packed.unpack(token_logprobs)
        entropy = batch.packed.unpack(entropy) if entropy is not None else None
    return token_logprobs, entropy


def _response_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits that predict the response tokens, those tokens): ``[B, R, V]`` and ``[B, R]`` for padded
    rows, ``[N, V]`` and ``[N]`` for packed ones."""
    if batch.packed is not None:
        return batch.packed.logits(model), batch.packed.targets
    r = batch.response_width
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=r + 1,
    )
    return out.logits[:, :r, :], batch.input_ids[:, batch.prompt_width :]  # column P−1+t predicts token t


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: Batch, parallel, micro_batching: MicroBatching | int,
                   temperature: float, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Response logprobs ``[B, R]`` of ``batch`` under ``model``, in micro-batches (rows, or a token budget and
    packing: :class:`.micro_batches.MicroBatching`), with no gradient: each rank of ``parallel`` (a
    :mod:`.parallel` strategy) computes its rows and every rank gets the whole matrix."""
    was_training = model.training
    model.eval()
    rows = parallel.rows(len(batch))
    out = batch.behaviour_logprobs.new_zeros((len(rows), batch.response_width))
    try:
        for mb in parallel.micro_batches(batch, micro_batching):
            logp, _ = response_logprobs(model, mb.batch, temperature=temperature, autocast_dtype=autocast_dtype)
            if not mb.padding:
                out[[row - rows.start for row in mb.rows], : logp.shape[1]] = logp
    finally:
        model.train(was_training)
    return parallel.gather_rows(out, len(batch)) * batch.response_mask
