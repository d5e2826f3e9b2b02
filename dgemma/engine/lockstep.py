"""The engine on every rank of a tensor-parallel model (`dgemma.parallel`), in lockstep.

Every forward of a split model is a collective: all ranks must run the same batch, step for step. Rank 0
(the leader: the one that speaks HTTP) owns the queue. Requests and cancellations submitted to it wait
until its next step, which hands them to every rank at once (`broadcast_object_list`: the requests
without their callbacks, the cancelled ids); then each rank runs the engine's own step. What happens in a
step after that is decided alike on every rank without further messages: admissions follow the queue
order and the free rows, each request draws its canvas noise from its own seeded generator, and the
logits (all-gathered) are the same bits on every rank, so samples, stops and commits agree. The one
decision taken from a clock, how many prompt tokens a step reads beside running requests (the
`PrefillPace`, measured on each rank's own clock), travels in the message too: every rank reads the
leader's chunk.

A server's compiled step (built on every rank's compile thread meanwhile, dgemma/serving/lifecycle.py) is
switched to at one step on every rank: the leader sends "switch" once its own is ready (`compile_switch`),
and each rank takes it there, waiting for its own compile to finish if it has not yet.

When the leader has nothing to do its step is a heartbeat (an "idle" message every `heartbeat_s`), so
the followers' waits stay inside the collective timeout and a dead rank is noticed within it. A failed
collective (or any failed step: the ranks would no longer agree) raises `RanksLost`.
"""

from __future__ import annotations

import dataclasses
import threading

import torch.distributed as dist

from dgemma.engine.engine import Engine
from dgemma.engine.scheduler import QueueFull

# The exit code of a rank 0 that lost the other ranks and has said which in its own line (the launcher then
# adds none: dgemma/commands/_tensor_parallel.py)
LOST_RANKS_EXIT = 3


class RanksLost(RuntimeError):
    """A collective failed or timed out: another rank died or hangs; the split model cannot go on."""


class LockstepEngine(Engine):
    def __init__(self, model, *, heartbeat_s: float = 1.0, **engine_args):
        super().__init__(model, **engine_args)
        self.tp = model.tp
        self.leader = self.tp.rank == 0
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._incoming, self._cancels = [], []  # the leader's, until its next step hands them out
        self._handed_out = []  # the leader's own request objects of the step's message (followers get copies)
        self._closing = False
        # a server's background compile (lifecycle.BackgroundCompile) on every rank: `ready()` on the leader,
        # `switch_when_ready()` on every rank when the leader says so
        self.compile_switch = None

    # -- the leader's queue (any thread) -----------------------------------------------------------
    def submit(self, request):
        return self.submit_all([request])[0]

    def submit_all(self, requests):
        for r in requests:
            self.check_fits(r)
        with self._lock:
            if len(self.waiting) + len(self._incoming) + len(requests) > self.scheduler.max_queue:
                raise QueueFull(f"{len(self.waiting) + len(self._incoming)} requests are already waiting")
            self._incoming.extend(requests)
        self.wakeup.set()
        return requests

    def cancel(self, request):
        with self._lock:
            self._cancels.append(request.request_id)
        self.wakeup.set()

    def has_work(self) -> bool:
        return True  # the leader's step is also the heartbeat; a follower always waits for the next one

    def close(self):
        """Leader: the next step tells the followers to stop (and returns False)."""
        self._closing = True
        self.wakeup.set()

    # -- the loop (one thread per rank) --------------------------------------------------------------
    def step(self) -> bool:
        """One lockstep step; False once the leader has said stop."""
        message = self._broadcast(self._next_message() if self.leader else None)
        kind = message[0]
        if kind == "stop":
            return False
        if kind == "switch":
            self.compile_switch.switch_when_ready()
            self.compile_switch = None
            return True
        if kind == "idle":
            if self.leader:
                self.wakeup.wait(self.heartbeat_s)
            return True
        _, requests, cancelled, chunk_tokens = message
        if self.leader:
            requests = self._handed_out
        self.pace.chunk_tokens = chunk_tokens  # the leader's measured chunk (its own value on the leader)
        for r in requests:
            self.scheduler.add(r, bounded=False)
        if cancelled:
            for r in list(self.waiting) + self.active:
                if r.request_id in cancelled:
                    r.state.cancel_requested = True
        try:
            super().step()
        except Exception as e:  # one rank's failure leaves the ranks out of step: none can go on
            raise RanksLost(f"rank {self.tp.rank}: the step failed ({self.tp.describe_lost(e)})") from None
        return True

    def follow(self):
        """A follower's whole life: step until the leader says stop."""
        while self.step():
            pass

    def _next_message(self):
        with self._lock:
            requests, cancelled = self._incoming, self._cancels
            self._incoming, self._cancels = [], []
        if self._closing:
            return ("stop",)
        if self.compile_switch is not None and self.compile_switch.ready():
            with self._lock:  # they go out with the next step
                self._incoming[:0], self._cancels[:0] = requests, cancelled
            return ("switch",)
        self._handed_out = requests
        if not requests and not cancelled and not super().has_work():
            return ("idle",)
        return ("step", [_portable(r) for r in requests], set(cancelled), self.pace.chunk_tokens)

    def _broadcast(self, message):
        box = [message]
        try:
            dist.broadcast_object_list(box, src=0, group=self.tp.group)
        except (RuntimeError, dist.DistBackendError) as e:
            raise RanksLost(f"rank {self.tp.rank}: lost the other ranks ({self.tp.describe_lost(e)})") from None
        return box[0]


def _portable(request):
    """The request as the followers get it: the same inputs and id, a fresh state, no callbacks."""
    if request.scoring:
        return dataclasses.replace(request)
    return dataclasses.replace(request, images=request.state.images, on_event=None)


