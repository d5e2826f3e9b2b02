"""What `--deterministic` costs: the engine's default mode against its deterministic mode (aligned
encoder spans, one decoder forward a request; dgemma/engine/runner.py), side by side in one run, on the
prefix-cache benchmark's model (8 layers, 512 wide, fp32, random weights).

`requests` prompts of `prompt` tokens each, one canvas of `steps` fixed steps, all submitted at once;
generated tokens per second, rounds taken turn about (the order flips every round). Also whether each
engine gave every request the tokens it gives that request alone.

    python benchmarks/deterministic.py [--requests 8] [--prompt 300] [--steps 8] [--rounds 2]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dgemma.config import SamplingConfig
from dgemma.engine import Engine
from prefix_cache import model_512, tokens


def run(model, prompts, sampling, deterministic: bool) -> tuple[float, list[list[int]]]:
    engine = Engine(model, max_batch=len(prompts), max_length=len(max(prompts, key=len)) + 512,
                    deterministic=deterministic)
    start = time.perf_counter()
    done = engine.generate(prompts, sampling, seeds=list(range(len(prompts))))
    elapsed = time.perf_counter() - start
    return sum(len(r.tokens) for r in done) / elapsed, [r.tokens for r in done]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas (fixed)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = model_512()
    V = model.config.vocab_size
    sampling = SamplingConfig(max_new_tokens=model.config.canvas_length, max_denoising_steps=args.steps,
                              fixed_steps=True, eos_token_ids=(V,), pad_token_id=0)
    prompts = [tokens(args.prompt, 20 + i, V) for i in range(args.requests)]
    rates = {False: [], True: []}
    batched = {}
    with torch.no_grad():
        for r in range(args.rounds):
            for deterministic in (False, True) if r % 2 == 0 else (True, False):
                rate, batched[deterministic] = run(model, prompts, sampling, deterministic)
                rates[deterministic].append(rate)
        alone = {d: [Engine(model, max_batch=1, max_length=len(p) + 512, deterministic=d)
                     .generate([p], sampling, seeds=[i])[0].tokens for i, p in enumerate(prompts)]
                 for d in (False, True)}
    result = {"requests": args.requests, "prompt_tokens": args.prompt, "steps": args.steps,
              "threads": torch.get_num_threads(),
              "tokens_per_s": {"default": rates[False], "deterministic": rates[True]},
              "ratio": statistics.median(rates[True]) / statistics.median(rates[False]),
              "deterministic_same_as_alone": batched[True] == alone[True],
              "default_same_as_alone": batched[False] == alone[False]}
    print(f"{'engine':<16}{'tokens/s (median)':>20}{'each request as alone':>24}")
    print(f"{'default':<16}{statistics.median(rates[False]):>20.1f}{str(result['default_same_as_alone']):>24}")
    print(f"{'deterministic':<16}{statistics.median(rates[True]):>20.1f}"
          f"{str(result['deterministic_same_as_alone']):>24}")
    print(f"ratio {result['ratio']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
