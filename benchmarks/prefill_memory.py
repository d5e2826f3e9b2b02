"""Peak memory of an 8,192-token prefill through layers of the 26B-A4B's shape: the engine's chunked prefill
against the prompt encoded in one call.

The model is the released config (hidden 2816; sliding layers 16 query heads, 8 KV heads, head dim 256;
full layers 2 KV heads, head dim 512, K = V; 128 experts top-8, 704 wide; dense MLP 2112) cut to
`--layers` layers (the first of each kind: a sliding and a full layer by default) and a `--vocab` table,
random int4 weights in bf16, as the 26B runs on a CPU. Each way runs in a fresh process: the engine is
built and warmed (its KV cache allocated), the process's peak resident memory is restarted
(`dgemma.processes.restart_peak_rss`), the prompt is read through the engine's prefill steps, and the peak it
reached is taken against the resident memory before. That difference is what reading the prompt adds: the
activations of the chunk in flight (projections, attention, the experts' rows), not the cache it fills
(the engine step that reads the last chunk also takes the first denoising step of the canvas, 256 rows).

    python benchmarks/prefill_memory.py [--tokens 8192] [--layers 2] [--chunks auto,512,whole]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

GIB = 1 << 30


def child(args) -> dict:
    import torch

    import dgemma
    from dgemma.config import FULL, SLIDING, SamplingConfig
    from dgemma.engine import Engine, Request
    from dgemma.processes import resident_memory, restart_peak_rss
    from dgemma.weights.random_weights import random_model

    full = dgemma.get_preset("diffusiongemma-26b-a4b")
    kinds = [SLIDING, FULL] * args.layers
    config = dataclasses.replace(full, num_layers=args.layers, layer_types=tuple(kinds[: args.layers]),
                                 vocab_size=args.vocab)
    model = random_model(config, dtype=torch.bfloat16, quantize="int4", seed=0).eval()
    chunk = {"auto": None, "whole": 10**9}[args.chunk] if args.chunk in ("auto", "whole") else int(args.chunk)
    engine = Engine(model, max_batch=1, max_length=args.tokens + config.canvas_length, prefill_chunk=chunk)
    sampling = SamplingConfig(max_new_tokens=config.canvas_length, max_denoising_steps=1, fixed_steps=True,
                              eos_token_ids=(config.vocab_size,), pad_token_id=0)
    prompt = torch.randint(3, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        engine.generate([prompt[:64]], sampling, seeds=[0])  # the cache rows and the kernels' first calls
        if not restart_peak_rss():  # the peak starts again from the resident memory now
            raise SystemExit("prefill_memory.py needs Linux: the peak resident memory could not be restarted")
        before = resident_memory()["rss"]
        request = engine.submit(Request(prompt=prompt, sampling=sampling, seed=0))
        start, calls = time.perf_counter(), 0
        while request.state.prefilled is None or request.prefilling:  # the last step also takes the canvas's first
            engine.step()
            calls += 1
        seconds = time.perf_counter() - start
        peak = resident_memory()["peak_rss"]
    return {"chunk": args.chunk, "prefill_chunk_tokens": engine.prefill_budget() if chunk is None else min(chunk, args.tokens),
            "engine_steps": calls, "added_bytes": peak - before, "seconds": seconds, "threads": torch.get_num_threads()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--chunks", default="auto,512,whole", help="comma-separated: auto (the engine's choice), "
                   "a token count, whole (one call)")
    p.add_argument("--chunk", help=argparse.SUPPRESS)  # a child process's way
    args = p.parse_args()
    if args.chunk:
        print(json.dumps(child(args)))
        return
    rows = []
    for chunk in args.chunks.split(","):
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--chunk", chunk]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        rows.append(json.loads(done.stdout.splitlines()[-1]))
    print(f"{args.tokens:,}-token prefill, {args.layers} layers of the 26B-A4B shape (int4, bf16)")
    print(f"{'way':<8}{'tokens a call':>14}{'engine steps':>14}{'peak added':>14}{'seconds':>10}")
    for r in rows:
        print(f"{r['chunk']:<8}{r['prefill_chunk_tokens']:>14,}{r['engine_steps']:>14}"
              f"{r['added_bytes'] / GIB:>11.2f} GiB{r['seconds']:>10.1f}")
    print(json.dumps({"tokens": args.tokens, "layers": args.layers, "ways": rows}))


if __name__ == "__main__":
    main()
