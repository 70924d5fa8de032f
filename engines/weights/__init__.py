"""Weight transports from the trainer to inference engines: ``object_store`` (safetensors shards + manifest on
an fsspec URL) and ``collective`` (torch.distributed broadcast in buckets, gloo on CPU / NCCL on GPU; the elastic
group of ``elastic``).

Importing this package loads no torch: it holds what checks a signal without touching weights (``errors``,
``locations``, ``signal_state``), so that ``streamrft.validation`` may use it. The transports are imported from
their modules (``object_store``, ``collective``, ``elastic``, ``safetensors_io``, ``export``)."""
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
from .locations import (
    MANIFEST_NAME,
    check_lineage,
    check_manifest_uri,
    is_sha256,
    new_lineage,
    version_dir_name,
)
from .signal_state import Announcement, DeliveryState

__all__ = [name for name in dir() if not name.startswith("_")]
