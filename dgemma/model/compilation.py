"""How the denoising step is compiled: the mode by device, torch's on-disk caches, the marker that says a
model's compiled step is already in that cache, and the fallback to eager when compiling fails.

- Mode: on a CPU "max-autotune-no-cudagraphs" (inductor times its kernels against ATen's and keeps the
  faster; `dgemma bench` measures the cold and the warm start: benchmarks/README.md). On CUDA
  "default": no autotuning (at the 26B shape max-autotune benchmarks every matmul shape, minutes per shape
  family) and no CUDA graphs, because the KV cache buffers the step writes into are inputs of the graph
  and inductor skips CUDA graphs for graphs that mutate their inputs. "reduce-overhead" and
  "max-autotune" can be asked for (`--compile-mode`); see docs and `dgemma/commands/_common.py`.
- Caches: inductor's FX graph cache, its autotuning results and dynamo's record of which sizes vary
  (automatic dynamic PGO) all live under TORCHINDUCTOR_CACHE_DIR. Unless the user set it, that is
  `$XDG_CACHE_HOME/dgemma/torchinductor` (~/.cache/...), not torch's /tmp default, so a second start
  reuses the first one's kernels across reboots.
- Warm marker: after a compiled step has run, a file keyed by what changes the compiled code (the model
  config, dtype, quantisation, device type, mode, torch version) is written in that cache directory.
  One-shot commands compile by default only when it exists (`is_warm`).
- Size: on a CPU a model above a billion parameters runs eagerly by default (`compiles_by_default`): its step
  is large matmuls that compiling does not speed up, and compiling it takes longer than many canvases do.
- Background: `compile_model(model, background=True)` makes the calling thread the only one that runs the
  compiled functions until `release_compiled(model)`; every other thread keeps running them eagerly meanwhile. A server
  compiles and warms up the step on a thread of its own while its engine thread answers eagerly, then
  switches between two steps (dgemma/serving/lifecycle.py). Dynamo's frame hook, its fake-tensor mode
  and grad mode are per thread, so the eager thread is not traced.
- Fallback: compiling needs a C++ compiler on a CPU and triton on a GPU. Without them, or when a compile
  raises, the model runs eagerly, after one warning line on stderr.
- Policy (`should_compile`): the command line's --compile / --eager first, then DGEMMA_EAGER, then the
  command's default; `dgemma.commands._common` turns the flags into these arguments.
- What compiling does to a model (`compile_model`): the routed experts become one custom op, the projections
  that read the same input get a fused copy (`FusedLinears`, CPU), and the decoder step and the encoder's
  layers (`decode_canvas`, `encode_tokens`: the network's compile boundaries) are wrapped in `CompiledOrEager`
  and held beside the network as `model.compiled` (`CompiledSteps`), which `encode` and `denoise` call.
  The one dynamo setting the graphs need (`DYNAMO_SETTINGS`) is set for each compiled call and restored
  after it: nothing global is left changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

CPU_MODE = "max-autotune-no-cudagraphs"
# Above this many parameters a CPU runs eagerly unless asked (`--compile`) or the cache is warm: the step is
# big matmuls (the 26B-A4B's: 17 s, nearly all int4 kernels and bf16 matmuls that compiling does not
# change), while its cold compile on 2 cores had not finished after 20 minutes.
CPU_EAGER_ABOVE_PARAMS = 1_000_000_000
CUDA_MODE = "default"


def default_mode(device) -> str:
    return CUDA_MODE if torch.device(device).type == "cuda" else CPU_MODE


# What the user set, read when dgemma.model is imported: inductor writes its /tmp default into the same
# variable the first time anything asks it for its cache folder, after which the two look alike.
_USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def cache_dir() -> Path:
    """Where inductor keeps its caches: TORCHINDUCTOR_CACHE_DIR if the user set it, else the user's cache
    folder."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and (_USER_CACHE_DIR is not None or not _is_torch_default(chosen)):
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dgemma" / "torchinductor"


def _is_torch_default(path: str) -> bool:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(path) == os.path.abspath(default_cache_dir())


def use_disk_cache() -> Path:
    """Point inductor (read at each compile) at `cache_dir()`; returns it."""
    path = cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def unavailable_reason(device) -> str | None:
    """Why torch.compile cannot work here, or None: no C++ compiler for inductor's CPU kernels, no
    triton for its GPU kernels."""
    kind = torch.device(device).type
    if kind == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as e:  # InvalidCxxCompiler, or whatever the search raises on this platform
            return f"no working C++ compiler ({str(e).splitlines()[0]})"
    elif kind == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "triton is not installed (pip install triton)"
    return None


def warm_key(model, mode: str, shape: str | None = None) -> str:
    """What the compiled code depends on, hashed: the model (config, dtype, quantisation, device type), the
    mode, torch's version and the shape the command runs (a label such as "batch 1, length 256": dynamo
    compiles each new shape afresh, so a cache entry for one batch size says nothing of another)."""
    config = dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else repr(model.config)
    tp = getattr(model, "tp", None)  # a rank of a split model compiles its own part
    what = dict(config=config, dtype=str(model.dtype), device=model.device.type, mode=mode,
                quantization=model.quantization, torch=torch.__version__, shape=shape,
                **({"rank": f"{tp.rank}/{tp.ranks}"} if tp is not None else {}))
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _marker(model, mode: str, shape: str | None) -> Path:
    return cache_dir() / "dgemma-warm" / warm_key(model, mode, shape)


def is_warm(model, mode: str | None = None, shape: str | None = None) -> bool:
    """Whether this model's compiled step has run before from this cache at this shape (so compiling it is
    quick)."""
    return _marker(model, mode or default_mode(model.device), shape).is_file()


def mark_warm(model, mode: str, shape: str | None = None):
    path = _marker(model, mode, shape)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"torch": torch.__version__, "dtype": str(model.dtype), "shape": shape,
                                    "device": model.device.type, "mode": mode}) + "\n")
    except OSError:
        pass  # a read-only cache folder costs the next start its warm default, nothing else


def is_big_on_cpu(model) -> bool:
    """A model above CPU_EAGER_ABOVE_PARAMS on a CPU: its step is big matmuls compiling does not speed up."""
    return model.device.type == "cpu" and model.config.param_counts()["total"] > CPU_EAGER_ABOVE_PARAMS


def compiles_by_default(model, mode: str | None = None, shape: str | None = None) -> bool:
    """Whether a command that compiles by default should compile this model: not a model above
    CPU_EAGER_ABOVE_PARAMS on a CPU, unless its compiled step at this shape is already in the cache."""
    return not is_big_on_cpu(model) or is_warm(model, mode, shape)


def resolve_mode(mode: str | None, device) -> str:
    """--compile-mode's value: "auto" (or None) is the device's default."""
    return default_mode(device) if mode in (None, "auto") else mode


@dataclasses.dataclass(frozen=True)
class Choice:
    """The compile policy's answer: whether to compile, and why, in words for the command's start line
    (`str(choice)`: "compiled (...)" or "eager (...)"). True when it compiles."""

    compile: bool
    why: str

    def __bool__(self) -> bool:
        return self.compile

    def __str__(self) -> str:
        return f"{'compiled' if self.compile else 'eager'} ({self.why})"


def _shape_words(shape: str | None) -> str:
    return f"this shape ({shape})" if shape else "this model"


def should_compile(model, *, compile: bool = False, eager: bool = False, by_default: bool | str = False,
                   mode: str | None = None, shape: str | None = None) -> Choice:
    """The compile policy for generation: `eager` / `compile` (the flags) first, then DGEMMA_EAGER, then the
    command's default: True (long-running commands: serve, chat, bench; compiled, but a model above
    CPU_EAGER_ABOVE_PARAMS on a CPU only once its step at `shape` is in the cache), False, or "warm"
    (commands that end: generate, sudoku solve and eval; only when the step at `shape` is in the cache: a
    cold compile, a minute or more, costs more than their eager run, seconds for a solve, and a cache entry
    for another shape does not spare it)."""
    if eager:
        return Choice(False, "--eager")
    if compile:
        return Choice(True, "--compile")
    if os.environ.get("DGEMMA_EAGER", "") not in ("", "0"):
        return Choice(False, "DGEMMA_EAGER is set")
    mode = resolve_mode(mode, model.device)
    warm = is_warm(model, mode, shape)
    if by_default == "warm":
        if warm:
            return Choice(True, f"{_shape_words(shape)} is in the compile cache")
        return Choice(False, f"{_shape_words(shape)} is not in the compile cache, and compiling it would take "
                             f"longer than this run; --compile to compile")
    if by_default and is_big_on_cpu(model) and not warm:
        return Choice(False, f"{model.config.param_counts()['total'] / 1e9:.1f}B parameters on a CPU: its step is "
                             f"big matmuls compiling does not speed up, and the compile takes many minutes; "
                             f"--compile to compile anyway")
    if by_default:
        return Choice(True, f"{_shape_words(shape)} is in the compile cache" if warm else
                      "the default for this command; --eager to skip the compile")
    return Choice(False, "--compile to compile")


# Compiled training pays back its compile only over enough steps. Measured on the sudoku recipe
# (scripts/sudoku-model.json: 6 layers of width 128; batch 64 x 163 tokens; bf16 autocast) on a shared
# 2-core AVX-512 BF16 CPU (benchmarks/README.md, "Training steps"): eager ~2.8 s a step, compiled ~2.1 s,
# and compiling the blocks ~190 s with an empty cache (218 s for the first 10 steps): break-even ~280 steps.
# With this shape's entry in the cache the compile is cheaper, but by how much was lost in the machine's
# load (398 s for the first 10 steps at a load of 7, against 218 s cold at 2-3); taken as half.
TRAIN_BREAK_EVEN_STEPS = {"cold": 280, "warm": 140}
# ... at this much work per step (tokens x width x layers): a compile costs about the same at any size (one
# graph per kind of layer), while what it saves per step grows with the step's elementwise work.
TRAIN_REFERENCE_WORK = 64 * 163 * 128 * 6


def training_break_even(model_config, tokens_per_step: int, warm: bool) -> int:
    """The steps after which compiled training has paid back its compile, estimated from the measured
    recipe (`TRAIN_BREAK_EVEN_STEPS`) scaled by this run's work per step against the recipe's."""
    work = tokens_per_step * model_config.hidden_size * max(model_config.num_layers, 1)
    return max(1, math.ceil(TRAIN_BREAK_EVEN_STEPS["warm" if warm else "cold"] * TRAIN_REFERENCE_WORK / work))


def training_choice(model_config, *, steps: int, tokens_per_step: int, warm: bool) -> Choice:
    """Compile a training run's blocks when its `steps` (those this process runs) pay back the compile:
    `warm` when this run's shape is in the compile cache (`is_warm` with `training_shape`). Not a model
    above CPU_EAGER_ABOVE_PARAMS (its step is big matmuls compiling does not speed up)."""
    total = model_config.param_counts()["total"]
    if total > CPU_EAGER_ABOVE_PARAMS:
        return Choice(False, f"{total / 1e9:.1f}B parameters: its step is big matmuls compiling does not speed up")
    need = training_break_even(model_config, tokens_per_step, warm)
    cache = "this shape is in the compile cache" if warm else "an empty compile cache for this shape"
    if steps >= need:
        return Choice(True, f"{steps} steps pay back the compile: {cache}, worth it from ~{need} steps")
    return Choice(False, f"{steps} steps do not pay back the compile: {cache}, worth it from ~{need} steps; "
                         f"--compile to compile anyway")


def training_shape(*, objective: str, batch: int, length: int, precision: str, lora: bool) -> str:
    """The label of a training step's shape for the warm marker (`warm_key`, mode "training")."""
    return f"training {objective}, batch {batch}, length {length}, {precision}{', LoRA' if lora else ''}"


def warn_eager(reason: str):
    """The one line a user sees when the compiled step is not used."""
    print(f"warning: torch.compile unavailable, running eagerly: {reason}", file=sys.stderr, flush=True)


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
    eagerly meanwhile. A rank of a split model (dgemma.model.parallel) compiles its part with the collectives
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


class FusedLinears:
    """Bias-free Linear layers of one module that read the same input, as one (sum of outs, in) weight: one
    matmul instead of several (on 2 CPU cores at a canvas's 256 rows, q|k|v ~90 us faster per layer than
    three matmuls, gate|up ~30 us). A copy beside the layers' own weights (bench-20m: 6.9 MB more, 17% of
    its weights; the routed experts, most of a large MoE, are not copied), used by compiled graphs on a CPU
    (`compile_model` makes it), and made again by `refresh` whenever a weight changed in
    place (its version counter), was replaced, or its layer is no longer a plain nn.Linear (LoRA,
    quantised): then `weight` is None and the layers run one by one. (Views into one fused tensor would
    save the copy, but safetensors refuses to save weights that share memory.)"""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.weight: torch.Tensor | None = None
        self.splits = ()
        self._stamp = None
        self.refresh()

    def refresh(self):
        """Called eagerly before each compiled call; rebuilds only when a weight changed. The check reads the
        module's own dicts: through nn.Module's attribute lookup and a no_grad context it took ~23 us per
        copy (0.4 ms a bench-20m step for its 17 copies), this way ~3.5 us."""
        layers = [self.owner._modules[name] for name in self.names]
        if not all(type(layer) is nn.Linear and layer._parameters["bias"] is None for layer in layers):
            self.weight, self._stamp = None, None
            return
        weights = [layer._parameters["weight"] for layer in layers]
        stamp = [(w.data_ptr(), w._version, w.dtype) for w in weights]
        if stamp != self._stamp:
            self._rebuild(weights)
            self._stamp = stamp

    @torch.no_grad()
    def _rebuild(self, weights: list[torch.Tensor]):
        fused = torch.cat(weights)
        if self.weight is not None and self.weight.shape == fused.shape and self.weight.dtype == fused.dtype:
            self.weight.copy_(fused)  # the same tensor, so the compiled graph's guards still hold
        else:
            self.weight = fused
        self.splits = tuple(w.shape[0] for w in weights)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.splits, dim=-1)


def fused_inside_graphs(fused: FusedLinears | None) -> bool:
    """Whether to run the one fused matmul: inside a compiled graph, with a fused copy in place."""
    return fused is not None and fused.weight is not None and torch.compiler.is_dynamo_compiling()
