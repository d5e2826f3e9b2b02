"""Whether and how the denoising step is compiled: the mode by device, torch's on-disk caches, the marker
that says a model's compiled step is already in that cache, and the policy each command follows.

- Mode: on a CPU "max-autotune-no-cudagraphs" (inductor times its kernels against ATen's and keeps the
  faster; `dgemma bench` measures the cold and the warm start: benchmarks/README.md). On CUDA
  "default": no autotuning (at the 26B shape max-autotune benchmarks every matmul shape, minutes per shape
  family) and no CUDA graphs, because the KV cache buffers the step writes into are inputs of the graph
  and inductor skips CUDA graphs for graphs that mutate their inputs. "reduce-overhead" and
  "max-autotune" can be asked for (`--compile-mode`).
- Caches: inductor's FX graph cache, its autotuning results and dynamo's record of which sizes vary
  (automatic dynamic PGO) all live under TORCHINDUCTOR_CACHE_DIR. Unless the user set it, that is
  `$XDG_CACHE_HOME/dgemma/torchinductor` (~/.cache/...), not torch's /tmp default, so a second start
  reuses the first one's kernels across reboots.
- Warm marker: after a compiled step has run, a file keyed by what changes the compiled code (the model
  config, dtype, quantisation, device type, mode, torch version, shape) is written in that cache
  directory. One-shot commands compile by default only when it exists (`is_warm`).
- Size: on a CPU a model above a billion parameters runs eagerly by default (`compiles_by_default`): its step
  is large matmuls that compiling does not speed up, and compiling it takes longer than many canvases do.
- Policy (`should_compile`, `training_choice`): the command line's --compile / --eager first, then
  DGEMMA_EAGER, then the command's default; the answer (`Choice`) says why in the command's start line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch

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


# Compiled training pays back its compile only over enough steps: the break-even measured on the sudoku
# recipe (scripts/sudoku-model.json) with an empty compile cache and with this shape in it, on 2 CPU cores
# (benchmarks/README.md, "Training steps", "Compiling where it pays"; the warm figure is an estimate there).
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


def engine_shape(max_batch: int, max_length: int) -> str:
    """The label of an engine's shape for the warm marker (`warm_key`)."""
    return f"batch {max_batch}, length {max_length}"


def training_shape(*, objective: str, batch: int, length: int, precision: str, lora: bool) -> str:
    """The label of a training step's shape for the warm marker (`warm_key`, mode "training")."""
    return f"training {objective}, batch {batch}, length {length}, {precision}{', LoRA' if lora else ''}"


def warn_eager(reason: str):
    """The one line a user sees when the compiled step is not used."""
    print(f"warning: torch.compile unavailable, running eagerly: {reason}", file=sys.stderr, flush=True)
