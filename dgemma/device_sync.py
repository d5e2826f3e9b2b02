"""Host-device synchronisation on the generation path: the deliberate reads, counted, and host values
moved to the device without waiting.

On a GPU the host queues kernels and runs ahead of them. Reading a value computed on the device
(`.tolist()`, `.item()`, `bool(t)`, `int(t)`, `nonzero()` whose output size the host must learn, a copy
to the host) makes the host wait until everything queued before it has run; the GPU then idles while
the host catches up. `torch.tensor(values, device="cuda")` waits too (a copy from pageable memory is
synchronous). So the generation path keeps its bookkeeping (cache rows and lengths, step counts,
committed tokens) in Python, reads device values only through `host_read`, which counts every read by
its reason, and sends host values with `to_device`, which does not wait.

The engine reads once per denoising step (each row's stop flag, accepted count and argmax canvas
together); tests/test_syncs.py counts that on CPU, and with `torch.cuda.set_sync_debug_mode("error")`
on a GPU, where `host_read` is the one place allowed to wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch

_local = threading.local()  # .reading: inside host_read on this thread; .counts: a Counter being filled


def host_read(tensor: torch.Tensor, reason: str):
    """tensor.tolist(): a deliberate read of device values (waits for the device), counted under
    `reason` in the innermost `count_host_reads()` on this thread."""
    counts = getattr(_local, "counts", None)
    if counts is not None:
        counts[reason] += 1
    _local.reading = True
    try:
        if tensor.is_cuda and torch.cuda.get_sync_debug_mode():  # a test watching for syncs: this one is meant
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return tensor.tolist()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return tensor.tolist()
    finally:
        _local.reading = False


def reading() -> bool:
    """Whether this thread is inside `host_read` (for tests that flag every other read)."""
    return getattr(_local, "reading", False)


@contextlib.contextmanager
def count_host_reads():
    """Collect the `host_read` calls made on this thread inside the block: yields a Counter reason -> reads."""
    outer = getattr(_local, "counts", None)
    _local.counts = counts = Counter()
    try:
        yield counts
    finally:
        _local.counts = outer
        if outer is not None:
            outer.update(counts)


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or nested lists) as a tensor on `device`, without waiting for the device: on CUDA the
    values go through pinned memory with a non-blocking copy (the pinned block is not reused before the
    copy has run: torch's host allocator records it on the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
