"""`dgemma export`: a training checkpoint -> a Hugging Face folder (LoRA merged) for dgemma and transformers.

    dgemma export runs/ft --out exported/               # the run's newest checkpoint
    dgemma export runs/ft --step 400 --out exported/    # a given step

One process, streamed shard by shard from the checkpoint's DCP files (no full copy in memory).
"""

from __future__ import annotations

from dgemma.commands._common import positive_int
from dgemma.commands.train import size_type


def add_arguments(p):
    p.add_argument("run", help="a training run folder (holds checkpoints/step-*)")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write (replaced atomically)")
    p.add_argument("--step", type=positive_int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--shard-size", type=size_type, default=2 * 1024**3, metavar="SIZE",
                   help="largest safetensors file, e.g. 5GB (default 2GiB)")


def run(args):
    from pathlib import Path

    from dgemma.training.export import export_checkpoint, find_checkpoint

    checkpoint = find_checkpoint(Path(args.run), args.step)
    out = export_checkpoint(checkpoint, Path(args.out), max_shard_bytes=args.shard_size)
    print(f"exported {checkpoint} -> {out}")
    return 0
