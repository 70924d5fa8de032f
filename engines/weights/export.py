"""Export a published version as a plain Hugging Face model directory (``streamrft export``): the base model with
the version's weights in place; a LoRA adapter is merged into the base (:class:`~streamrft.engines.lora.AdapterMerger`)
so the result loads anywhere ``from_pretrained`` does, with no peft."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..lora import AdapterMerger, read_base_weights
from ..settings.lora import ADAPTER_PAYLOAD, PAYLOAD_KEY, LoraSettings
from ..models import MODEL_LOAD_LOCK
from .object_store import ObjectStore, load_weights, read_manifest


def export_version(store_url: str, version: int, base_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   lora: LoraSettings | None = None, lineage: str | None = None) -> Path:
    """Write ``version`` of ``lineage`` (default: the newest lineage holding it) from the store at
    ``store_url`` to ``out_dir``, every shard verified. ValueError when the store has no such version or its
    payload does not match ``lora`` (an adapter needs the run's ``model.lora``, whole weights need none)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = ObjectStore(store_url, lineage=lineage or "")
    if lineage is None:
        holding = store.lineages_of(version)
        if not holding:
            raise ValueError(f"the weights store {store_url} holds no complete v{version} (it keeps "
                             "trainer.weights.keep_last versions)")
        lineage = holding[-1]
    manifest_path = store.manifest_path(version, lineage)
    sha256 = hashlib.sha256(store.fs.cat_file(manifest_path)).hexdigest()
    uri = store.manifest_uri(version, lineage)
    manifest = read_manifest(uri, sha256, expected_version=version, expected_lineage=lineage)
    is_adapter = manifest.metadata.get(PAYLOAD_KEY) == ADAPTER_PAYLOAD
    if is_adapter != (lora is not None):
        raise ValueError(f"v{version} holds {'a LoRA adapter' if is_adapter else 'whole weights'}, but model.lora "
                         f"is {'not set' if lora is None else 'set'} in the run config")
    tensors = load_weights(uri, sha256, manifest=manifest)
    if lora is not None:
        tensors = AdapterMerger(lora, read_base_weights(base_dir, lora)).merge(tensors)
    with MODEL_LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    missing = set(tensors) - set(model.state_dict())
    if missing:
        raise ValueError(f"v{version} has tensors the base model {base_dir} lacks: {sorted(missing)[:3]}")
    model.load_state_dict(tensors, strict=False)
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(out)
    return out
