"""The digest of one collective broadcast: what the trainer announces (in the signal's ``DeliveryState``, which
only its principal may write to ``sync``) and what a receiver checks the tensors it got against before the engine
loads them. A member of the weight-sync group that is not the trainer, or a bit flipped on the way, then costs a
refused broadcast copy, never wrong weights served.

One BLAKE3 over every tensor in name order, each as a JSON line ``[name, dtype, shape]`` and then its bytes (the
line fixes how many bytes follow, so no two sets of tensors hash alike). One digest, not one per tensor: the
signal stays the same size for any number of tensors (a signal's state is capped at 256 KiB)."""
from __future__ import annotations

import json
from collections.abc import Iterable

import torch

from .errors import BroadcastIntegrityError
from .safetensors_io import _as_bytes, new_digest


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The BLAKE3 hex digest of ``named_tensors`` (names, dtypes, shapes and bytes; device-independent: a CUDA
    tensor is hashed from a CPU copy)."""
    digest = new_digest()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        line = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        digest.update(line.encode() + b"\n")
        digest.update(_as_bytes(tensor))
    return digest.hexdigest()


def check_weights_digest(tensors: dict[str, torch.Tensor], expected: str, version: int) -> None:
    """BroadcastIntegrityError unless ``tensors`` hash to ``expected`` (an empty ``expected``: nothing was
    announced, so nothing received can be trusted)."""
    actual = weights_digest(tensors.items())
    if actual != expected:
        raise BroadcastIntegrityError(version, expected, actual)
