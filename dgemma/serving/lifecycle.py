"""How the server starts and stops: serving at once while the compiled step is built (fast start), and a
graceful stop on SIGTERM or Ctrl-C (drain, then exit 0).

Fast start
----------
The server answers with the eager step from its first second while the compiled step is built and warmed up
on a thread of its own, then the engine thread switches to it between two steps.

  listening ──► eager steps ──────────────────────────────────────┬──► compiled steps
  thread "dgemma-compile": compile_model(model, background=True)  │
                           warm-up engine (its own cache) ────────┘ ready: release_compiled(model), the
                                                                    engine's sampler scan becomes the warmed one

The compiled functions run only on the compile thread until released (`dgemma.compilation`), and after
the switch dynamo's stance is "eager_on_recompile": a call whose shapes the warm-up did not compile runs
eagerly instead of compiling, so the engine thread never traces or waits for a compile (the warm-up runs
requests shaped as served ones to cover most). The warm-up engine has the serving engine's batch size and
length, so its cache has the same shapes and the graphs it leaves fit the serving engine's calls (dynamo
marks batch and prefix length dynamic after the warm-up's two of each). Its cache is freed after the switch.
The sampler's compiled scan is handed over as it is: a new torch.compile wrapper would compile again. When
compiling fails the model stays eager (one warning line).

A split model (dgemma/parallel/) does this on every rank at once: each rank's compile thread runs the
same warm-up over the group's second process group (its compiled graphs and the thread's eager collectives),
while the engine threads step eagerly over the first, and the ranks switch at one lockstep step: rank 0
sends the switch when its step is ready, and each rank takes it when its own is (dgemma/engine/lockstep.py).

`/health` says which step runs: "compiling" (eager meanwhile), "compiled", or "eager" (no compile: --eager,
a large model on a CPU, or a compile that failed).

Graceful stop
-------------
On SIGTERM or Ctrl-C the server drains, then exits 0:

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
import sys
import threading
import time

import torch
import uvicorn

from dgemma.compilation.steps import compile_model, is_compiled, release_compiled
from dgemma.config import SamplingConfig
from dgemma.engine import Engine
from dgemma.serving.state import ServerState

log = logging.getLogger("dgemma.serve")


# -- fast start ----------------------------------------------------------------------------------------

def serving_warm_up(engine: Engine):
    """`Engine.warm_up` (two prompt lengths, two batch sizes), then requests shaped as served ones are: longer
    prompts, two canvases each (a commit between), batch one and two, so that the first real requests after
    the switch find their graphs instead of compiling on the engine thread."""
    engine.warm_up()
    L = engine.canvas_length
    sampling = SamplingConfig(max_new_tokens=2 * L, max_denoising_steps=2, fixed_steps=True,
                              eos_token_ids=(engine.vocab_size,), pad_token_id=engine.model.config.pad_token_id)
    for prompts in ([[0] * 3], [[0] * 5, [0] * 7], [[0] * 4]):
        engine.generate([p[: engine.max_length - 2 * L] for p in prompts], sampling, seeds=list(range(len(prompts))))
    engine.forwards = 0


class BackgroundCompile:
    """The compiled step, built and warmed up on a thread of its own while the eager step serves; the engine
    thread takes it between two steps (`between_steps`)."""

    def __init__(self, worker, mode: str):
        self.worker, self.mode = worker, mode
        self._ready_scan = None  # the warm-up engine's compiled scan, once everything is warm
        self._done = threading.Event()
        self._switched = False
        self.seconds: float | None = None  # compile + warm-up time

    def start(self):
        threading.Thread(target=self._build, name="dgemma-compile", daemon=True).start()

    def kind(self) -> str:
        if self._switched:
            return "compiled"
        return "eager" if self._done.is_set() else "compiling"

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def _build(self):
        # Not niced: this thread holds the GIL while it traces, and a thread the OS schedules less holding it
        # would stall the event loop and the engine thread with it (priority inversion).
        start = time.perf_counter()
        model = self.worker.model
        tp = getattr(model, "tp", None)
        if tp is not None:  # a rank of a split model: the warm-up's collectives over the compile group
            tp.use_compile_group()
        try:
            compile_model(model, self.mode, background=True)
            if is_compiled(model):
                warm = Engine(model, max_batch=self.worker.max_batch, max_length=self.worker.max_length)
                if tp is not None:  # every rank reads the warm-up's prompts in the same chunks, whatever its clock
                    warm.pace.observe = lambda tokens_read, seconds: None
                serving_warm_up(warm)
                if is_compiled(model):  # still: a failure during the warm-up turns it off
                    self._ready_scan = warm.scan
                del warm  # its cache
        except Exception as e:  # the server goes on eagerly
            print(f"dgemma serve: compiling failed, serving eagerly: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        self.seconds = time.perf_counter() - start
        self._done.set()
        self.worker.engine.wakeup.set()  # an idle engine thread switches now, not at its next request

    def ready(self) -> bool:
        return self._ready_scan is not None and not self._switched

    def switch_when_ready(self):
        """A split model's rank, told to switch by rank 0: wait for its own compile, then take it (or stay
        eager, said on stderr, if it failed here)."""
        self._done.wait()
        if self._ready_scan is None:
            print("dgemma serve: this rank's compiled step is not ready; it stays eager", file=sys.stderr, flush=True)
        self.between_steps()

    def between_steps(self):
        """On the engine thread, between two steps: take the compiled step once it is warm."""
        if self._switched or self._ready_scan is None:
            return
        model = self.worker.model
        release_compiled(model)
        # shapes the warm-up did not compile run eagerly from now on: a compile here would stop every request
        # for seconds to minutes (dynamo recompiles for a new batch size, prefix layout or mask pattern)
        torch.compiler.set_stance("eager_on_recompile")
        self.worker.engine.scan = self._ready_scan
        self._switched = True
        self.worker.between_steps = None
        print(f"dgemma serve: compiled step ready after {self.seconds:.1f} s; switched from the eager one",
              file=sys.stderr, flush=True)


# -- graceful stop -------------------------------------------------------------------------------------

# after the grace, how long the handlers get to write the final error events before the sockets close
FLUSH_SECONDS = 3.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping gracefully: drain, the grace, then the final events' flush."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_seconds: float):
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
