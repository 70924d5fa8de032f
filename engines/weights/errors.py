"""Typed errors of the weight transports."""
from __future__ import annotations


class WeightIntegrityError(RuntimeError):
    """Published weights failed verification; nothing from them should be loaded."""


class ManifestIntegrityError(WeightIntegrityError):
    def __init__(self, uri: str, expected_sha256: str, actual_sha256: str) -> None:
        self.uri = uri
        self.expected_sha256 = expected_sha256
        self.actual_sha256 = actual_sha256
        super().__init__(
            f"manifest {uri}: sha256 is {actual_sha256}, expected {expected_sha256} "
            "(changed or partially written after it was announced)"
        )


class ShardIntegrityError(WeightIntegrityError):
    def __init__(
        self, shard: str, expected_digest: str, actual_digest: str, expected_nbytes: int, actual_nbytes: int
    ) -> None:
        self.shard = shard
        self.expected_digest = expected_digest
        self.actual_digest = actual_digest
        self.expected_nbytes = expected_nbytes
        self.actual_nbytes = actual_nbytes
        what = "truncated" if actual_nbytes < expected_nbytes else "corrupted"
        super().__init__(
            f"weight shard {shard} is {what}: BLAKE3 {actual_digest} ({actual_nbytes} bytes), "
            f"expected {expected_digest} ({expected_nbytes} bytes)"
        )


class BroadcastIntegrityError(WeightIntegrityError):
    """The tensors a receiver got by broadcast are not those whose digest the trainer announced."""

    def __init__(self, version: int, expected: str, actual: str) -> None:
        self.version = version
        self.expected = expected
        self.actual = actual
        announced = f"BLAKE3 {expected}" if expected else "no digest"
        super().__init__(
            f"weights v{version} received by broadcast hash to BLAKE3 {actual}; the trainer announced {announced} "
            "(changed on the way, or sent by a member that is not the trainer)"
        )


class WeightFormatError(WeightIntegrityError):
    """A manifest or shard that verifies but does not describe what it should (unknown format, wrong tensors)."""


class ChecksumRequiredError(WeightIntegrityError):
    """A manifest was to be read without the sha256 its announcement must carry."""

    def __init__(self, uri: str, given: str | None) -> None:
        self.uri = uri
        super().__init__(
            f"manifest {uri}: a sha256 of 64 hex digits is required to read it, got {given!r} "
            "(publish through ObjectStore.publish, which returns it, and put it in the signal)"
        )


class ForeignUriError(WeightIntegrityError):
    """A manifest URI that does not name a version directory of the configured store."""

    def __init__(self, uri: str, store_url: str, why: str) -> None:
        self.uri = uri
        self.store_url = store_url
        super().__init__(f"weights at {uri!r} are not in this run's store {store_url!r}: {why}")


class UnsafeShardNameError(WeightFormatError):
    """A manifest names a shard file outside its own version directory."""


class ManifestMismatchError(WeightFormatError):
    """The manifest describes another version (or lineage) than the one announced."""


class StoreAccessError(PermissionError):
    """The weight store refused this process's credentials (or their rights). The message names the store and
    the server's reason, never a secret."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        super().__init__(
            f"the weight store {url} refused access: {reason}. Check the credentials it is reached with "
            "(for s3://: trainer.weights.s3.access_key_id and secret_access_key, or the AWS_* environment) and "
            "that they may read and write under that URL"
        )
