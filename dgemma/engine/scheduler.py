"""Which requests hold cache rows and step together, the queue in front of them, and how much of a long
prompt is read beside them (`PrefillPace`).

Requests wait in arrival order until a cache row is free; every request holding a row takes part in
the next decoder forward, whatever its denoising step. A cancelled request leaves at the next loop
iteration, waiting or not. `add` and `cancel` may be called from any thread; the rest runs on the
engine's loop thread.
"""

from __future__ import annotations

import threading
from collections import deque

from dgemma.engine.request import Request, Status


class QueueFull(Exception):
    """More requests are waiting than the engine accepts; retry later."""


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int):
        self.max_queue = max_queue
        self.free_rows = list(range(max_batch))
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # hold a row: stepped together
        self.lock = threading.Lock()
        self.wakeup = threading.Event()  # set when work arrives, for a serving loop that sleeps

    # -- any thread --------------------------------------------------------------------------
    def add(self, request: Request, *, bounded: bool = True):
        """Queue a request; `bounded` enforces max_queue (QueueFull when the queue is full)."""
        with self.lock:
            if bounded and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(request)
        self.wakeup.set()

    def add_all(self, requests: list[Request]):
        """Queue requests together: all of them, or none and QueueFull (one HTTP request's prompts)."""
        with self.lock:
            if len(self.waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.extend(requests)
        self.wakeup.set()

    def cancel(self, request: Request):
        request.state.cancel_requested = True
        self.wakeup.set()

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.active)

    # -- the loop thread -----------------------------------------------------------------------
    def take_cancelled(self) -> list[Request]:
        """Cancelled requests, waiting ones first; the waiting ones leave the queue here, the active
        ones when the engine releases their rows."""
        with self.lock:
            waiting = [r for r in self.waiting if r.state.cancel_requested]
            for r in waiting:
                self.waiting.remove(r)
        return waiting + [r for r in self.active if r.state.cancel_requested]

    def admit(self):
        """Yield waiting requests, oldest first, each given a free row, for as long as rows are free."""
        while self.free_rows:
            with self.lock:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            request.state.row = self.free_rows.pop(0)
            request.state.status = Status.DENOISING
            self.active.append(request)
            yield request

    def release(self, request: Request) -> int | None:
        """The request leaves the batch; returns the row it held (for the cache to reset), if any."""
        if request in self.active:
            self.active.remove(request)
        row, request.state.row = request.state.row, None
        if row is not None:
            self.free_rows.append(row)
        return row


class PrefillPace:
    """How many prompt tokens a chunk read beside running requests takes, from measured times: an engine
    iteration that only steps gives the usual step time (a running average), one that also reads a chunk
    of n tokens gives that chunk's seconds per token (its time less a usual step). The next chunk is as
    long as one usual step at that rate, so a running request waits about two of its steps at most, and
    the chunks shrink as a long prompt's later tokens (attending to more of it) cost more. Rounded to 16
    tokens, between 16 and 8 canvases, and growing at most twice over per chunk; one canvas before any
    measurement."""

    def __init__(self, canvas_length: int):
        self.largest = 8 * canvas_length
        self.chunk_tokens = canvas_length
        self.step_seconds: float | None = None

    def observe(self, tokens_read: int, seconds: float):
        if tokens_read == 0:
            previous = self.step_seconds
            self.step_seconds = seconds if previous is None else 0.7 * previous + 0.3 * seconds
        elif self.step_seconds is not None:
            per_token = max(seconds - self.step_seconds, 1e-6) / tokens_read
            fits = int(self.step_seconds / per_token) // 16 * 16
            self.chunk_tokens = max(16, min(fits, 2 * self.chunk_tokens, self.largest))
