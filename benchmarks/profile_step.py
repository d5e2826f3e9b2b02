"""Where a denoising step's time goes: the engine at batch 1 on a preset with random weights, profiled.

    python benchmarks/profile_step.py [--preset bench-20m] [--eager] [--mode MODE] [--threads N]

Runs the `dgemma bench` workload (a 64-token prompt, one 256-token canvas, fixed 16 steps), warms up,
then profiles one generation with torch.profiler and inductor's per-kernel records. Prints two tables,
the step's phases (decoder forward, sampler scan, self-conditioning embedding, the rest: sampling draws,
the one host read, Python bookkeeping) and the kernels by kind, in ms per step, then one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

import dgemma
from dgemma import devices
from dgemma.engine import Engine
from dgemma.engine.allocator import keep_freed_memory
from dgemma.generation.canvas import positions_needed
from dgemma.weights.random_weights import random_model

PROMPT, CANVAS_TOKENS, STEPS = 64, 256, 16
# kernel name fragments -> kind (first match wins); compiled kernels are inductor's, eager ones ATen's
KINDS = [
    ("attention", ("flash_attention", "scaled_dot_product")),
    ("experts (batched matmul)", ("bmm",)),
    ("matmul (projections, LM head, self-conditioning)", ("mm_out", "aten::mm", "aten::addmm", "linear")),
    ("fused elementwise / reductions (inductor)", ("cpp_fused",)),
]


def labelled(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench-20m")
    p.add_argument("--eager", action="store_true", help="profile the eager step (default: compiled)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: dgemma's for the device)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as `dgemma bench` and the generating commands (else page faults every step)
    if not args.eager:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # a record per inductor kernel (its own cache key)
    config = dgemma.get_preset(args.preset)
    choice = devices.default_dtype("cpu", config.hidden_size)  # what `dgemma bench` and `generate` take
    dtype = choice.dtype
    model = random_model(config, device="cpu", dtype=dtype, seed=args.seed)
    c = model.config
    sampling = model.sampling_config.replace(max_new_tokens=CANVAS_TOKENS, max_denoising_steps=STEPS,
                                             fixed_steps=True, eos_token_ids=(c.vocab_size + 1,), seed=args.seed)
    prompts = torch.randint(3, c.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(args.seed)).tolist()
    if not args.eager:
        dgemma.compile_model(model, args.mode)
    engine = Engine(model, max_batch=1, max_length=positions_needed(PROMPT, CANVAS_TOKENS, c.canvas_length))
    phases = {"decoder forward": (engine.runner, "denoise"), "sampler scan": (engine, "scan"),
              "self-conditioning embedding": (engine.runner, "soft_embedding"),
              "encoder (prompt)": (engine.runner, "prefill")}
    for label, (owner, name) in phases.items():
        setattr(owner, name, labelled(getattr(owner, name), label))

    start = time.perf_counter()
    engine.generate(prompts, sampling, seeds=[0])  # compiles (cold) or loads (warm)
    first = time.perf_counter() - start
    warm = []
    for _ in range(2):
        start = time.perf_counter()
        engine.generate(prompts, sampling, seeds=[0])
        warm.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, sampling, seeds=[0])
        profiled = time.perf_counter() - start

    events = prof.key_averages()
    step_ms = profiled * 1e3 / STEPS  # shares are of the profiled generation (the encoder's prompt pass too)
    ms_per_step = {label: sum(e.cpu_time_total for e in events if e.key == label) / 1e3 / STEPS for label in phases}
    ms_per_step["rest (draws, host read, Python)"] = max(0.0, step_ms - sum(ms_per_step.values()))
    kinds = {kind: 0.0 for kind, _ in KINDS}
    for e in events:
        for kind, fragments in KINDS:
            if any(f in e.key for f in fragments):
                kinds[kind] += e.self_cpu_time_total / 1e3 / STEPS
                break

    print(f"{args.preset}, {'eager' if args.eager else 'compiled'}, {choice}, "
          f"{torch.get_num_threads()} threads: {min(warm) * 1e3 / STEPS:.1f} ms per step unprofiled (best of 2 "
          f"generations), {step_ms:.1f} profiled; first generation {first:.1f} s")
    print("\n| phase | ms per step | share |\n|---|---|---|")
    for label, ms in ms_per_step.items():
        print(f"| {label} | {ms:.1f} | {ms / step_ms:.0%} |")
    print("\n| kernels by kind | ms per step | share |\n|---|---|---|")
    for kind, ms in kinds.items():
        print(f"| {kind} | {ms:.1f} | {ms / step_ms:.0%} |")
    print(json.dumps({"preset": args.preset, "compiled": not args.eager, "threads": torch.get_num_threads(),
                      "dtype": str(dtype).replace("torch.", ""), "ms_per_step": round(min(warm) * 1e3 / STEPS, 2),
                      "profiled_ms_per_step": round(step_ms, 2),
                      "profiled_generation_s": round(profiled, 3), "first_generation_s": round(first, 2),
                      "phases_ms_per_step": {k: round(v, 2) for k, v in ms_per_step.items()},
                      "kernels_ms_per_step": {k: round(v, 2) for k, v in kinds.items()}}))


if __name__ == "__main__":
    main()
