"""The one engine thread behind the server, and the bridge from its events to asyncio handlers.

The thread steps the engine while any request is waiting or active and sleeps on `engine.wakeup`
otherwise, so every request shares one loop: new ones join at canvas boundaries, rows at different
denoising steps share each forward, finished and cancelled ones leave (all engine behaviour).

Each request's events (drafts, committed canvases, the end) arrive on the engine thread and are
handed to the event loop that submitted it (`call_soon_threadsafe`). With a time limit (`dgemma serve
--request-timeout`), a request whose handler is still waiting for its next event when the limit is reached
gets a `Failure` (504, "request_timeout") instead, and its row is freed at the next engine step. Drafts are pictures of a
canvas in progress: a client that reads slower than the engine steps gets only the newest one,
so a slow reader costs neither memory nor engine time. Committed canvases are never dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

from dgemma.engine import Engine, Event, QueueFull, Request, ScoreRequest
from dgemma.engine.lockstep import RanksLost
from dgemma.processes import release_freed_memory

log = logging.getLogger("dgemma.serve")

__all__ = ["EngineWorker", "RequestStream", "Failure", "QueueFull"]


@dataclass
class Failure:
    """The engine failed while this request was in it; the request is gone."""

    message: str
    kind: str = "error"
    status: int = 500  # the HTTP status a whole (not streamed) answer gets: 503 when the server is stopping
    code: str | None = None  # the OpenAI error's code ("request_timeout")


class RequestStream:
    """One request's events, consumed by the handler that submitted it (on its event loop)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, time_limit: float | None = None,
                 on_timeout=None):
        """time_limit: seconds from now after which `next` stops waiting, calls `on_timeout()` (which frees the
        request's row) and answers a Failure."""
        self.request = request
        self.loop = loop
        self.time_limit, self.on_timeout = time_limit, on_timeout
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self._items: deque[Event | Failure] = deque()
        self._ready = asyncio.Event()

    def push(self, item: Event | Failure):
        """Any thread: queue an item for the consumer."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _deliver(self, item: Event | Failure):
        if item.kind == "draft" and self._items and self._items[-1].kind == "draft":
            self._items[-1] = item  # the reader is behind: only the newest draft matters
        else:
            self._items.append(item)
        self._ready.set()

    async def next(self) -> Event | Failure:
        while not self._items:
            self._ready.clear()
            if self.deadline is None:
                await self._ready.wait()
                continue
            try:
                await asyncio.wait_for(self._ready.wait(), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                return self._timed_out()
        return self._items.popleft()

    def _timed_out(self) -> Failure:
        if self.on_timeout is not None:
            self.on_timeout()
            self.on_timeout = None
        return Failure(f"the request ran past this server's time limit of {self.time_limit:g} s (--request-timeout) and was "
                       f"stopped; ask for fewer tokens (max_tokens) or retry", status=504, code="request_timeout")


class EngineWorker:
    def __init__(self, model, *, max_batch: int, max_queue: int, max_length: int | None = None,
                 engine_class=Engine, on_fatal=None, prefix_cache_bytes: int = 0,
                 prefill_chunk: int | None = None, deterministic: bool = False, request_timeout: float | None = None):
        """engine_class: Engine, or LockstepEngine on rank 0 of a split model; there a failed step is fatal
        (the ranks are out of step): `fatal` says why, new work is refused (503) and `on_fatal()` runs.
        request_timeout: seconds a request may take from its submission (None: no limit)."""
        self._engine_args = dict(max_batch=max_batch, max_queue=max_queue, max_length=max_length,
                                 prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk,
                                 deterministic=deterministic)
        self.model = model
        self.engine_class, self.on_fatal, self.fatal = engine_class, on_fatal, None
        self.engine = engine_class(model, **self._engine_args)
        self.max_batch, self.max_queue, self.request_timeout = max_batch, max_queue, request_timeout
        self.max_length = self.engine.max_length  # positions per request, prompt and output
        self._lock = threading.Lock()  # guards `engine` (replaced after a failure) and `_streams`, nothing else
        self._streams: dict[str, RequestStream] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._recent_seconds: deque[float] = deque(maxlen=32)  # request durations, for Retry-After
        self.failures = 0
        # told of engine steps, finished requests and failures, on the engine thread (serving/metrics.py)
        self.observer = None
        # called on the engine thread between steps (serving/lifecycle.py switches the compiled step in)
        self.between_steps = None
        # freed heap memory was handed back since the engine last stepped (glibc keeps it for reuse while
        # busy: dgemma.engine.allocator)
        self._trimmed = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self):
        self._thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0):
        """End the thread; requests still in flight fail with "shutting down" instead of hanging."""
        self._stopping.set()
        engine = self.engine
        if engine is not None:
            engine.wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.request.state.on_event = None
            stream.push(Failure(self.fatal or "the server is shutting down", status=503))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    # -- requests (event-loop thread) ------------------------------------------------------------------
    def submit(self, prompt: list[int], sampling, *, seed: int | None = None, want_drafts: bool = False,
               constraint=None, images=None, adapter: int = 0) -> RequestStream:
        """Queue a request (constraint: a dgemma.structured.TokenAutomaton or None; images: the prompt's
        dgemma.images.ImageInputs or None); raises QueueFull, or ValueError when it cannot fit the cache."""
        seed = secrets.randbits(63) if seed is None else seed
        request = Request(prompt=prompt, sampling=sampling, seed=seed, want_drafts=want_drafts, constraint=constraint,
                          images=images, adapter=adapter)
        return self._submit([request])[0]

    def submit_scoring(self, prompts: list[list[int]], top: int) -> list[RequestStream]:
        """Queue one scoring request per prompt (`top` alternatives per position), all or none."""
        return self._submit([ScoreRequest(prompt=p, top=top) for p in prompts])

    def _submit(self, requests: list[Request | ScoreRequest]) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(r, loop, self.request_timeout) for r in requests]
        for request, stream in zip(requests, streams):
            request.state.on_event = functools.partial(self._on_event, stream)
            stream.on_timeout = functools.partial(self.cancel, stream)
        # Never hold our lock while the engine takes its own: the engine thread reports events (and so
        # takes our lock in _on_event) while holding the engine's lock.
        with self._lock:
            engine = self.engine
            self._streams.update((r.request_id, s) for r, s in zip(requests, streams))
        try:
            if engine is None or self._stopping.is_set():
                raise RuntimeError("the engine is not running")
            engine.submit_all(requests)
        except BaseException:
            with self._lock:
                for r in requests:
                    self._streams.pop(r.request_id, None)
            raise
        return streams

    def cancel(self, stream: RequestStream):
        """Free the request's row at the next engine step; harmless once it has finished."""
        engine = self.engine
        if engine is not None and not stream.request.done:
            engine.cancel(stream.request)

    def load(self) -> dict:
        engine = self.engine
        active, waiting = (len(engine.active), len(engine.waiting)) if engine is not None else (0, 0)
        cache = engine.prefix_cache if engine is not None else None
        return {"active": active, "waiting": waiting, "max_batch": self.max_batch, "max_queue": self.max_queue,
                "prefix_cache": None if cache is None else cache.stats.as_dict()}

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the queue ahead, served max_batch at a time."""
        if not self._recent_seconds:
            return 1
        typical = sorted(self._recent_seconds)[len(self._recent_seconds) // 2]
        rounds = self.load()["waiting"] / self.max_batch
        return int(min(60, max(1, math.ceil(typical * rounds))))

    # -- the engine thread -----------------------------------------------------------------------------
    def _on_event(self, stream: RequestStream, event: Event):
        if event.kind == "finished":
            with self._lock:
                self._streams.pop(event.request_id, None)
            request = stream.request
            if event.finish_reason != "cancelled":
                self._recent_seconds.append(time.perf_counter() - request.state.t_submit)
            if self.observer is not None:
                self.observer.request_finished(request)
        stream.push(event)

    def _run(self):
        while not self._stopping.is_set():
            try:
                self._step_or_wait()
            except RanksLost as error:
                self.fatal = str(error)
                self.stop(timeout=0)
                if self.on_fatal is not None:
                    self.on_fatal()
            except Exception as error:  # e.g. out of memory: fail the requests, not the server
                self._recover(error)

    def _step_or_wait(self):
        engine = self.engine
        # clear before looking, so a submit between the look and the wait still wakes us
        engine.wakeup.clear()
        if self.between_steps is not None:
            self.between_steps()
        if engine.has_work():
            start = time.perf_counter()
            engine.step()
            self._trimmed = False
            if self.observer is not None:
                self.observer.engine_step(time.perf_counter() - start, len(engine.active))
        elif not engine.wakeup.wait(timeout=1.0) and not self._trimmed:
            # a second with nothing to do: hand the heap's freed memory back to the kernel (malloc_trim), once
            # an idle spell, so an idle server holds what is live, not its busiest moment's buffers
            release_freed_memory()
            self._trimmed = True

    def _recover(self, error: Exception):
        """Fail every request in flight and start over with a fresh engine (its cache state is suspect)."""
        self.failures += 1
        if self.observer is not None:
            self.observer.engine_failure()
        log.error("engine step failed; failing the requests in flight and rebuilding the engine", exc_info=error)
        message = f"the engine failed: {type(error).__name__}: {error}"
        error.__traceback__ = None  # the traceback's frames hold the old engine
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self.engine = None  # let the old cache go before the new one is allocated
            try:
                self.engine = self.engine_class(self.model, **self._engine_args)
            except Exception:
                log.exception("could not rebuild the engine; the server stops taking requests")
                self._stopping.set()
        for stream in streams:
            stream.request.state.on_event = None  # whatever the old engine still holds stays silent
            stream.push(Failure(message))
