"""Prompt scoring in the engine (what lm-eval's loglikelihood requests run), three ways, same prompts:

  * alone:   one prompt per batch, one after another (lm-eval's default: batch_size=1, one connection);
  * batched: all prompts admitted together, right-padded, no prefix shared (MIN_SHARED_TOKENS = inf);
  * shared:  the same batch with shared prefixes encoded once and copied into the other rows (default).

Two workloads shaped like the harness's: "mmlu" (a 5-shot prefix of ~400 tokens shared by every
question, a ~60-token question, four one-token choices) and "hellaswag" (a ~80-token context and four
endings of 15..30 tokens). Then what scoring costs generation: the step times of one generating request
alone and beside a long prompt being scored in chunks.

    python benchmarks/scoring.py [--preset bench-20m] [--questions 4]

Random weights (the arithmetic is the checkpoint's); CPU. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, Request
from dgemma.engine import scoring


def workloads(vocab: int, questions: int, rng: random.Random) -> dict[str, list[list[int]]]:
    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    shots = tokens(400)
    mmlu = [shots + q + [c] for q in (tokens(rng.randint(40, 80)) for _ in range(questions)) for c in tokens(4)]
    hellaswag = [ctx + tokens(rng.randint(15, 30)) for ctx in (tokens(rng.randint(60, 100)) for _ in range(questions))
                 for _ in range(4)]
    return {"mmlu": mmlu, "hellaswag": hellaswag}


def timed_scoring(model, prompts, *, batch: int, share: bool) -> tuple[float, int]:
    scoring.MIN_SHARED_TOKENS = 8 if share else 10**9
    engine = Engine(model, max_batch=batch, max_length=1024)
    start = time.perf_counter()
    if batch == 1:
        for p in prompts:
            engine.score([p])
    else:
        engine.score(prompts)
    return time.perf_counter() - start, engine.scored_tokens


def generation_beside_scoring(model, long_prompt: list[int]) -> dict:
    """Step times of one generating request, alone and while a long prompt is scored beside it."""
    sampling = SamplingConfig(max_new_tokens=model.config.canvas_length, max_denoising_steps=12, fixed_steps=True,
                              eos_token_ids=(model.config.vocab_size,))
    out = {}
    for name, with_scoring in (("alone", False), ("beside scoring", True)):
        engine = Engine(model, max_batch=2, max_length=len(long_prompt) + model.config.canvas_length)
        gen = Request(prompt=long_prompt[:64], sampling=sampling, seed=0)
        requests = [gen] + ([Request(prompt=long_prompt, sampling=None, seed=0, score_top=1)] if with_scoring else [])
        engine.submit_all(requests)
        steps = []
        while not gen.done:
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        engine.run_until_done(requests)
        out[name] = {"steps": len(steps), "median_step_s": statistics.median(steps), "max_step_s": max(steps),
                     "total_s": sum(steps)}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-20m")
    parser.add_argument("--questions", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset(args.preset)).eval()
    rng = random.Random(0)
    rows, record = [], {"preset": args.preset, "threads": torch.get_num_threads(), "workloads": {}}
    for name, prompts in workloads(model.config.vocab_size, args.questions, rng).items():
        timed_scoring(model, prompts[:4], batch=len(prompts), share=True)  # warm-up
        results = {}
        ways = (("alone", 1, False), ("batched", len(prompts), False), ("shared", len(prompts), True))
        for way, batch, share in ways:
            seconds, encoded = timed_scoring(model, prompts, batch=batch, share=share)
            results[way] = {"seconds": seconds, "encoded_tokens": encoded}
        total = sum(map(len, prompts))
        for way, r in results.items():
            rows.append((name, way, len(prompts), total, r["encoded_tokens"], r["seconds"],
                         total / r["seconds"], results["alone"]["seconds"] / r["seconds"]))
        record["workloads"][name] = {"prompts": len(prompts), "prompt_tokens": total, **results}
    scoring.MIN_SHARED_TOKENS = 8
    long_prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(2 * scoring.SCORE_CHUNK_TOKENS)]
    record["generation"] = generation_beside_scoring(model, long_prompt)

    print(f"{'workload':10} {'way':8} {'prompts':>7} {'tokens':>7} {'encoded':>8} {'seconds':>8} {'tok/s':>8} "
          f"{'vs alone':>8}")
    for name, way, n, total, encoded, seconds, rate, speedup in rows:
        print(f"{name:10} {way:8} {n:7d} {total:7d} {encoded:8d} {seconds:8.2f} {rate:8.0f} {speedup:7.2f}x")
    print(f"\ngeneration, one request of one canvas (12 steps), beside a {len(long_prompt)}-token prompt scored "
          f"in chunks of {scoring.SCORE_CHUNK_TOKENS}:")
    for name, g in record["generation"].items():
        print(f"  {name:15} steps {g['steps']:3d}  median step {g['median_step_s'] * 1e3:7.1f} ms  "
              f"longest {g['max_step_s'] * 1e3:7.1f} ms  total {g['total_s']:6.2f} s")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
