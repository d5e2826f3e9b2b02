"""`dgemma train`: fine-tune a checkpoint or train from scratch (diffusion objective or AR baseline, LoRA).

    dgemma train --model DIR --data train.jsonl --out runs/ft --lora --steps 2000
    dgemma train --init preset:tiny --vocab-size 16 --set canvas_length=81 --data sudoku.jsonl --out runs/s
    dgemma train ... --resume                       # continue the run in --out after a kill
    torchrun --nproc-per-node 2 -m dgemma train ... # FSDP2 over 2 processes (gloo on CPU, NCCL on GPU)
    dgemma train ... --memory-per-rank 80GB          # refuse, before loading weights, a run that cannot fit
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from dgemma.commands._common import add_revision_argument
from dgemma.training.config import GROUPS, TrainConfig, byte_size


def add_arguments(p):
    """One flag per TrainConfig field (its metadata: help, group, spelling; its type and default), plus the
    model overrides (--set, --vocab-size) that fill TrainConfig.model_overrides."""
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    exclusive = {}  # one_of name -> a required mutually exclusive group
    types = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if "group" not in f.metadata:
            continue
        cli = {k: v for k, v in f.metadata.items() if k not in ("help", "group", "flag", "one_of", "type")}
        group = groups[f.metadata["group"]]
        if "one_of" in f.metadata:
            if f.metadata["one_of"] not in exclusive:
                exclusive[f.metadata["one_of"]] = group.add_mutually_exclusive_group(required=True)
            group = exclusive[f.metadata["one_of"]]
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        group.add_argument(flag, dest=f.name, help=_help(f), **_parsing(f, types[f.name]), **cli)
    add_revision_argument(groups["model"])
    groups["model"].add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                                 help="override a model field with --init (repeatable), e.g. --set hidden_size=128")
    groups["model"].add_argument("--vocab-size", type=int, help="with --init: vocabulary size (pre-tokenised data)")


def _parsing(f: dataclasses.Field, annotation) -> dict:
    """How argparse reads a field: a switch for a bool, else its default and a parser for its text (the
    metadata's, or the type the field holds)."""
    if annotation is bool:
        return {"action": "store_false" if f.default else "store_true"}
    default = None if f.default is dataclasses.MISSING else f.default
    if "type" in f.metadata:
        return {"default": default, "type": _reported(f.metadata["type"])}
    kind = next((t for t in typing.get_args(annotation) if t is not type(None)), annotation)  # X | None -> X
    if typing.get_origin(kind) is tuple:
        kind = typing.get_args(kind)[0]  # betas: nargs=2 in the metadata
    if kind not in (int, float, str):
        raise TypeError(f"TrainConfig.{f.name}: no command-line type for {kind}; give one in its metadata")
    return {"default": default, "type": kind}


def _reported(parse):
    """A parser whose ValueError becomes argparse's one-line error with the parser's own message."""
    def parse_or_report(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_or_report


def _help(f: dataclasses.Field) -> str:
    """The field's help with its default, as `dgemma train --help` shows it."""
    default = f.default
    if default is dataclasses.MISSING or default is None or isinstance(default, bool):
        return f.metadata["help"]
    if isinstance(default, tuple):  # lora_targets as typed (comma-separated), betas as two numbers
        shown = ",".join(default) if all(isinstance(v, str) for v in default) else " ".join(map(str, default))
    else:
        shown = default
    return f"{f.metadata['help']} (default {shown})"


size_type = _reported(byte_size)  # "80GB" -> bytes: the --shard-size of `dgemma export` and `dgemma quantize`


def config_from_args(args) -> TrainConfig:
    from dgemma.training.model_setup import parse_override

    overrides = dict(parse_override(o) for o in args.overrides)
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if "group" in f.metadata}
    return TrainConfig(**{**fields, "betas": tuple(args.betas)}, model_overrides=overrides)


def run(args):
    from dgemma.training.loop import train

    result = train(config_from_args(args))
    if result.metrics:
        print(f"final loss {result.final_loss:.4f} after {result.steps} steps "
              f"({result.steps_per_s:.2f} steps/s); model: {result.model_dir}")
    return 0
