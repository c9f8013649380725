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

[Note: engine threads and glibc malloc] By default every rank runs the opposite policy (``retain_freed_memory``,
set by ``SMPStrategy`` in each rank unless ``release_host_memory=True``): one arena for all threads
(``M_ARENA_MAX=1``), a fixed mmap threshold of 32 MiB (glibc's own ceiling for its dynamic one) and a trim threshold
of 256 MiB. The pipeline engine computes in several threads (the driver's microbatches, the request workers, which
are new threads every step); under glibc's defaults each thread allocates from its own arena, whose free top is
handed back to the OS (trimmed) as soon as it passes the dynamic trim threshold, and tensors above the dynamic mmap
threshold are mapped afresh. Each step then faulted its activations in again, page by page, zeroed by the kernel,
while holding the compute token: on the example GPT at pp=2, M=4 (``benchmarks/gpt_pipeline_step.py``) 11-20 k
minor faults per step on stage 0 and 5-14 k on stage 1 against 5-6 k for the same microbatches in one thread of
the rank's process, and the compute spans' thread CPU time was 1.12-1.18x that one-thread run's. With this policy
the ranks fault 15-16 times per step (the one-thread run 0) and the compute spans take 1.03x the one-thread CPU
time (the rest is the engine's Python work per request while computing). Measured on a loaded machine, so in CPU
time; wall times there stretch with the load. Process-wide, set before the process group starts any thread; the
cost is that up to 256 MiB of freed memory at the top of the heap stays resident for the next step, as in a
one-process loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import sys

__all__ = ["fix_mmap_threshold", "glibc", "retain_freed_memory", "trim_host_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # <malloc.h>
_RETAINED_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_RETAINED_TRIM_THRESHOLD = 256 * 1024 * 1024


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


def retain_freed_memory() -> bool:
    """One malloc arena for all threads, freed blocks up to 32 MiB kept in the heap and its top trimmed only past
    256 MiB (``mallopt``), so the engine's threads reuse what the last step freed instead of faulting it in again
    (see [Note: engine threads and glibc malloc]). Process-wide; call it before threads start.

    Returns:
        Whether glibc accepted all three settings (``False`` where there is no glibc).
    """
    libc = glibc()
    if libc is None:
        return False
    settings = (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _RETAINED_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _RETAINED_TRIM_THRESHOLD)
    )
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


def trim_host_memory() -> bool:
    """``malloc_trim(0)``: give every arena's free pages back to the OS (see the Note).

    Returns:
        Whether memory was released (``False`` if none was, or where there is no glibc).
    """
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)
