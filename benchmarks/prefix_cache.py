"""The prefix cache and chunked prefill, each against the engine without it, side by side in one run, on a
model where prefill is the cost (8 layers, 512 wide, fp32, random weights):

  follow-up   a chat's second turn after a ~3,000-token first (run once, with the cache): time to the first
              streamed token (the first draft, what a client streaming drafts sees) and to the first
              committed canvas, with the cache and with --prefix-cache-gib 0; the same tokens either way
  shared      16 requests whose prompts share a 1,000-token system prompt: generated tokens per second, at
              each of `--shared-steps` denoising steps per canvas (the prompt's share of the work shrinks
              as the steps grow: 1,000 prompt tokens against steps x 256 decoder positions a request)
  long        a request denoising while an 8,000-token prompt arrives: its longest gap between two steps
              while the prompt is read (through the step beside its last chunk) against its usual step,
              chunked prefill (the engine's choice) against the prompt read whole; and its first step
              with the long prompt's canvas beside it (a two-row step, the new usual)

    python benchmarks/prefix_cache.py [--steps 16] [--shared-steps 2,4,16] [--history 3000] [--long 8000]
    python benchmarks/prefix_cache.py --model diffusiongemma-26b-a4b --cases follow-up   # the 26B shape, int4

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
ENGINE_ARGS: dict = {}  # --deterministic


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

    request.state.on_event = on_event
    engine.submit(request)
    engine.run_until_done([request])
    return {"first_draft_s": marks["draft"] - request.state.t_submit, "first_canvas_s": marks["canvas"] - request.state.t_submit}


def follow_up(model, sampling, history: int) -> dict:
    """The first turn runs once, on the engine with the cache; the second turn's prompt (the first's
    prompt and answer, then the new message) is then timed there and on an engine without a cache."""
    V = model.config.vocab_size
    out = {}
    engine = Engine(model, max_batch=1, max_length=history + 1024, prefix_cache_bytes=BUDGET, **ENGINE_ARGS)
    turn1 = Request(prompt=tokens(history, 1, V), sampling=sampling, seed=0, cache_answer=True)
    start = time.perf_counter()
    engine.submit(turn1)
    engine.run_until_done([turn1])
    out["first_turn_s"] = time.perf_counter() - start
    follow = turn1.prompt + turn1.tokens + tokens(24, 2, V)
    for name in ("cache", "none"):
        if name == "none":  # its KV cache and blocks go before the next engine's (the 26B leaves little room)
            del engine
            engine = Engine(model, max_batch=1, max_length=history + 1024, **ENGINE_ARGS)
        turn2 = Request(prompt=follow, sampling=sampling, seed=1, want_drafts=True)
        out[name] = {**timed(engine, turn2), "tokens": turn2.tokens, "cached": turn2.cached_tokens,
                     "prompt": len(turn2.prompt)}
    return out


def shared(model, sampling, system: int, n: int = 16) -> dict:
    V = model.config.vocab_size
    head = tokens(system, 3, V)
    prompts = [head + tokens(20, 100 + i, V) for i in range(n)]
    out = {}
    for name, budget in (("cache", BUDGET), ("none", 0)):
        engine = Engine(model, max_batch=n, max_length=system + 512, prefix_cache_bytes=budget, **ENGINE_ARGS)
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
        engine = Engine(model, max_batch=2, max_length=length + 256 * 40, prefill_chunk=chunk, **ENGINE_ARGS)
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
        while long.prefilling or long.state.row is None:
            engine.step()
        read_s = time.perf_counter() - start
        gaps = [b - a for a, b in zip(steps[before - 1 :], steps[before:])]  # through the last chunk's step
        read = len(steps)
        engine.step()  # the long prompt's canvas joins: the running request's steps are two rows' from now
        engine.cancel(running)
        engine.cancel(long)
        engine.step()
        out[name] = {"usual_step_s": usual, "longest_gap_s": max(gaps), "ratio": max(gaps) / usual,
                     "prompt_read_s": read_s, "gaps_s": [round(gap, 3) for gap in gaps],
                     "joined_step_s": steps[read] - steps[read - 1], "chunk_tokens": engine.pace.chunk_tokens}
    return out


def build_model(name: str):
    """`512` (the default test bed: bench-20m 512 wide, fp32) or a preset in int4, bf16 and int8 compute where
    the CPU has it, as the 26B-A4B runs on a CPU."""
    if name == "512":
        return model_512()
    from dgemma.quant import int8_compute
    from dgemma.weights.random_weights import random_model

    model = random_model(dgemma.get_preset(name), dtype=torch.bfloat16, quantize="int4", seed=0).eval()
    int8_compute.enable(model, "auto")
    return model


def report_follow_up(f: dict) -> dict:
    return {"prompt_tokens": f["cache"]["prompt"], "cached_tokens": f["cache"]["cached"],
            "first_turn_s": f["first_turn_s"],
            "first_draft_s": {k: f[k]["first_draft_s"] for k in ("cache", "none")},
            "first_canvas_s": {k: f[k]["first_canvas_s"] for k in ("cache", "none")},
            "first_draft_speedup": f["none"]["first_draft_s"] / f["cache"]["first_draft_s"],
            "first_canvas_speedup": f["none"]["first_canvas_s"] / f["cache"]["first_canvas_s"],
            "same_tokens": f["cache"]["tokens"] == f["none"]["tokens"]}


def report_shared(s: dict) -> dict:
    return {steps: {"tokens_per_s": {k: run[k]["tokens_per_s"] for k in run},
                    "speedup": run["cache"]["tokens_per_s"] / run["none"]["tokens_per_s"],
                    "same_tokens": run["cache"]["tokens"] == run["none"]["tokens"]}
            for steps, run in s.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="512", help="512 (bench-20m 512 wide, fp32) or a preset, run in int4 "
                   "(e.g. diffusiongemma-26b-a4b)")
    p.add_argument("--cases", default="follow-up,shared,long", help="comma-separated: follow-up, shared, long")
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas (fixed)")
    p.add_argument("--history", type=int, default=3000)
    p.add_argument("--system", type=int, default=1000)
    p.add_argument("--shared-steps", default="2,4,16", help="comma-separated steps per canvas for the shared case")
    p.add_argument("--long", type=int, default=8000)
    p.add_argument("--deterministic", action="store_true",
                   help="engines in deterministic mode (aligned encoder spans): the same tokens by construction")
    args = p.parse_args()
    ENGINE_ARGS["deterministic"] = args.deterministic
    cases = args.cases.split(",")
    model = build_model(args.model)
    sampling = SamplingConfig(max_new_tokens=256, max_denoising_steps=args.steps, fixed_steps=True,
                              eos_token_ids=(model.config.vocab_size,), pad_token_id=0)
    result = {"model": args.model, "steps": args.steps, "threads": torch.get_num_threads(),
              "deterministic": args.deterministic}
    print(f"{'case':<44}{'cache / chunked':>16}{'none / whole':>14}{'ratio':>8}")
    with torch.no_grad():
        if "follow-up" in cases:
            fu = result["follow_up"] = report_follow_up(follow_up(model, sampling, args.history))
            print(f"{'follow-up: first draft (s), ' + str(fu['prompt_tokens']) + ' tokens':<44}"
                  f"{fu['first_draft_s']['cache']:>16.2f}{fu['first_draft_s']['none']:>14.2f}"
                  f"{fu['first_draft_speedup']:>8.1f}")
            print(f"{'follow-up: first canvas (s)':<44}{fu['first_canvas_s']['cache']:>16.2f}"
                  f"{fu['first_canvas_s']['none']:>14.2f}{fu['first_canvas_speedup']:>8.1f}")
            print(f"  same tokens: {fu['same_tokens']}")
        if "shared" in cases:
            sh = result["shared"] = report_shared({
                steps: shared(model, sampling.replace(max_denoising_steps=steps), args.system)
                for steps in map(int, args.shared_steps.split(","))})
            for steps, run in sh.items():
                label = f"shared {args.system:,}-token system, {steps} steps: tok/s"
                print(f"{label:<44}{run['tokens_per_s']['cache']:>16.1f}{run['tokens_per_s']['none']:>14.1f}"
                      f"{run['speedup']:>8.1f}")
            print("  same tokens: " + ", ".join(f"{steps} steps {run['same_tokens']}" for steps, run in sh.items()))
        if "long" in cases:
            g = result["long"] = long_prompt(model, sampling, args.long)
            print(f"{'long prompt: longest gap / usual step':<44}{g['chunked']['ratio']:>16.1f}"
                  f"{g['whole']['ratio']:>14.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
