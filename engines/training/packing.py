"""Sequence packing: a micro-batch's sequences laid end to end in one row, with no padding.

The model runs on one row of ``T = Σ (prompt + response)`` tokens whose position ids restart at 0 with each
sequence, and no attention mask. Transformers reads the restarts as sequence boundaries
(``masking_utils.find_packed_sequence_indices``, the layout ``DataCollatorWithFlattening`` produces): sdpa, eager
and flex attention get a block-diagonal causal mask, flash-attention its varlen kernel with ``cu_seqlens`` taken
from the position ids. So no token attends to another sequence, and each sequence's logits are those it has
alone (float noise aside).

Only the logits that predict a response token are computed (``logits_to_keep`` given as their indices), ``N``
of them instead of the padded ``B × (R + 1)``; :meth:`PackedRows.unpack` puts per-token values back into the
batch's ``[B, R]`` layout, so the loss sees the tensors a padded micro-batch gives it.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

# what a transformers modeling module builds its attention masks with when it reads packed position ids
_PACKING_AWARE_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask")


@dataclass(frozen=True)
class PackedRows:
    """The packed forward's inputs, and where its ``N`` response-token outputs go in the ``[B, R]`` layout."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long: 0, 1, ... again from each sequence's first token
    logit_index: torch.Tensor  # [N] long: the column of the packed row whose logit predicts each response token
    targets: torch.Tensor  # [N] long: that response token
    rows: torch.Tensor  # [N] long: its row in [B, R]
    cols: torch.Tensor  # [N] long: its column in [B, R]
    shape: tuple[int, int]  # (B, R)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward runs on: every real token of the rows, no padding."""
        return self.input_ids.shape[1]

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
           prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> "PackedRows":
        """Pack padded rows (:mod:`.batch`'s layout: prompts left-padded to ``P``, responses right-padded to
        ``R``, position ids counting from each sequence's first real token)."""
        real = attention_mask.bool()
        width = input_ids.shape[1]
        r = width - int(prompt_lengths.max())
        lengths = prompt_lengths + response_lengths
        starts = torch.cumsum(lengths, 0) - lengths  # each sequence's first column in the packed row
        columns = torch.arange(r, device=input_ids.device)
        rows, cols = (columns[None, :] < response_lengths[:, None]).nonzero(as_tuple=True)
        return cls(
            input_ids=input_ids[real][None],  # row-major: each row's real tokens are contiguous, in order
            position_ids=position_ids[real][None],
            logit_index=starts[rows] + prompt_lengths[rows] - 1 + cols,
            targets=input_ids[rows, width - r + cols],
            rows=rows,
            cols=cols,
            shape=(input_ids.shape[0], r),
        )

    def logits(self, model: torch.nn.Module) -> torch.Tensor:
        """``[N, V]``: the logits that predict the response tokens, from one forward over the packed row."""
        check_packable(model)
        out = model(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False,
                    logits_to_keep=self.logit_index)
        return out.logits[0]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[N]`` per response token -> ``[B, R]`` (0 where a row has no token), differentiably."""
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)


def check_packable(model: torch.nn.Module) -> None:
    """Raise ValueError unless ``model``'s attention masks come from transformers' mask functions, which confine
    attention to each packed sequence: another model would let packed sequences attend to each other, silently."""
    from transformers import PreTrainedModel

    hf_model = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf_model is None or not _masks_from_transformers(type(hf_model)):
        name = type(hf_model or model).__name__
        raise ValueError(f"trainer.pack_sequences: {name} does not build its attention mask with transformers' "
                         "masking_utils, so packed sequences would attend to each other; set "
                         "trainer.pack_sequences: false for this model")


@functools.cache
def _masks_from_transformers(cls: type) -> bool:
    """Whether the modeling module of ``cls`` (or of a class it derives from: FSDP2 subclasses the model) imports
    transformers' packing-aware mask functions."""
    return any(hasattr(sys.modules.get(klass.__module__), name)
               for klass in cls.__mro__ for name in _PACKING_AWARE_MASKS)
