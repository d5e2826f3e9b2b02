"""This process's place among the ranks of a split model: the process group (`join`), the collectives the
split modules call (`TensorParallel`), the timeouts that bound a wait for a dead or hung rank, and each
rank's heartbeat in the group's store, which names a silent rank when a collective fails.

The collectives are hand-written c10d calls, each named where it runs (`dgemma.parallel.modules`). Under
torch.compile the same calls are torch's functional collectives, which dynamo traces into the graph.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

# How long a collective may wait for the other ranks before this one gives up (a dead or hung rank). The
# engine's ranks meet at least every few seconds even when idle (dgemma.engine.lockstep), so this bounds
# how long a failure goes unnoticed.
DEFAULT_TIMEOUT_S = 30.0
# ... except in a compiled call that compiled: the ranks compile the same graph, but not in the same time,
# and the first to finish waits in the graph's first collective for the others (`TensorParallel.compiled_call`)
COMPILE_TIMEOUT_S = 3600.0
# Every rank stamps the group's store with the time this often from a thread of its own (`_heartbeat`), so that
# when a collective fails the ranks can say which rank went silent (a hung or stopped process stamps nothing).
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 5.0


@dataclass(eq=False)
class TensorParallel:
    """This rank's place in the split: its process group, rank and the number of ranks."""

    group: dist.ProcessGroup
    rank: int
    ranks: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    # the same ranks again, for compiled graphs and for the thread that compiles them (`use_compile_group`): a
    # server's engine thread keeps stepping eagerly over `group` while every rank's compile thread warms up
    # its compiled step over this one, and collectives of two threads on one group would meet out of order
    compile_group: dist.ProcessGroup | None = None
    # the thread whose call is compiling: the compile group's timeout is COMPILE_TIMEOUT_S until that call ends
    patient: threading.Thread | None = None
    local: threading.local = field(default_factory=threading.local)

    def set_timeout(self, seconds: float):
        from datetime import timedelta

        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), self.compile_group or self.group)

    def use_compile_group(self):
        """From now on this thread's eager collectives go over the compile group too (a compile thread)."""
        self.local.group = self.compile_group

    def _group(self) -> dist.ProcessGroup:
        # is_dynamo_compiling, not is_compiling: the latter is a process-wide flag, True on every thread while
        # one thread compiles, and a server's engine thread steps eagerly meanwhile
        if torch.compiler.is_dynamo_compiling():  # a compiled graph's collectives: always the compile group
            return self.compile_group or self.group
        return getattr(self.local, "group", None) or self.group

    def silent_ranks(self) -> list[tuple[int, float]]:
        """(rank, seconds since its last stamp) of the ranks silent for more than SILENT_AFTER_S; [] when the
        store cannot say (it lived in a rank that is gone)."""
        try:
            store, now, out = dist.distributed_c10d._get_default_store(), time.time(), []
            for rank in range(self.ranks):
                key = f"dgemma/alive/{rank}"
                if rank != self.rank and store.check([key]):
                    silent = now - float(store.get(key))
                    if silent > SILENT_AFTER_S:
                        out.append((rank, silent))
            return out
        except Exception:  # the store's own connection failed: nothing to add
            return []

    def describe_lost(self, error: BaseException) -> str:
        """One line for a failed collective: the ranks that went silent, if any did, and what failed."""
        silent = self.silent_ranks()
        which = ", ".join(f"rank {r} of {self.ranks} silent for {s:.0f} s (hung or stopped)" for r, s in silent)
        return f"{which}: {describe_failure(error)}" if which else describe_failure(error)

    @contextlib.contextmanager
    def compiled_call(self):
        """Around a call of the compiled step: when dynamo compiles in it (`_compiling_started` made the
        group patient), its collectives wait up to COMPILE_TIMEOUT_S for ranks that compile slower; the
        group's own timeout is back once the call is over."""
        try:
            yield
        finally:
            if self.patient is threading.current_thread():
                self.patient = None
                self.set_timeout(self.timeout_s)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():  # traced into the compiled graph (a new tensor, not in place)
            return funcol.all_reduce(t, "sum", self._group())
        dist.all_reduce(t, group=self._group())
        return t

    def all_gather_last(self, t: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Every rank's `t` (..., n) -> (..., N n), concatenated in rank order along the last dim; with `keep`,
        only the first `keep` of those columns (the padded vocabulary's real tokens), in the one copy."""
        if torch.compiler.is_dynamo_compiling():  # traced into the compiled graph: gathered along dim 0, then split
            parts = list(funcol.all_gather_tensor(t.contiguous(), 0, self._group()).chunk(self.ranks))
        else:
            parts = [torch.empty_like(t) for _ in range(self.ranks)]
            dist.all_gather(parts, t.contiguous(), group=self._group())
        if keep is not None:
            n = t.shape[-1]
            parts = [p[..., : max(0, keep - i * n)] for i, p in enumerate(parts)]
        return torch.cat(parts, dim=-1)


_JOINED: "weakref.WeakSet[TensorParallel]" = weakref.WeakSet()


def _compiling_started(*_):  # dynamo passes its callback trigger
    """dynamo's compile-start callback: this process's split groups wait for slower compiling ranks."""
    for tp in list(_JOINED):
        if tp.patient is None:
            tp.patient = threading.current_thread()
            tp.set_timeout(COMPILE_TIMEOUT_S)


def join(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """This process's place among the ranks torch.distributed's launcher started (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT in the environment): NCCL on CUDA, gloo on a CPU, every collective bounded by
    `timeout_s` (a rank that died or hangs ends the others' waits with an error instead of a hang)."""
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    tp = TensorParallel(group, dist.get_rank(), dist.get_world_size(), timeout_s,
                        compile_group=dist.new_group(dist.get_process_group_ranks(group),
                                                     timeout=timedelta(seconds=timeout_s)))
    beat = threading.Thread(target=_heartbeat, args=(dist.distributed_c10d._get_default_store(), tp.rank),
                            name="dgemma-rank-heartbeat", daemon=True)
    beat.start()
    if not _JOINED:
        torch._dynamo.callback.callback_handler.register_start_callback(_compiling_started)
        atexit.register(leave)
    _JOINED.add(tp)
    _BEATS.append(beat)
    return tp


# A rank's exit, and why it leaves the group first
# ------------------------------------------------
# When the interpreter finalizes, a thread that takes the GIL from then on is ended where it stands (CPython
# calls pthread_exit in it); if that thread is inside a C++ call (frames that must not unwind), the process
# aborts: "terminate called without an active exception", SIGABRT. Two kinds of thread can take the GIL at
# that moment here: the heartbeat (`Store.set` releases the GIL and takes it back when it returns), and gloo's
# worker threads, which drop the last reference to a tensor handed to a collective after the waiting thread
# has moved on, and dropping it frees its Python object. So at exit, while the interpreter still runs, `leave`
# stops the heartbeat (waiting for its last stamp) and destroys the process groups, which joins gloo's
# threads; after it no thread that can take the GIL is left in a C++ call.
_HEARTBEAT_STOP = threading.Event()
_BEATS: list[threading.Thread] = []


def _heartbeat(store, rank: int):
    """This rank's stamp in the store every HEARTBEAT_S, until `leave` (or the store goes away)."""
    key = f"dgemma/alive/{rank}"
    while not _HEARTBEAT_STOP.is_set():
        try:
            store.set(key, repr(time.time()))  # a send: it returns at once unless the socket is full
        except Exception:  # the store went away with the group: nothing more to stamp
            return
        _HEARTBEAT_STOP.wait(HEARTBEAT_S)


def leave():
    """This process leaves the split (registered at exit by `join`): the heartbeat stops and is waited for,
    then every process group is destroyed and gloo's threads with them. After it, the process's split models
    cannot run collectives."""
    _HEARTBEAT_STOP.set()
    for beat in _BEATS:  # its last stamp is a send: done at once, unless the store's socket is full
        beat.join(max((tp.timeout_s for tp in _JOINED), default=DEFAULT_TIMEOUT_S))
    for tp in list(_JOINED):  # the groups' other references (a split model holds its TensorParallel)
        tp.group = tp.compile_group = None
    if dist.is_initialized():
        dist.destroy_process_group()  # the last references: each group's threads are joined as it goes


def describe_failure(error: BaseException) -> str:
    """What a failed collective says, in one line, without gloo's source location and advice: 'Connection
    closed by peer [127.0.0.1]:48837'."""
    text = (str(error).splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0] or type(error).__name__
