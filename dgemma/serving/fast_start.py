"""Serve at once, compile meanwhile: the server answers with the eager step from its first second while the
compiled step is built and warmed up on a thread of its own, then the engine thread switches to it between
two steps.

  listening ──► eager steps ──────────────────────────────────────┬──► compiled steps
  thread "dgemma-compile": compile_model(model, background=True)  │
                           warm-up engine (its own cache) ────────┘ ready: release_compiled(model), the
                                                                    engine's sampler scan becomes the warmed one

The compiled functions run only on the compile thread until released (`dgemma.model.compilation`), and after
the switch dynamo's stance is "eager_on_recompile": a call whose shapes the warm-up did not compile runs
eagerly instead of compiling, so the engine thread never traces or waits for a compile (the warm-up runs
requests shaped as served ones to cover most). The warm-up engine has the serving
engine's batch size and length, so its cache has the same shapes and the graphs it leaves fit the serving
engine's calls (dynamo marks batch and prefix length dynamic after the warm-up's two of each). Its cache
is freed after the switch. The sampler's compiled scan is handed over as it is: a new torch.compile wrapper
would compile again. When compiling fails the model stays eager (one warning line), as before.

`/health` says which step runs: "compiling" (eager meanwhile), "compiled", or "eager" (no compile: --eager,
a large model on a CPU, or a compile that failed).
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from dgemma.config import SamplingConfig
from dgemma.engine import Engine
from dgemma.model.compilation import compile_model, is_compiled, release_compiled


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
        try:
            compile_model(model, self.mode, background=True)
            if is_compiled(model):
                warm = Engine(model, max_batch=self.worker.max_batch, max_length=self.worker.max_length)
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
