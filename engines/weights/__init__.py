"""Weight transports from the trainer to inference engines: ``object_store`` (safetensors shards + manifest on
an fsspec URL) and ``collective`` (torch.distributed broadcast in buckets, gloo on CPU / NCCL on GPU)."""
from .collective import (
    BroadcastStats,
    CollectiveGroup,
    ReceivedWeights,
    backend_for,
    broadcast_weights,
    free_port,
    receive_weights,
)
from .errors import (
    ChecksumRequiredError,
    ForeignUriError,
    ManifestIntegrityError,
    ManifestMismatchError,
    ShardIntegrityError,
    UnsafeShardNameError,
    WeightFormatError,
    WeightIntegrityError,
)
from .object_store import (
    Manifest,
    ObjectStore,
    PublishedWeights,
    check_lineage,
    check_manifest_uri,
    is_sha256,
    iter_weights,
    load_weights,
    new_lineage,
    read_manifest,
    version_dir_name,
)

__all__ = [name for name in dir() if not name.startswith("_")]
