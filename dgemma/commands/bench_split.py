"""`dgemma bench --tensor-parallel N`: the engine on a model split over N ranks (1: one process, the same
code), tokens/s by batch size, and every rank's memory after loading against the plan
(`dgemma.parallel.plan.plan_bytes`). Run it with N = 1 and N = 2 to compare; only rank 0 prints.
"""

from __future__ import annotations

import json
import sys
import time

from dgemma.processes import resident_memory


def _load(args, device, dtype):
    """The model (this rank's part of it): a folder's slices, or random weights made as the slices."""
    import dgemma
    from dgemma.weights.random_weights import random_model

    tp = getattr(args, "tp", None)
    if tp is None:
        if args.model:
            return dgemma.load_model(args.model, device=device, dtype=dtype, quantize=args.quantize)
        return random_model(dgemma.get_preset(args.config), device=device, dtype=dtype, quantize=args.quantize,
                            seed=args.seed)
    from dgemma.parallel.load import load_split_model
    from dgemma.parallel.modules import split_model

    if args.model:
        return load_split_model(args.model, tp, device=device, dtype=dtype, quantize=args.quantize)
    return random_model(dgemma.get_preset(args.config), device=device, dtype=dtype, quantize=args.quantize,
                        seed=args.seed + tp.rank, reshape=lambda m: split_model(m, tp, args.quantize))


def run_split(args, batches: list[int], device, dtype) -> int:
    import torch

    import dgemma
    import dgemma.parallel.load  # imported before measuring: code is not weights
    import dgemma.weights.random_weights
    from dgemma.engine import Engine
    from dgemma.generation.canvas import positions_needed
    from dgemma.parallel.plan import plan_bytes

    with torch.device("meta"):  # torch's one-time set-up for meta-device models (~70 MB), not weights either
        dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    tp = getattr(args, "tp", None)
    ranks, rank = (tp.ranks, tp.rank) if tp is not None else (1, 0)
    before = resident_memory()
    model = _load(args, device, dtype)
    loaded = resident_memory()
    c = model.config
    fmt = args.quantize or "bf16"
    plan = plan_bytes(c, ranks)[fmt] * (2 if dtype == torch.float32 and not args.quantize else 1)
    new_tokens = args.new_tokens or c.canvas_length
    never = (c.vocab_size + 1,)  # an EOS outside the vocabulary: every row runs to new_tokens
    from dgemma.commands._common import check_sampler_flags, sampler_overrides

    sampler = (args.sampler or [model.sampling_config.sampler])[0]  # the split bench times the first alone
    check_sampler_flags(args, sampler)
    fixed = model.sampling_config.replace(max_new_tokens=new_tokens, max_denoising_steps=args.steps, fixed_steps=True,
                                          eos_token_ids=never, seed=args.seed, sampler=sampler,
                                          **sampler_overrides(args))
    gen = torch.Generator().manual_seed(args.seed)  # the same prompts on every rank
    need = positions_needed(args.prompt_len, new_tokens, c.canvas_length)
    rows = []
    for batch in batches:
        prompts = torch.randint(3, c.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        engine = Engine(model, max_batch=batch, max_length=need)
        engine.generate(prompts[:1], fixed.replace(max_new_tokens=c.canvas_length, max_denoising_steps=1))  # warm
        best = None
        for _ in range(args.repeats):
            start = time.perf_counter()
            requests = engine.generate(prompts, fixed)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        rows.append({"batch": batch, "tokens_per_s": sum(len(r.tokens) for r in requests) / best, "seconds": best})
    memory = [{"rank": rank, "rss_before_load": before["rss"], "rss_after_load": loaded["rss"],
               "peak_rss_after_load": loaded["peak_rss"], "private_growth": loaded["private"] - before["private"],
               "peak_rss_end": resident_memory()["peak_rss"]}]
    if tp is not None:
        import torch.distributed as dist

        gathered = [None] * ranks
        dist.all_gather_object(gathered, memory[0], group=tp.group)
        memory = gathered
    if rank == 0:
        _report(args, ranks, device, dtype, fmt, plan, rows, memory)
    return 0


def _report(args, ranks, device, dtype, fmt, plan, rows, memory):
    mb = 2**20
    name = args.model or f"preset {args.config} (random weights)"
    print(f"{name}: {ranks} rank(s), {device}, {str(dtype).replace('torch.', '')}"
          f"{', ' + args.quantize if args.quantize else ''}, {args.steps} fixed steps, prompt {args.prompt_len}")
    print(f"{'batch':>5} {'tokens/s':>10} {'seconds':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tokens_per_s']:>10.1f} {r['seconds']:>9.2f}")
    print(f"{'rank':>4} {'RSS before load':>16} {'peak after load':>16} {'peak growth':>12} {'private growth':>15} "
          f"{'plan (weights)':>15}")
    for m in memory:
        growth = m["peak_rss_after_load"] - m["rss_before_load"]
        print(f"{m['rank']:>4} {m['rss_before_load'] / mb:>13,.0f} MB {m['peak_rss_after_load'] / mb:>13,.0f} MB "
              f"{growth / mb:>9,.0f} MB {m['private_growth'] / mb:>12,.0f} MB {plan / mb:>12,.0f} MB")
    print(json.dumps({"tensor_parallel": ranks, "device": device, "dtype": str(dtype).replace("torch.", ""),
                      "quantize": args.quantize, "results": rows, "memory_per_rank": memory,
                      "plan_weight_bytes_per_rank": plan}))
    sys.stdout.flush()
