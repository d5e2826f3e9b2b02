"""Processes: those dgemma starts end when what started them ends, even by SIGKILL, and what a process holds
in memory (Linux).

A split server's ranks (started by torch.distributed's launcher) and a Ray Serve replica's split server are
children whose parent may be killed without a chance to stop them (an OOM kill, a supervisor's SIGKILL, Ray
killing a replica's process): left alone, a rank 0 would go on serving its port and the other ranks would wait
on it. `end_with_parent` asks the kernel to send SIGTERM, which they handle as a stop, when the parent ends.

`resident_memory` reads a process's resident memory from /proc (the one place dgemma, its benchmarks and
its tests read it; tests/test_import_graph.py holds that), `restart_peak_rss` starts its peak afresh, and
`release_freed_memory` hands glibc's freed heap back to the kernel. `shorten_openmp_spin` keeps torch's idle
OpenMP threads from holding a core that a kernel library's threads need.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# libgomp (torch's OpenMP on Linux) lets a thread that has finished a parallel region spin GOMP_SPINCOUNT times
# before it sleeps: 300,000 by default, ~5 ms on a Zen 4 core. OpenVINO runs its graphs on threads of its own, so
# one started inside that window shares a core with the spinning thread: on 2 cores an int4 projection of 256
# rows took 12.5 ms right after a torch op against 6.5 ms alone, and a 26B layer's dense MLP 32-37 ms against
# 22. At 10,000 (~0.2 ms) the library's step of 4 of the 26B's layers is 15-18% faster (1,765-1,878 -> 1,509-1,537
# ms); torch's own back-to-back ops still find their threads awake (benchmarks/README.md)
OPENMP_SPIN_COUNT = 10_000


def end_with_parent(signum: int = signal.SIGTERM):
    """Have the kernel send `signum` to this process when its parent ends; sent at once if the parent already
    has. The kernel watches the parent *thread* that started this process: start it from a thread that lives as
    long as the parent does. Nothing happens off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) != 0:
        return  # not allowed here (a sandbox): the parent's own stop still ends the child
    if os.getppid() != parent:  # the parent ended before the request took hold
        os.kill(os.getpid(), signum)


def openmp_spin() -> str | None:
    """How long idle OpenMP threads spin as the environment sets it: GOMP_SPINCOUNT's value, else OMP_WAIT_POLICY's
    (lower case), else None (libgomp's default)."""
    if "GOMP_SPINCOUNT" in os.environ:
        return os.environ["GOMP_SPINCOUNT"]
    return os.environ["OMP_WAIT_POLICY"].lower() if "OMP_WAIT_POLICY" in os.environ else None


def shorten_openmp_spin(count: int = OPENMP_SPIN_COUNT) -> bool:
    """Let torch's idle OpenMP threads spin `count` times before sleeping instead of libgomp's 300,000 (see
    OPENMP_SPIN_COUNT), through GOMP_SPINCOUNT, which libgomp reads once, when torch loads it: so only before
    torch is imported, and never over the environment's own setting (`openmp_spin`). Child processes (ranks,
    replicas) inherit it. Returns whether it was set."""
    if "torch" in sys.modules or openmp_spin() is not None:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(count)
    return True


# /proc/PID/status's fields (kB) -> resident_memory's keys
_STATUS_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "private"}


def resident_memory(pid: int | str = "self") -> dict[str, int]:
    """Process `pid`'s resident memory in bytes, as Linux's /proc/PID/status gives it: "rss" now (VmRSS),
    "peak_rss" its peak since it started or since `restart_peak_rss` (VmHWM), "private" its anonymous part now
    (RssAnon: the RSS also counts file pages, such as a checkpoint's mapped shards). Off Linux, zeros.
    OSError when the process has ended."""
    out = dict.fromkeys(_STATUS_FIELDS.values(), 0)
    if not sys.platform.startswith("linux"):
        return out
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in _STATUS_FIELDS:
                out[_STATUS_FIELDS[name]] = int(line.split()[1]) * 1024
    return out


def restart_peak_rss() -> bool:
    """Make this process's peak resident memory (`resident_memory()["peak_rss"]`) start again from its resident
    memory now (Linux: "5" written to /proc/self/clear_refs). False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def glibc():
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


def limit_malloc_arenas(count: int) -> bool:
    """glibc: threads that have no malloc arena yet share the existing ones once there are `count` (mallopt
    M_ARENA_MAX), instead of each getting its own up to 8 per core. Each arena keeps the largest set of blocks
    its threads freed, so a library that runs work on many threads of its own holds that many sets. Nothing is
    changed where the environment already sets the cap (MALLOC_ARENA_MAX, or glibc.malloc.arena_max in
    GLIBC_TUNABLES), or where the C library is not glibc; returns whether the cap was set."""
    if "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = glibc()
    M_ARENA_MAX = -8
    return libc is not None and bool(libc.mallopt(M_ARENA_MAX, count))


def release_freed_memory():
    """glibc: hand freed heap memory back to the kernel now (malloc_trim). `dgemma bench` does this before
    every timed run, so that resident memory before a run is what is live and the run's own allocations
    show in its peak even while freed memory is kept for reuse (dgemma.engine.allocator.keep_freed_memory);
    a hand-over to a kernel library does it before it plans (so that the resident memory it counts is what
    is live) and after each experts layer it gives away, so that what it freed is not kept beside what the
    library allocates next."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
