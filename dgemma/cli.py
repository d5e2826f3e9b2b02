"""`dgemma` command line: generate | chat | info | train | export | bench | serve | sudoku | convert.

Each subcommand lives in `dgemma/commands/<name>.py` with `add_arguments(parser)` and `run(args)`;
this file only wires them up and turns expected failures into one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from dgemma.commands._common import UsageError
from dgemma.processes import shorten_openmp_spin

COMMANDS = {
    "generate": "generate text with the block-diffusion sampler (or --ar for left-to-right)",
    "chat": "interactive chat in the terminal",
    "info": "summarise a model folder or preset: parameters, active parameters, memory",
    "train": "fine-tune or train from scratch (diffusion objective, LoRA, AR baseline)",
    "export": "turn a training checkpoint into a Hugging Face folder (LoRA merged)",
    "bench": "measure generation speed against transformers and autoregressive decoding",
    "serve": "OpenAI-compatible HTTP server with a playground page",
    "sudoku": "solve and evaluate sudoku puzzles with the shipped model",
    "convert": "convert a Gemma 4 checkpoint into a DiffusionGemma checkpoint",
    "quantize": "save a checkpoint in int8 or int4, to load without quantising again",
}


def _available() -> dict[str, object]:
    mods = {}
    for name in COMMANDS:
        try:
            mods[name] = importlib.import_module(f"dgemma.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dgemma.commands.{name}":
                raise
    return mods


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (exit code 2), not usage plus error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dgemma", description="DiffusionGemma in plain PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name, module in _available().items():
        p = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def expected_errors() -> tuple[type[BaseException], ...]:
    from dgemma.config import ConfigError
    from dgemma.devices import DeviceError
    from dgemma.parallel.plan import SplitError
    from dgemma.tokenizer import TokenizerError
    from dgemma.training.state import CheckpointWriteError
    from dgemma.weights.checkpoint import CheckpointError

    return (UsageError, ConfigError, DeviceError, CheckpointError, SplitError, TokenizerError, FileNotFoundError,
            IsADirectoryError, PermissionError, CheckpointWriteError)


# Commands that generate: they free and reallocate (B, L, V)-sized buffers at every denoising step.
GENERATING = {"generate", "chat", "serve", "bench", "sudoku"}


def keep_freed_memory() -> bool:
    """glibc keeps freed memory for reuse (see dgemma.engine.allocator); imported only when a generating
    command runs, so that `dgemma --help` and the other commands start without loading torch."""
    from dgemma.engine import allocator

    return allocator.keep_freed_memory()


def bound_kernel_caches():
    """Bound the CPU kernel libraries' per-shape caches (dgemma.engine.allocator): not for `bench`, whose
    timings are taken with the libraries' defaults."""
    from dgemma.engine import allocator

    allocator.bound_kernel_caches()


def openvino_may_run(args) -> bool:
    """Whether this command may hand int4 weights to OpenVINO's CPU kernels (dgemma.quant.openvino), as far as its
    flags tell before torch is imported: int4 weights (--quantize int4, or a local model folder saved in int4),
    OpenVINO installed, DGEMMA_CPU_KERNELS not "torch", --cpu-int8-compute not off, --device not a GPU. Then the
    CLI shortens torch's OpenMP spin (dgemma.processes.shorten_openmp_spin), which would slow the library's
    graphs; elsewhere torch's threads keep libgomp's default."""
    if os.environ.get("DGEMMA_CPU_KERNELS", "auto") == "torch" or getattr(args, "cpu_int8_compute", "auto") == "off" \
            or str(getattr(args, "device", "auto")).startswith("cuda") or importlib.util.find_spec("openvino") is None:
        return False
    if getattr(args, "quantize", None) == "int4":
        return True
    model = getattr(args, "model", None)
    if not model:
        return False
    try:
        stored = json.loads((Path(model) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(stored, dict) and stored.get("format") == "int4"


def _resolve_model_names(args):
    """`--model` (and convert's SRC_DIR) may name a Hugging Face id: commands only ever see a local folder."""
    from dgemma.weights.hub import resolve_model

    for attr in ("model", "src"):
        name = getattr(args, attr, None)
        if name:
            setattr(args, attr, str(resolve_model(name, getattr(args, "revision", None))))
            setattr(args, f"{attr}_name", name)  # what the user typed: the id names a served model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # as typed: what ranks and replicas run again
    if args.command in GENERATING and openvino_may_run(args):
        shorten_openmp_spin()  # before anything imports torch (libgomp reads it once)
    if args.command in GENERATING and getattr(args, "keep_freed_memory", True):
        keep_freed_memory()
    if args.command in GENERATING - {"bench"}:
        bound_kernel_caches()
    try:
        _resolve_model_names(args)
        if _tp().wanted(args):
            code = _tp().launch_or_join(args, args.argv)
            if code is not None:
                return code
        return args._run(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except expected_errors() as e:
        print(f"dgemma {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if getattr(args, "tp", None) is None:
            raise
        # a split model's rank whose collectives failed: another rank died or hangs
        from dgemma.parallel.group import describe_failure

        print(f"dgemma {args.command}: rank {args.tp.rank}: {describe_failure(e)}", file=sys.__stderr__)
        return 1


def _tp():
    from dgemma.commands import _tensor_parallel

    return _tensor_parallel


if __name__ == "__main__":
    sys.exit(main())
