"""Giving freed host memory back to the OS on glibc Linux (through ``ctypes``; a no-op elsewhere).

[Note: freed tensors stay resident under glibc] CPU tensors live in glibc malloc. Blocks above the mmap
threshold (128 KiB at start) are mapped and unmapped, so their memory leaves the process when freed; but glibc
raises the threshold to the size of the first large mapped block that is freed (up to 32 MiB), and from then on
tensors of that size come from the heap of the allocating thread's arena. Memory freed there stays resident
until the same arena reuses it, and the pipeline's engine threads allocate from their own arenas, so the
previous step's gradients and activations stay in the process's resident set while the next step allocates new
ones in another arena: about one gradient copy more per rank at the peak.

Two remedies, both glibc calls: ``mallopt(M_MMAP_THRESHOLD, n)`` fixes the threshold (and turns the dynamic
adjustment off), as the ``MALLOC_MMAP_THRESHOLD_`` environment variable does, so every tensor above ``n`` is
mapped and unmapped (each step then faults its large tensors' pages in again); ``malloc_trim(0)`` hands the free
pages of every arena back (``madvise(MADV_DONTNEED)``) without changing how memory is allocated.
Measured on the example GPT (pp=4, 193 MiB stages, SGD; ``benchmarks/memory.py --host-memory``), per-rank peak:
glibc default 841-1143 MiB, ``malloc_trim`` after every batch 582-701, one arena for all threads
(``MALLOC_ARENA_MAX=1``: no extra cost per step, but set before threads start) 509-580, the fixed threshold
444-504 (the same as the environment variable); the fixed threshold made steps 1.0-2.0x as long at pp=2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import sys

__all__ = ["fix_mmap_threshold", "glibc", "trim_host_memory"]

_M_MMAP_THRESHOLD = -3  # <malloc.h>


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's glibc, or ``None`` (another OS or C library, or it cannot be loaded)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)``: blocks above ``nbytes`` are always mapped (see the Note).

    Returns:
        Whether glibc accepted it (``False`` where there is no glibc).
    """
    libc = glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1)


def trim_host_memory() -> bool:
    """``malloc_trim(0)``: give every arena's free pages back to the OS (see the Note).

    Returns:
        Whether memory was released (``False`` if none was, or where there is no glibc).
    """
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)
