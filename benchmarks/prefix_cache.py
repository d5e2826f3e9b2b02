"""The prefix cache and chunked prefill, each against the engine without it, side by side in one run, on a
model where prefill is the cost (8 layers, 512 wide, fp32, random weights):

  follow-up   a chat's second turn after a ~3,000-token first: time to the first streamed token (the
              first draft, what a client streaming drafts sees) and to the first committed canvas, with
              the cache and with --prefix-cache-gib 0; the same tokens either way
  shared      16 requests whose prompts share a 1,000-token system prompt: generated tokens per second
  long        a request denoising while an 8,000-token prompt arrives: its longest gap between two steps
              against its usual step, chunked prefill (the engine's choice) against the prompt read whole

    python benchmarks/prefix_cache.py [--steps 16] [--history 3000] [--long 8000]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, Request

BUDGET = 2 << 30


def model_512(seed: int = 0):
    config = dgemma.get_preset("bench-20m")
    config = type(config)(**{**config.__dict__, "hidden_size": 512, "intermediate_size": 1024,
                             "moe_intermediate_size": 256})
    torch.manual_seed(seed)
    return dgemma.DiffusionGemma(config).eval()


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def timed(engine, request: Request) -> dict:
    """Run one request alone; seconds from submit to its first draft and its first canvas."""
    marks = {}

    def on_event(event):
        marks.setdefault(event.kind, time.perf_counter())

    request.on_event, request.want_drafts = on_event, True
    engine.submit(request)
    engine.run_until_done([request])
    return {"first_draft_s": marks["draft"] - request.t_submit, "first_canvas_s": marks["canvas"] - request.t_submit}


def follow_up(model, sampling, history: int) -> dict:
    V = model.config.vocab_size
    first = tokens(history, 1, V)
    out = {}
    for name, budget in (("cache", BUDGET), ("none", 0)):
        engine = Engine(model, max_batch=1, max_length=history + 1024, prefix_cache_bytes=budget)
        turn1 = Request(prompt=first, sampling=sampling, seed=0, cache_answer=True)
        engine.submit(turn1)
        engine.run_until_done([turn1])
        turn2 = Request(prompt=first + turn1.tokens + tokens(24, 2, V), sampling=sampling, seed=1)
        out[name] = {**timed(engine, turn2), "tokens": turn2.tokens, "cached": turn2.cached_tokens,
                     "prompt": len(turn2.prompt)}
    return out


def shared(model, sampling, system: int, n: int = 16) -> dict:
    V = model.config.vocab_size
    head = tokens(system, 3, V)
    prompts = [head + tokens(20, 100 + i, V) for i in range(n)]
    out = {}
    for name, budget in (("cache", BUDGET), ("none", 0)):
        engine = Engine(model, max_batch=n, max_length=system + 512, prefix_cache_bytes=budget)
        start = time.perf_counter()
        requests = engine.generate(prompts, sampling, seeds=list(range(n)))
        elapsed = time.perf_counter() - start
        out[name] = {"elapsed_s": elapsed, "tokens_per_s": sum(len(r.tokens) for r in requests) / elapsed,
                     "tokens": [r.tokens for r in requests]}
    return out


def long_prompt(model, sampling, length: int) -> dict:
    V = model.config.vocab_size
    out = {}
    for name, chunk in (("chunked", None), ("whole", 10**6)):
        engine = Engine(model, max_batch=2, max_length=length + 256 * 40, prefill_chunk=chunk)
        steps: list[float] = []  # when each step of the running request ended

        def on_event(event, steps=steps):
            if event.kind == "draft":
                steps.append(time.perf_counter())

        running = Request(prompt=tokens(64, 4, V), sampling=sampling.replace(max_new_tokens=256 * 36), seed=0,
                          want_drafts=True, on_event=on_event)
        engine.submit(running)
        for _ in range(6):
            engine.step()
        usual = statistics.median(b - a for a, b in itertools.pairwise(steps))
        before = len(steps)
        long = engine.submit(Request(prompt=tokens(length, 5, V), sampling=sampling, seed=1))
        start = time.perf_counter()
        while long.prefilling or long.row is None:
            engine.step()
        read_s = time.perf_counter() - start
        engine.step()
        gaps = [b - a for a, b in zip(steps[before - 1 :], steps[before:])]
        engine.cancel(running)
        engine.cancel(long)
        engine.step()
        out[name] = {"usual_step_s": usual, "longest_gap_s": max(gaps), "ratio": max(gaps) / usual,
                     "prompt_read_s": read_s}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas (fixed)")
    p.add_argument("--history", type=int, default=3000)
    p.add_argument("--system", type=int, default=1000)
    p.add_argument("--long", type=int, default=8000)
    args = p.parse_args()
    model = model_512()
    sampling = SamplingConfig(max_new_tokens=256, max_denoising_steps=args.steps, fixed_steps=True,
                              eos_token_ids=(model.config.vocab_size,), pad_token_id=0)
    with torch.no_grad():
        f = follow_up(model, sampling, args.history)
        s = shared(model, sampling, args.system)
        g = long_prompt(model, sampling, args.long)
    result = {
        "follow_up": {"prompt_tokens": f["cache"]["prompt"], "cached_tokens": f["cache"]["cached"],
                      "first_draft_s": {k: f[k]["first_draft_s"] for k in f},
                      "first_canvas_s": {k: f[k]["first_canvas_s"] for k in f},
                      "first_draft_speedup": f["none"]["first_draft_s"] / f["cache"]["first_draft_s"],
                      "first_canvas_speedup": f["none"]["first_canvas_s"] / f["cache"]["first_canvas_s"],
                      "same_tokens": f["cache"]["tokens"] == f["none"]["tokens"]},
        "shared": {"tokens_per_s": {k: s[k]["tokens_per_s"] for k in s},
                   "speedup": s["cache"]["tokens_per_s"] / s["none"]["tokens_per_s"],
                   "same_tokens": s["cache"]["tokens"] == s["none"]["tokens"]},
        "long": g,
        "steps": args.steps, "threads": torch.get_num_threads(),
    }
    fu, sh = result["follow_up"], result["shared"]
    print(f"{'case':<44}{'cache / chunked':>16}{'none / whole':>14}{'ratio':>8}")
    print(f"{'follow-up: first draft (s), ' + str(fu['prompt_tokens']) + ' tokens':<44}"
          f"{fu['first_draft_s']['cache']:>16.2f}{fu['first_draft_s']['none']:>14.2f}{fu['first_draft_speedup']:>8.1f}")
    print(f"{'follow-up: first canvas (s)':<44}{fu['first_canvas_s']['cache']:>16.2f}"
          f"{fu['first_canvas_s']['none']:>14.2f}{fu['first_canvas_speedup']:>8.1f}")
    print(f"{'shared 1,000-token system: tokens/s (16 req)':<44}{sh['tokens_per_s']['cache']:>16.1f}"
          f"{sh['tokens_per_s']['none']:>14.1f}{sh['speedup']:>8.1f}")
    print(f"{'long prompt: longest gap / usual step':<44}{g['chunked']['ratio']:>16.1f}{g['whole']['ratio']:>14.1f}")
    print(f"same tokens: follow-up {fu['same_tokens']}, shared {sh['same_tokens']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
