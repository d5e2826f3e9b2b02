"""Process memory settings for generation: glibc keeps freed memory for reuse and hands it back on demand,
and the CPU kernel libraries' per-shape caches are bounded.

Generating commands free and reallocate the same (B, L, V)-sized buffers at every denoising step; with
glibc's defaults each of those is a fresh mmap, page-faulted in again every step.

On a CPU, bf16 matmuls run through oneDNN (via ideep), which keeps every kernel it builds in two caches keyed
by shape, 1,024 entries each by default. A server sees an unbounded set of shapes: every prompt length, and
in every MoE layer the number of tokens routed to each expert. Unbounded, those caches grew a server's memory
by ~5 MiB a request for hundreds of requests (benchmarks/README.md, "Memory over a long run").
"""

from __future__ import annotations

import os

from dgemma.processes import glibc

# kernels kept per cache: a forward's repeated shapes (the dense layers' q/k/v/o and MLP projections, shared
# by every layer) stay cached, and the caches stop growing with the shapes seen. An AMX kernel holds ~0.75 MiB
# (the two caches full: ~190 MiB), an AVX-512 one far less; 32 entries would hold AMX's caches to ~50 MiB but
# cost a batch of 4 canvases 15% of its speed, its experts' routed-token counts no longer fitting
# (tests/test_server_memory.py, bench-20m bf16)
KERNEL_CACHE_ENTRIES = 128


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of handing them back to the kernel.

    By default a large block gets its own mmap, and freed memory at the top of the heap is returned once it
    passes a trim threshold; a generation step frees and reallocates the same large buffers every step, so
    every step page-faults them in again (benchmarks/README.md has the counts). Peak memory is unchanged;
    memory freed after the peak stays with the process. Linux with glibc only; returns False where it
    does nothing.
    """
    libc = glibc()
    if libc is None:  # not glibc (musl has no mallopt)
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES):
    """Cap oneDNN's primitive cache and ideep's computation cache at `entries` kernels each (least recently
    used go first), unless the environment already sets them (ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    LRU_CACHE_CAPACITY). Both libraries read these once, at their first bf16 matmul, so this must run before
    the model does; the kernels themselves, and so the tokens, are the same either way."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))
