"""Weight sync by collective broadcast: the trainer (rank 0) broadcasts named tensors to N receivers (ranks
1..N, inference engines) over torch.distributed — NCCL when the tensors live on CUDA, gloo on CPU, through the
same code, so the path is tested without a GPU.

The group is built from its own TCP store and is *not* the process's default group, so a trainer that also runs
DDP (or an inference engine with its own groups) is unaffected, and nothing global is set. The store's server
listens on the rendezvous host only (:func:`listening_store`), not on every interface.

Protocol of one sync, all broadcasts from rank 0:

1. header length (int64), then the header: JSON ``{"version", "bucket_bytes", "tensors": [[name, dtype, shape],
   ...]}`` as uint8;
2. the tensors' bytes packed in order into uint8 buckets of at most ``bucket_bytes`` (each tensor at a 16-byte
   aligned offset; a tensor larger than a bucket travels alone). Both sides derive the same bucket plan from the
   header, so no further metadata is sent.
"""
from __future__ import annotations

import datetime
import json
import logging
import socket
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from .broadcast_digest import weights_digest

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20  # several buckets per model, so packing, sending and unpacking overlap
_ALIGN = 16
_STORE_PREFIX = "streamrft-weights"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and local launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening_store(
    host: str,
    port: int,
    *,
    world_size: int | None = None,
    timeout_s: float = 300.0,
    wait_for_workers: bool = False,
) -> tuple[Any, int]:
    """A ``TCPStore`` server that accepts connections on ``host`` only; returns ``(store, port)`` (``port=0``:
    an ephemeral one, read back from the socket, so there is no free-port race).

    Why not just ``TCPStore(host, port, is_master=True)``: its server binds the wildcard address (``::``,
    every interface) whatever ``host_name`` says — the name is only what clients dial (checked on torch 2.15:
    ``/proc/net/tcp6`` lists the port on ``::``). torch takes a socket that is already bound instead
    (``master_listen_fd``; the store owns and closes it), so the socket is bound here."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # from here the store owns the descriptor (it closes it); on a failed construction it leaks rather than
    # risk closing a number another thread has been given since
    fd = sock.detach()
    store = dist.TCPStore(host, bound_port, world_size, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=wait_for_workers, master_listen_fd=fd)
    return store, bound_port


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight broadcast header")
    return dtype


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Buckets of ``(tensor index, byte offset)``; offsets are aligned; order preserved."""
    buckets: list[list[tuple[int, int]]] = [[]]
    offset = 0
    for i, size in enumerate(sizes):
        if buckets[-1] and offset + size > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((i, offset))
        offset = _aligned(offset + size)
    return buckets if buckets[0] else []


def _bucket_size(bucket: list[tuple[int, int]], sizes: list[int]) -> int:
    last, offset = bucket[-1]
    return offset + sizes[last]


def _max_packed_size(buckets: list[list[tuple[int, int]]], sizes: list[int]) -> int:
    return max((_bucket_size(b, sizes) for b in buckets if len(b) > 1), default=0)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's memory (a contiguous copy first if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class CollectiveGroup:
    """A process group for weight sync: rank 0 is the trainer, ranks 1..world_size−1 the receivers."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    _pg: Any
    _store: Any

    @classmethod
    def join(
        cls,
        init_method: str,
        rank: int,
        world_size: int,
        *,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> "CollectiveGroup":
        """Rendezvous at ``tcp://host:port`` (rank 0 hosts the store there). Blocks until all ``world_size``
        members have joined or ``timeout_s`` passes."""
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method must look like tcp://host:port, got {init_method!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        device = torch.device(device)
        backend = backend_for(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:  # hosts the store, on the rendezvous address only
            store, _ = listening_store(url.hostname, url.port, world_size=world_size, timeout_s=timeout_s,
                                       wait_for_workers=True)
        else:
            store = dist.TCPStore(url.hostname, url.port, world_size, False, timeout=timeout)
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend == "nccl":
            torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, timeout)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        group = cls(rank, world_size, device, backend, pg, store)
        group.broadcast(torch.zeros(1, device=device))  # everyone is here and the transport works
        logger.info("joined weight-sync group %s as rank %d/%d (%s)", init_method, rank, world_size, backend)
        return group

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast of ``tensor`` from rank ``src``; returns the work handle (``.wait()``). Broadcasts
        complete in the order they were started, on every rank."""
        if self._pg is None:
            raise RuntimeError("the weight-sync group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.broadcast_async(tensor, src).wait()
        return tensor

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort: the peer may already be gone
                logger.debug("process group shutdown failed", exc_info=True)
        self._pg = None
        self._store = None

    def __enter__(self) -> "CollectiveGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class BroadcastStats:
    version: int
    tensors: int
    nbytes: int
    buckets: int
    digest: str = ""  # broadcast_digest.weights_digest of what was sent, when asked for


def _send_header(group: CollectiveGroup, header: dict[str, Any]) -> None:
    body = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    group.broadcast(torch.tensor([body.numel()], dtype=torch.int64, device=group.device))
    group.broadcast(body.to(group.device))


def _recv_header(group: CollectiveGroup) -> dict[str, Any]:
    length = group.broadcast(torch.zeros(1, dtype=torch.int64, device=group.device))
    body = group.broadcast(torch.empty(int(length.item()), dtype=torch.uint8, device=group.device))
    return json.loads(bytes(body.cpu().numpy()))


class _Staging:
    """Two staging buffers used alternately (bucket ``k`` uses buffer ``k % 2``), so one bucket can be packed or
    unpacked while the previous one is on the wire."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[k % 2]
        if buf is None:
            buf = self._buffers[k % 2] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]


def broadcast_weights(
    group: CollectiveGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    with_digest: bool = False,
) -> BroadcastStats:
    """Rank 0: send ``named_tensors`` (any devices and dtypes) to every receiver of ``group``; ``with_digest``:
    also hash what was sent (``broadcast_digest``), for receivers to check it against.

    Two buckets are in flight at a time: bucket ``k + 1`` is packed while bucket ``k`` is being sent. A tensor
    that fills a bucket on its own is sent as it is, without a packing copy.
    """
    if group.rank != 0:
        raise RuntimeError(f"broadcast_weights runs on rank 0, this is rank {group.rank}")
    named = [(name, t.detach()) for name, t in named_tensors]
    sizes = [t.numel() * t.element_size() for _, t in named]
    header = {
        "version": version,
        "bucket_bytes": bucket_bytes,
        "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in named],
    }
    _send_header(group, header)
    buckets = _plan_buckets(sizes, bucket_bytes)
    staging = _Staging(_max_packed_size(buckets, sizes), group.device)
    in_flight: deque[tuple[Any, torch.Tensor]] = deque()  # (work, the buffer it reads)
    for k, bucket in enumerate(buckets):
        if len(in_flight) == 2:
            in_flight.popleft()[0].wait()  # bucket k−2 is sent: its staging buffer is free
        if len(bucket) == 1:
            buf = _as_bytes(named[bucket[0][0]][1].to(group.device))
        else:
            buf = staging.get(k, _bucket_size(bucket, sizes))
            for i, offset in bucket:
                buf[offset : offset + sizes[i]].copy_(_as_bytes(named[i][1].to(group.device)))
        in_flight.append((group.broadcast_async(buf), buf))
    for work, _ in in_flight:
        work.wait()
    digest = weights_digest(named) if with_digest else ""
    return BroadcastStats(version, len(named), sum(sizes), len(buckets), digest)


class ReceivedWeights:
    """What a receiver gets: ``version`` at once, then iterate for ``(name, tensor)`` as buckets arrive.

    The iteration *is* the collective: every receiver must consume it to the end (the trainer blocks until all
    have). The next bucket is already being received while the current one's tensors are handed out.

    A tensor that travelled alone is received straight into its own new tensor. Packed tensors are views into
    a fresh per-bucket buffer (safe to keep) — or, with ``reuse_buffer=True``, into one of two staging buffers
    that the bucket after next overwrites: then copy each tensor before advancing the iterator (what an
    inference engine's ``load_weights`` does anyway), and far fewer fresh pages are touched.
    """

    def __init__(self, group: CollectiveGroup, header: dict[str, Any], reuse_buffer: bool = False) -> None:
        self.group = group
        self.reuse_buffer = reuse_buffer
        self.version: int = int(header["version"])
        self.bucket_bytes: int = int(header["bucket_bytes"])
        self.specs = [(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in header["tensors"]]
        self._consumed = False

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._consumed:
            raise RuntimeError("received weights can be iterated only once")
        self._consumed = True
        sizes = [
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, dtype, shape in self.specs
        ]
        buckets = _plan_buckets(sizes, self.bucket_bytes)
        device = self.group.device
        staging = _Staging(_max_packed_size(buckets, sizes), device)

        def post(k: int) -> tuple[Any, torch.Tensor]:
            bucket = buckets[k]
            if len(bucket) == 1:
                name, dtype, shape = self.specs[bucket[0][0]]
                target = torch.empty(shape, dtype=dtype, device=device)
                return self.group.broadcast_async(_as_bytes(target)), target
            size = _bucket_size(bucket, sizes)
            buf = staging.get(k, size) if self.reuse_buffer else torch.empty(size, dtype=torch.uint8, device=device)
            return self.group.broadcast_async(buf), buf

        pending = post(0) if buckets else None
        for k, bucket in enumerate(buckets):
            work, buf = pending
            work.wait()
            # bucket k+1 uses the other staging buffer, whose tensors (bucket k−1) the consumer is done with
            pending = post(k + 1) if k + 1 < len(buckets) else None
            if len(bucket) == 1:
                yield self.specs[bucket[0][0]][0], buf
                continue
            for i, offset in bucket:
                name, dtype, shape = self.specs[i]
                yield name, buf[offset : offset + sizes[i]].view(dtype).view(shape)


def receive_weights(group: CollectiveGroup, *, reuse_buffer: bool = False) -> ReceivedWeights:
    """Ranks 1..N: block for the next broadcast's header; iterate the result for the tensors (see
    :class:`ReceivedWeights` for ``reuse_buffer``)."""
    if group.rank == 0:
        raise RuntimeError("receive_weights runs on ranks 1..N; rank 0 sends")
    return ReceivedWeights(group, _recv_header(group), reuse_buffer)
