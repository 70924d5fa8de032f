"""The Avro contract of streamrft: schemas, typed records and the single-object codec."""
from .codec import (
    DecodeError,
    InvalidRecordError,
    SingleObjectCodec,
    TruncatedRecordError,
    UnknownFingerprintError,
    UnknownMagicError,
    WrongRecordTypeError,
    framing_of,
)
from .contract import RECORD_NAMES, canonical_form, fingerprint64, schema_json
from .packing import pack_f32, pack_i32, pack_u8, unpack_f32, unpack_i32, unpack_u8
from .records import (
    RECORD_TYPES,
    Experience,
    FeedbackReceipt,
    Metric,
    Objective,
    Record,
    RolloutKind,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
    SyncKind,
    SyncMethod,
    SyncSignal,
    Task,
    now_ms,
)

__all__ = [name for name in dir() if not name.startswith("_")]
