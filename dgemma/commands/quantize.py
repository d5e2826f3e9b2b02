"""`dgemma quantize`: a checkpoint -> the same model saved in int8 or int4, which loads without quantising again.

    dgemma quantize google/diffusiongemma-26B-A4B-it dg-26b-int4 --format int4
    dgemma generate --model dg-26b-int4 --prompt "..."      # loads int4 as stored

Quantising the 26B-A4B while loading costs minutes of CPU at every start (int4 on 2 cores: 12-28 s per
billion weights, against ~2.4 s to read a saved int4 folder; benchmarks/README.md). It is dgemma's format
(codes and fp16 scales, `quantization_config.quant_method` "dgemma"): transformers does not load it.
"""

from __future__ import annotations

from dgemma.commands._common import add_revision_argument
from dgemma.commands.train import size_type


def add_arguments(p):
    p.add_argument("model", help="a model folder or Hugging Face id with unquantised weights")
    p.add_argument("out", help="the folder to write (replaced atomically)")
    add_revision_argument(p)
    p.add_argument("--format", choices=["int8", "int4"], required=True, help="weight format")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="dtype of the tensors kept dense (embedding / LM head, norms, routers) and of the compute "
                        "when loaded (default bf16)")
    p.add_argument("--shard-size", type=size_type, default=2 * 1024**3, metavar="SIZE",
                   help="largest safetensors file, e.g. 5GB (default 2GiB)")


def run(args):
    import torch

    import dgemma
    from dgemma.quant.quantize import loaded_weight_bytes

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # dgemma's layout, not the CPU int4 kernel's: that is what a saved folder holds
    model = dgemma.load_model(args.model, dtype=dtype, quantize=args.format, revision=args.revision,
                              cpu_int4_kernel=False)
    dgemma.save_pretrained(model, args.out, max_shard_bytes=args.shard_size)
    print(f"{args.model} -> {args.out}: {args.format}, {loaded_weight_bytes(model) / 2**20:,.1f} MiB of weights")
    return 0
