"""The compiled denoising step: `compile_model` and the compiled functions a model holds (`CompiledSteps`).

- What compiling does to a model (`compile_model`): the routed experts become one custom op, the projections
  that read the same input get a fused copy (`dgemma.model.layers.FusedLinears`, CPU), and the decoder step
  and the encoder's layers (`decode_canvas`, `encode_tokens`: the network's compile boundaries) are wrapped
  in `CompiledOrEager` and held beside the network as `model.compiled` (`CompiledSteps`), which `encode` and
  `denoise` call. The one dynamo setting the graphs need (`DYNAMO_SETTINGS`) is set for each compiled call
  and restored after it: nothing global is left changed. Mode and caches: `dgemma.compilation.policy`.
- Background: `compile_model(model, background=True)` makes the calling thread the only one that runs the
  compiled functions until `release_compiled(model)`; every other thread keeps running them eagerly meanwhile. A server
  compiles and warms up the step on a thread of its own while its engine thread answers eagerly, then
  switches between two steps (dgemma/serving/lifecycle.py). Dynamo's frame hook, its fake-tensor mode
  and grad mode are per thread, so the eager thread is not traced.
- Fallback: compiling needs a C++ compiler on a CPU and triton on a GPU. Without them, or when a compile
  raises, the model runs eagerly, after one warning line on stderr.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from dgemma.compilation.policy import default_mode, mark_warm, unavailable_reason, use_disk_cache, warn_eager
from dgemma.model.layers import FusedLinears


class CompileState:
    """Shared by one model's compiled functions: once one fails to compile, all run eagerly."""

    def __init__(self, model, mode: str, shape: str | None = None):
        self.model, self.mode, self.shape = model, mode, shape
        self.failed = False
        self.marked = False
        # while set: the one thread that runs the compiled functions (a background compile); others run eagerly
        self.owner: threading.Thread | None = None

    def runs_compiled(self) -> bool:
        """Whether a call on the current thread takes the compiled function."""
        return not self.failed and (self.owner is None or self.owner is threading.current_thread())

    def fail(self, error: BaseException):
        if not self.failed:
            self.failed = True
            first = (str(error).strip().splitlines() or [""])[0][:200]
            warn_eager(f"compiling failed ({type(error).__name__}: {first})")

    def succeeded(self):
        """Mark the cache warm for this model and shape, once (not after a compile failed)."""
        if not self.marked and not self.failed:
            self.marked = True
            mark_warm(self.model, self.mode, self.shape)


# The experts' grid capacity is read from a tensor inside the graph (an unbacked size); without this
# dynamo would break the graph at every layer there. Set only while a compiled function runs (tracing
# happens inside that call), so other torch.compile users in the process see their own settings.
DYNAMO_SETTINGS = {"capture_scalar_outputs": True}


@contextlib.contextmanager
def dynamo_settings():
    """`DYNAMO_SETTINGS` for the duration of one call, then the caller's values again. Set by hand rather
    than through `torch._dynamo.config.patch`, which costs ~60 us a call against ~12 us (2 CPU cores)."""
    config = torch._dynamo.config
    saved = {name: getattr(config, name) for name in DYNAMO_SETTINGS}
    for name, value in DYNAMO_SETTINGS.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


class CompiledOrEager:
    """`fn` compiled (lazily, by torch.compile at the first call), or `fn` itself once compiling failed.

    A call that raises is run again eagerly: if the eager call succeeds, the failure was the compiler's
    (warned once, and every function of the model runs eagerly from then on); if it raises too, the
    error is the caller's and is raised as eager code raises it. (The decoder step only overwrites the
    canvas's cache slots and the encoder's layers write nothing, so running either again is harmless.)
    """

    def __init__(self, fn, state: CompileState, *, mark: bool = False, **compile_kwargs):
        self.eager, self.state, self.mark = fn, state, mark
        self.compiled = torch.compile(fn, **compile_kwargs)

    def __call__(self, *args, **kwargs):
        if not self.state.runs_compiled():
            return self.eager(*args, **kwargs)
        try:
            with dynamo_settings():
                out = self.compiled(*args, **kwargs)
        except Exception as error:
            out = self.eager(*args, **kwargs)  # raises, if the input is at fault
            self.state.fail(error)
            return out
        if self.mark:
            self.state.succeeded()
        return out


def compile_model(model, mode: str | None = None, cpp_wrapper: bool | None = None, *, background: bool = False,
                  shape: str | None = None):
    """torch.compile (inductor) the model's `decode_canvas`, and its encoder's layers (`encode_tokens`) for
    passes without gradients: prompts, committed canvases and autoregressive tokens. Returns the model, which
    holds them as `model.compiled` (`CompiledSteps`) and runs them from its `encode` and `denoise`.

    Every denoising step of a canvas has the same shapes, so it compiles once per (batch, prefix) shape
    (then once with dynamic shapes). On CPU the routed experts' grid is traced into the graph
    (`Experts._traced_grid`); elsewhere, and for quantised experts, they stay one opaque op.

    `mode` defaults by device (`default_mode`): on a CPU "max-autotune-no-cudagraphs", which lets inductor
    time its own kernels against ATen's and keep the faster (its choices follow timings, so they can vary
    between runs on a noisy machine: benchmarks/README.md); on CUDA "default" (no autotuning, no CUDA graphs:
    the step writes into the KV cache, its input). On a CPU the projections that read the same input run as
    one matmul in the compiled graphs (q|k|v, gate|up: `FusedLinears`, a fused copy of those weights, kept in
    step with them before each call). `cpp_wrapper` (default: on CPU) has inductor write the code that calls
    the step's ~200 kernels and allocates their buffers in C++ instead of Python: less interpreter time per
    step, against a slower first compile. Compiled code goes to torch's on-disk caches, so a second start is
    quick. Where compiling is unavailable (no C++ compiler, no triton) or fails, the model runs eagerly after
    one warning line; `is_compiled` then says False. No torch setting is left changed: the one dynamo setting
    the graphs need is set only while a compiled call runs (`dynamo_settings`). `background`: only the
    calling thread runs the compiled functions (it warms them up) until `release_compiled`; other threads run
    eagerly meanwhile. A rank of a split model (dgemma.parallel) compiles its part with the collectives
    in the graph; every rank must compile alike and run its compiled calls when the others do.
    `shape`: the label of the shape the caller runs (`warm_key`), which the warm marker records once a
    compiled step ran.
    """
    if model.compiled is not None:  # compiled already (or failed to: then it stays eager)
        return model
    mode = mode or default_mode(model.device)
    reason = unavailable_reason(model.device)
    if reason is not None:
        warn_eager(reason)
        return model
    use_disk_cache()
    options = dict(torch._inductor.list_mode_options(mode))
    # not on a split model: inductor's C++ wrapper cannot call its collectives yet (torch 2.13: "arg type Any is
    # not yet supported by custom_op_wrapper")
    split = getattr(model, "tp", None) is not None
    options["cpp_wrapper"] = model.device.type == "cpu" and not split if cpp_wrapper is None else cpp_wrapper
    model.compiled = CompiledSteps(model, mode, options, background, shape)
    return model


def is_compiled(model) -> bool:
    """Whether the model's decoder step runs compiled: `compile_model` ran and compiling has not failed (it
    compiles the decoder and the encoder's layers together)."""
    return model.compiled is not None and not model.compiled.state.failed


def release_compiled(model):
    """After `compile_model(background=True)`: every thread runs the compiled functions from now on."""
    if model.compiled is not None:
        model.compiled.state.owner = None


def compiled_function(model, fn, *, mark: bool = False, **compile_kwargs):
    """`fn` compiled with the model's options, falling back to eager with its other compiled functions (the
    engine compiles its sampler scan with this); `fn` itself when the model runs eagerly."""
    if not is_compiled(model):
        return fn
    return model.compiled.function(fn, mark=mark, **compile_kwargs)


class CompiledSteps:
    """A model's compiled functions, made by `compile_model` and held as `model.compiled`: `decode_canvas`
    and `encode_tokens` (the network's compile boundaries, functions of tensors alone) wrapped in
    `CompiledOrEager`, sharing one `CompileState` and the inductor options, and the fused projection copies
    their graphs read (`FusedLinears`, on a CPU), brought up to date before each call."""

    def __init__(self, model, mode: str, options: dict, background: bool, shape: str | None = None):
        for module in model.modules():
            prepare = getattr(module, "prepare_for_compile", None)  # the routed experts: one custom op
            if prepare is not None:
                prepare()
        self.fused: list[FusedLinears] = []
        if model.device.type == "cpu":  # projections that read the same input as one matmul (FusedLinears)
            for block in model.layers:
                attn = block.self_attn
                attn.fused_qkv = FusedLinears(attn, ("q_proj", "k_proj") + (("v_proj",) if attn.sliding else ()))
                self.fused.append(attn.fused_qkv)
            for mlp in [block.mlp for block in model.layers] + [model.self_conditioning]:
                mlp.fused_gate_up = FusedLinears(mlp, ("gate_proj", "up_proj"))
                self.fused.append(mlp.fused_gate_up)
        self.state = CompileState(model, mode, shape)
        if background:  # only this thread runs the compiled functions until `release_compiled`
            self.state.owner = threading.current_thread()
        self.options = options
        # a rank of a split model: calls that compile wait longer for the other ranks (parallel.py)
        tp = getattr(model, "tp", None)
        self.around_call = tp.compiled_call if tp is not None else contextlib.nullcontext
        # not fullgraph: past dynamo's recompile limit a call runs eagerly instead of failing
        self._decoder = self.function(model.decode_canvas, mark=True)
        self._encoder = self.function(model.encode_tokens)

    def function(self, fn, *, mark: bool = False, **compile_kwargs) -> CompiledOrEager:
        return CompiledOrEager(fn, self.state, mark=mark, **{"options": self.options, **compile_kwargs})

    def refresh_fused(self):
        """Bring the fused projection weights up to date with the layers' own, before a compiled call: a few
        attribute reads per layer when nothing changed."""
        for fused in self.fused:
            fused.refresh()

    def decode_canvas(self, *args):
        """`DiffusionGemma.decode_canvas`, compiled."""
        self.refresh_fused()
        with self.around_call():
            return self._decoder(*args)

    def encode_tokens(self, *args):
        """`DiffusionGemma.encode_tokens`, compiled."""
        self.refresh_fused()
        with self.around_call():
            return self._encoder(*args)
