"""glibc's allocator, set for generation: freed memory kept for reuse, and handed back on demand.

Generating commands free and reallocate the same (B, L, V)-sized buffers at every denoising step; with
glibc's defaults each of those is a fresh mmap, page-faulted in again every step.
"""

from __future__ import annotations

import sys


def _glibc():
    """The C library when it is glibc (it has mallopt and malloc_trim), else None."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of handing them back to the kernel.

    By default a large block gets its own mmap, and freed memory at the top of the heap is returned once it
    passes a trim threshold; a generation step frees and reallocates the same large buffers every step, so
    every step page-faults them in again (benchmarks/README.md has the counts). Peak memory is unchanged;
    memory freed after the peak stays with the process. Linux with glibc only; returns False where it
    does nothing.
    """
    libc = _glibc()
    if libc is None:  # not glibc (musl has no mallopt)
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def release_freed_memory():
    """glibc: hand freed heap memory back to the kernel now (malloc_trim); `dgemma bench` does this before
    every timed run, so that resident memory before a run is what is live and the run's own allocations
    show in its peak even while freed memory is kept for reuse (`keep_freed_memory`)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
