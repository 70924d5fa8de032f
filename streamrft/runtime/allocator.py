"""A fixed mmap threshold for the C allocator of a process that runs for days and holds no tensors.

glibc's malloc serves a request above its mmap threshold (128 KiB at start) with a mapping of its own, returned to
the system when freed. Its default is dynamic: once such a block is freed, the threshold rises to its size, and
from then on blocks that large come from the heap arenas, where freeing them leaves fragmented pages the process
keeps. The monitor reallocates a few such blocks all the time (the hash tables of its window of rows, the
consumer's fetch buffers), and its resident size crept up by 15 % over 4,000 steps that way while its Python heap
stayed flat (`bench/monitor_memory.py`; 5 % with the threshold fixed, flat after the window filled). Fixing the
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic rule off) is what ``MALLOC_MMAP_THRESHOLD_``
does from the environment. Not for the trainer or the workers: torch frees and reallocates large tensors every
step, and the dynamic rule is what spares them a mapping per tensor. Elsewhere than glibc this does nothing."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, kept fixed


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """True when the allocator took the fixed threshold (glibc), False where there is no such setting."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    logger.debug("malloc mmap threshold fixed at %d bytes: %s", threshold, done)
    return done
