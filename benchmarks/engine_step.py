"""The eager engine's denoising step time, this tree against another checkout of dgemma, side by side.

    python benchmarks/engine_step.py --against /path/to/other/checkout [--batch 1,4] [--rounds 3]

Each round runs one child process per tree, turn about (this tree first), on the same random bench-20m
model (seeded), with the same prompts and seeds: one 256-token canvas of `--steps` fixed denoising
steps per request. A child times `--repeats` generations and keeps its fastest; the table shows each
tree's best over the rounds, in ms per step, and the ratio. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(args):
    import torch

    import dgemma
    from dgemma.engine import Engine
    from dgemma.generation.canvas import positions_needed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = dgemma.DiffusionGemma(dgemma.get_preset(args.config)).to(dtype=dtype).eval()
    L = model.config.canvas_length
    sampling = model.sampling_config.replace(max_new_tokens=L, max_denoising_steps=args.steps, fixed_steps=True,
                                             eos_token_ids=(model.config.vocab_size + 1,))
    out = {}
    for batch in args.batches:
        prompts = [torch.randint(3, model.config.vocab_size, (args.prompt_len,)).tolist() for _ in range(batch)]
        engine = Engine(model, max_batch=batch, max_length=positions_needed(args.prompt_len, L, L))
        engine.generate(prompts, sampling, seeds=list(range(batch)))  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            engine.forwards = 0
            start = time.perf_counter()
            engine.generate(prompts, sampling, seeds=list(range(batch)))
            best = min(best, (time.perf_counter() - start) / engine.forwards)
        out[str(batch)] = 1000 * best
    print(json.dumps(out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="another dgemma checkout (its repository root)")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--config", default="bench-20m")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batch.split(",")]
    if args.child:
        return child(args)
    trees = {"this": HERE, "against": Path(args.against).resolve()}
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
            argv = [sys.executable, str(HERE / "benchmarks" / "engine_step.py"), "--child", *sys.argv[1:]]
            result = json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True,
                                               cwd=tree).stdout.strip().splitlines()[-1])
            for batch, ms in result.items():
                best[name, batch] = min(best.get((name, batch), float("inf")), ms)
    print(f"{args.config}, {args.dtype}, {args.threads} threads, {args.steps} fixed steps, prompt {args.prompt_len}")
    print(f"{'batch':>5} | {'this (ms/step)':>14} | {'against (ms/step)':>17} | {'against / this':>14}")
    summary = {}
    for batch in map(str, args.batches):
        this, other = best["this", batch], best["against", batch]
        print(f"{batch:>5} | {this:14.1f} | {other:17.1f} | {other / this:14.3f}")
        summary[batch] = {"this_ms": round(this, 2), "against_ms": round(other, 2), "ratio": round(other / this, 3)}
    print(json.dumps({"engine_step": summary, "against": str(trees["against"])}))


if __name__ == "__main__":
    main()
