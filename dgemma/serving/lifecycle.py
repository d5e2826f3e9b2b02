"""A graceful stop: on SIGTERM or Ctrl-C the server drains, then exits 0.

  1. the first signal starts the drain: new requests get 503 in OpenAI's shape (code "shutting_down",
     `Connection: close`), /health answers 503 {"status": "draining"}; requests already running go on;
  2. when none is left, or after --shutdown-grace seconds (default 30), the engine stops: a stream still
     open gets a final error event and [DONE], a whole answer still waiting a 503;
  3. uvicorn then closes the listening socket and the connections, the engine thread ends, exit code 0.

A second Ctrl-C (or SIGTERM) during the drain stops at once, as uvicorn's own second Ctrl-C does.
The listening socket stays open during the drain on purpose: a client that connects then is told
"503, retry elsewhere" rather than refused without a word.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from dgemma.serving.state import ServerState

log = logging.getLogger("dgemma.serve")

DEFAULT_GRACE_SECONDS = 30.0
# after the grace, how long the handlers get to write the final error events before the sockets close
FLUSH_SECONDS = 3.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_seconds: float = DEFAULT_GRACE_SECONDS):
        super().__init__(config)
        self.state, self.grace_seconds = state, grace_seconds
        self.drain_started: float | None = None
        self.engine_stopped_at: float | None = None

    def handle_exit(self, sig, frame):
        """A signal handler (main thread): start the drain, or on a second signal stop now. The signal is not
        raised again after the server ends (uvicorn's default), so the process exits 0."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.state.traffic.draining = True
            return
        self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            self._advance_drain()
        return await super().on_tick(counter)

    def _advance_drain(self):
        busy = self.state.traffic.in_flight
        now = time.monotonic()
        if busy == 0:
            self.should_exit = True
            return
        if self.engine_stopped_at is None and now - self.drain_started >= self.grace_seconds:
            log.warning("shutdown grace of %.0f s is over: ending %d request(s) still running", self.grace_seconds,
                        busy)
            self.engine_stopped_at = now
            # every open stream gets its final error event; off the event loop, which writes those events
            asyncio.get_running_loop().run_in_executor(None, self.state.worker.stop)
        elif self.engine_stopped_at is not None and now - self.engine_stopped_at >= FLUSH_SECONDS:
            self.should_exit = True
