"""`dgemma convert gemma4 SRC OUT`: a Gemma 4 checkpoint -> a DiffusionGemma checkpoint (docs/convert-gemma4.md)."""

from __future__ import annotations

import sys

from dgemma.commands._common import UsageError, add_revision_argument

DTYPE_CHOICES = ("keep", "bfloat16", "float16", "float32")


def add_arguments(p):
    formats = p.add_subparsers(dest="source_format", metavar="FORMAT", required=True)
    g = formats.add_parser(
        "gemma4",
        help="a Gemma 4 MoE text checkpoint (Gemma4ForCausalLM / Gemma4ForConditionalGeneration, safetensors)",
        description="Convert a Gemma 4 MoE checkpoint (e.g. a gemma-4-26B-A4B fine-tune) into a DiffusionGemma "
        "checkpoint: backbone weights mapped, a fresh self-conditioning block that starts as an exact no-op, "
        "tokenizer files copied. Everything is checked before anything is written.",
    )
    g.add_argument("src", metavar="SRC_DIR", help="Gemma 4 folder in the Hugging Face format, or a Hugging Face id")
    add_revision_argument(g)
    g.add_argument("out", metavar="OUT_DIR", help="where to write the DiffusionGemma checkpoint")
    g.add_argument("--drop", default="", metavar="PARTS",
                   help="comma-separated parts to leave out instead of refusing: per-layer-embeddings, "
                        "kv-sharing, audio, vision (vision is kept by default: DiffusionGemma has a vision tower)")
    g.add_argument("--canvas-length", type=int, default=256, help="tokens per denoising canvas (default 256)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="keep",
                   help="weight dtype to write (default: keep the source's)")
    g.add_argument("--max-shard-size", default="5GB", help="largest output safetensors file (default 5GB)")
    g.add_argument("--seed", type=int, default=0, help="seed of the self-conditioning gate/up init (default 0)")
    g.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    g.add_argument("--dry-run", action="store_true", help="run every check and print the plan; write nothing")


def run(args):
    from dgemma.weights.convert import (
        OUT_DTYPES,
        check_output,
        convert_gemma4,
        describe,
        parse_drop,
        parse_size,
        plan_conversion,
    )

    try:
        drop = parse_drop(args.drop)
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.canvas_length < 1:
        raise UsageError(f"--canvas-length must be >= 1, got {args.canvas_length}")
    dtype = None if args.dtype == "keep" else OUT_DTYPES[args.dtype]
    options = dict(drop=drop, canvas_length=args.canvas_length, dtype=dtype, seed=args.seed)
    if args.dry_run:
        plan = plan_conversion(args.src, **options)
        check_output(plan, args.out, overwrite=args.overwrite)
        print("\n".join(describe(plan)))
        print(f"dry run: nothing written (would write {args.out})")
        return 0
    plan = convert_gemma4(
        args.src, args.out, **options, max_shard_bytes=max_shard_bytes, overwrite=args.overwrite,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print("\n".join(describe(plan)))
    print(f"written          {args.out}")
    return 0
