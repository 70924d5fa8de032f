"""The safetensors file format, written and read in a streaming, zero-copy way with the BLAKE3 digest computed on
the same pass. Files are standard safetensors (``safetensors.torch.load_file`` reads them); what this adds over the
library's ``save``/``load`` of bytes is that no serialised copy of a shard is ever built: tensor memory goes
straight to the file while being hashed, and tensors read back are views over the one buffer the file was read
into (which is hashed first).

Format: 8-byte little-endian header length ``N``; ``N`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces so the data starts 8-byte aligned;
then the tensor bytes, contiguous, offsets relative to the data start. Tensors are laid out by element size,
largest first, so each starts at a multiple of its element size.
"""
from __future__ import annotations

import json
import struct
from typing import BinaryIO

import blake3
import torch

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

CHUNK_BYTES = 16 << 20  # write/read and hash granularity


def new_digest():
    """The shard digest: BLAKE3 (cryptographic, like sha256, and several times faster, on every core), so hashing
    does not bound a weight sync."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def digest_of(data) -> str:
    return new_digest().update(data).hexdigest()


class SafetensorsFormatError(ValueError):
    pass


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy for a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_safetensors(fh: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``tensors`` to ``fh`` as a safetensors file; returns ``(bytes written, BLAKE3 hex digest)``."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _CODES:
            raise SafetensorsFormatError(f"tensor {name}: dtype {t.dtype} has no safetensors code")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    digest = new_digest()
    written = 0
    for chunk in (struct.pack("<Q", len(body)), body):
        digest.update(chunk)
        fh.write(chunk)
        written += len(chunk)
    for name in order:
        data = _as_bytes(tensors[name])
        for start in range(0, len(data), CHUNK_BYTES):
            piece = data[start : start + CHUNK_BYTES]
            digest.update(piece)
            fh.write(piece)
            written += len(piece)
    return written, digest.hexdigest()


def read_header(buf: bytes | bytearray | memoryview) -> tuple[dict[str, dict], int]:
    """``(header without __metadata__, data start offset)``, checking the offsets tile the data exactly."""
    if len(buf) < 8:
        raise SafetensorsFormatError(f"{len(buf)} bytes is too short for a safetensors file")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if 8 + n > len(buf):
        raise SafetensorsFormatError(f"header length {n} runs past the end of a {len(buf)}-byte file")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError as exc:
        raise SafetensorsFormatError(f"unreadable safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    end = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = entry["data_offsets"]
        if begin != end:
            raise SafetensorsFormatError(f"tensor {name}: data starts at {begin}, expected {end}")
        end = stop
    if 8 + n + end != len(buf):
        raise SafetensorsFormatError(f"data ends at {8 + n + end}, the file has {len(buf)} bytes")
    return header, 8 + n


def read_safetensors(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors as views over ``buf``, a 1-D uint8 tensor holding a whole file (kept alive by them; no copy)."""
    header, start = read_header(memoryview(buf.numpy()))
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsFormatError(f"tensor {name}: unsupported dtype {entry['dtype']}")
        begin, stop = entry["data_offsets"]
        shape = tuple(entry["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if stop - begin != torch.Size(shape).numel() * itemsize:
            raise SafetensorsFormatError(f"tensor {name}: {stop - begin} bytes for shape {list(shape)} of {dtype}")
        data = buf[start + begin : start + stop]
        if (start + begin) % itemsize:  # files from other writers may not align; copy those few
            data = data.clone()
        out[name] = data.view(dtype).view(shape)
    return out
