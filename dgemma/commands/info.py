"""`dgemma info`: parameters, active parameters and a memory model for a model folder or preset.

    dgemma info --preset diffusiongemma-26b-a4b                       # generation: weights + KV cache
    dgemma info --preset diffusiongemma-26b-a4b --train --lora --world-size 8 --batch 1 --seq 2048
"""

from __future__ import annotations

import json

from dgemma.commands._common import UsageError, add_revision_argument
from dgemma.config import ModelConfig, get_preset


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face format model folder or a Hugging Face id (org/name)")
    add_revision_argument(p)
    src.add_argument("--preset", help="a named config, e.g. diffusiongemma-26b-a4b, tiny, bench-20m")
    p.add_argument("--quantize", choices=["bf16", "int8", "int4"], default=None,
                   help="weight format for the memory model (default: the format a folder stores, else bf16)")
    p.add_argument("--batch", type=int, default=1, help="batch size for the memory model (default 1)")
    p.add_argument("--context", type=int, default=8192, help="tokens of context per request (default 8192)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="print the per-rank weight plan of the model split over N ranks (as --tensor-parallel N "
                        "on generate, chat, serve and bench)")
    t = p.add_argument_group("training plan (--train): bytes per process under FSDP2")
    t.add_argument("--train", action="store_true", help="print the per-process training memory plan")
    t.add_argument("--world-size", type=int, default=1, help="processes the model is sharded over (default 1)")
    t.add_argument("--seq", type=int, default=2048, help="longest [prompt ; response] in tokens (default 2048)")
    t.add_argument("--lora", action="store_true", help="LoRA: only adapters learn")
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--lora-targets", help="as for `dgemma train` (default: attention and the dense MLP)")
    t.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="as for `dgemma train`: bf16 = autocast (a LoRA base is then held in bf16, as under --mixed-precision)")
    t.add_argument("--mixed-precision", choices=["bf16"], help="as for `dgemma train`: FSDP2 bf16 compute")
    t.add_argument("--activation-checkpointing", action="store_true")


def summary(config: ModelConfig) -> dict:
    from dgemma.engine.memory import WEIGHT_FORMATS, planned_weight_bytes

    counts = config.param_counts()
    return {
        "total_params": counts["total"],
        "active_params": counts["active"],
        "vision_params": counts.get("vision", 0),
        "weight_bytes": {fmt: planned_weight_bytes(config, fmt) for fmt in WEIGHT_FORMATS},
        "params_by_group": {k: v for k, v in counts.items() if k not in ("total", "active", "vision")},
    }


def _checkpoint_summary(stored: dict, plan) -> dict:
    files = {t.file for t in stored.values()}
    skipped = plan.skipped()
    return {"tensors": len(stored), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "read": sum(d == "read" for d in plan.report.values()), "skipped": sum(map(len, skipped.values())),
            "skipped_by_reason": skipped}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def training_plan(config: ModelConfig, args) -> dict:
    from dgemma.training.config import DEFAULT_TARGETS
    from dgemma.training.memory import memory_plan

    if args.world_size < 1 or args.seq < 1:
        raise UsageError("--world-size and --seq must be >= 1")
    targets = (DEFAULT_TARGETS if args.lora_targets is None
               else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    lora = dict(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=targets) if args.lora else None
    return memory_plan(config, world_size=args.world_size, micro_batch=args.batch, seq=args.seq, lora=lora,
                       lora_base_bf16=args.lora and "bf16" in (args.precision, args.mixed_precision),
                       compute_bf16=args.precision == "bf16" or args.mixed_precision == "bf16",
                       activation_checkpointing=args.activation_checkpointing)


def print_training_plan(plan: dict):
    from dgemma.training.memory import TERMS

    kind = "LoRA" if plan["lora"] else "full fine-tune"
    print(f"training plan    {kind}: {plan['trainable_params']:,} of {plan['total_params']:,} parameters learn; "
          f"{plan['world_size']} process(es), micro-batch {plan['micro_batch']} x {plan['seq']} tokens, "
          f"{plan['compute_dtype']} compute{', activation checkpointing' if plan['activation_checkpointing'] else ''}")
    notes = {"parameters": "sharded; fp32 master weights (a bf16 LoRA base: 2 B)",
             "gradients": "fp32, sharded, weights that learn",
             "optimizer": "AdamW: two fp32 moments, sharded",
             "gathered": "FSDP: root + 2 blocks unsharded, + one block's fp32 gradients",
             "activations": "estimate: saved for the backward, + fp32 logits"}
    for term in TERMS:
        print(f"  {term:<14} {_gb(plan[term]):>12}  {notes[term]}")
    print(f"  {'total':<14} {_gb(plan['total']):>12}  per process")


def run(args):
    from dgemma.engine.memory import generation_memory, kv_cache, weight_arithmetic

    if args.batch < 1 or args.context < 1:
        raise UsageError("--batch and --context must be >= 1")
    checked = None
    if args.model:
        from pathlib import Path

        from dgemma.weights.checkpoint import inspect_checkpoint

        # every shard's header against the index and the file sizes, every key's fate; no weight is read
        config, stored, plan, stored_format = inspect_checkpoint(Path(args.model))
        checked = _checkpoint_summary(stored, plan)
        name = args.model
        args.quantize = args.quantize or stored_format or "bf16"
    else:
        config = get_preset(args.preset)
        name = args.preset
        args.quantize = args.quantize or "bf16"
    info = summary(config)
    mem = generation_memory(config, args.quantize, args.batch, args.context)
    c = config
    print(f"model            {name}")
    print(f"layers           {c.num_layers} ({c.layer_types.count('sliding_attention')} sliding window {c.sliding_window}, "
          f"{c.layer_types.count('full_attention')} full)")
    print(f"hidden / vocab   {c.hidden_size} / {c.vocab_size:,}")
    print(f"attention        {c.num_heads} q heads; sliding {c.num_kv_heads} kv x {c.head_dim}; "
          f"full {c.num_global_kv_heads} kv x {c.global_head_dim} (K = V)")
    print(f"experts          {c.num_experts} x {c.moe_intermediate_size}, top-{c.top_k_experts}, "
          f"in parallel with a dense MLP of {c.intermediate_size}")
    print(f"canvas           {c.canvas_length} tokens")
    if checked:
        print(f"checkpoint       {checked['tensors']} tensors in {checked['files']} file(s), "
              f"{_gb(checked['bytes'])}; headers match the index and the file sizes; "
              f"{checked['read']} read, {checked['skipped']} skipped")
        for reason, keys in checked["skipped_by_reason"].items():
            print(f"  skipped {len(keys):>5}  {reason} ({keys[0]}{', ...' if len(keys) > 1 else ''})")
    print(f"parameters       {info['total_params']:,} total, {info['active_params']:,} active per token "
          "(tied embedding counted once)")
    for group, n in info["params_by_group"].items():
        print(f"  {group:<15}{n:>16,}")
    if c.vision is not None:
        v = c.vision
        print(f"vision tower     {info['vision_params']:,} parameters apart from the above (kept bf16 when "
              f"quantised): {v.num_layers} layers of {v.hidden_size}, {v.patch_size}-pixel patches pooled "
              f"{v.pooling_kernel_size}x{v.pooling_kernel_size} into soft tokens")
    for fmt, n in info["weight_bytes"].items():
        print(f"weights {fmt:<8} {_gb(n)}")
    cache = kv_cache(config, 1, args.context)  # its layout: what a sliding layer's ring holds
    print(f"memory model     {args.quantize} weights, batch {args.batch}, context {args.context}:")
    print(f"  weights        {_gb(mem['weight_bytes'])}  = {weight_arithmetic(config, args.quantize)}")
    print(f"  KV cache       {_gb(mem['kv_cache_bytes'])}  ({mem['kv_bytes_per_token_bf16']:,} B/token bf16, "
          f"sliding layers hold {cache.capacity[True]} tokens, plus {cache.canvas_slots} canvas slots per layer)")
    print(f"  sampler buffer {_gb(mem['sampler_buffer_bytes'])}  (one fp32 batch x {c.canvas_length} x {c.vocab_size:,})")
    print(f"  total          {_gb(mem['total_bytes'])}")
    split = tensor_parallel_plan(config, args) if args.tensor_parallel else None
    plan = None
    if args.train:
        plan = training_plan(config, args)
        print_training_plan(plan)
    checkpoint = {k: v for k, v in checked.items() if k != "skipped_by_reason"} if checked else None
    print(json.dumps({**{k: info[k] for k in ("total_params", "active_params", "vision_params", "weight_bytes")},
                      "memory": mem,
                      **({"checkpoint": checkpoint} if checkpoint else {}),
                      **({"tensor_parallel": split} if split else {}),
                      **({"training_plan": plan} if plan else {})}))
    return 0


def tensor_parallel_plan(config: ModelConfig, args) -> dict:
    """The split over --tensor-parallel ranks (checked as loading checks it) and the weights each rank holds."""
    from dgemma.parallel.plan import SplitError, check_split, plan_bytes

    try:
        check_split(config, args.tensor_parallel, args.quantize if args.quantize != "bf16" else None)
    except SplitError as e:
        raise UsageError(str(e)) from None
    per_rank = plan_bytes(config, args.tensor_parallel)
    print(f"tensor parallel  {args.tensor_parallel} ranks; weights per rank: "
          + ", ".join(f"{fmt} {_gb(n)}" for fmt, n in per_rank.items()))
    return {"ranks": args.tensor_parallel, "weight_bytes_per_rank": per_rank}
