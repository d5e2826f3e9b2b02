"""The released 26B-A4B shape in int4 on a CPU, with OpenVINO's kernels and with torch's, side by side: each in
a fresh process (the library holds the only copy of the weights it takes, so one process cannot run both),
one after the other, then one table of both and their ratios.

Per system: build (random int4 weights made directly in int4, `dgemma.weights.random_weights`), the
hand-over to the library (int8 compute's `enable`), the resident weights and RSS, each part's kernel, a
prefill, an AR token, a denoising step of the 256-token canvas fed self-conditioning probabilities (as every
step after the first: embedded, then the forward with no other (1, L, V) buffer alive, as `generate` and the
engine run it), the step cache's step with 25 / 50 / 75% of the canvas active (`decode_active`),
and the parts of a step: one layer's attention projections (sliding, full), dense MLP and routed experts
(canvas and one token), the LM head and the soft embedding; then peak RSS, the load average and the
tokens/s those imply (peak RSS also before the parts: what a user's process reaches). Each piece is timed once
after one untimed call.

    python benchmarks/cpu_26b.py [--layers 30] [--steps 16] [--systems torch,library]
    python benchmarks/cpu_26b.py --end-to-end [--repeats 1]   # `dgemma bench` per system instead (~30 min each)

`--layers N` keeps the first N layers (the widths and the 262k vocabulary kept): the parts per layer are the
full model's, the step and RSS are not. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SYSTEMS = {"torch": "torch", "library": "auto"}  # system -> DGEMMA_CPU_KERNELS
FRACTIONS = (0.25, 0.5, 0.75)


def timed(fn):
    """Seconds of one call, after one untimed call (first calls pay for allocation and kernel setup)."""
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args) -> dict:
    """One system, in this process (DGEMMA_CPU_KERNELS set by the parent)."""
    import dataclasses

    import torch

    import dgemma
    from dgemma import processes
    from dgemma.processes import release_freed_memory
    from dgemma.model import PreviousStep
    from dgemma.model.packing import PackedPositions
    from dgemma.quant import int8_compute, kernels, quantize
    from dgemma.weights.random_weights import random_model

    config = dgemma.get_preset(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_layers=args.layers, layer_types=config.layer_types[: args.layers])
    out = {"kernels_env": os.environ.get("DGEMMA_CPU_KERNELS"), "load_before": os.getloadavg()[0],
           "threads": torch.get_num_threads(), "layers": config.num_layers}
    start = time.perf_counter()
    model = random_model(config, dtype=torch.bfloat16, quantize="int4")
    out["build_s"], out["rss_after_build"] = time.perf_counter() - start, processes.resident_memory()["rss"]
    start = time.perf_counter()
    out["int8_compute"] = int8_compute.enable(model, "auto")
    release_freed_memory()
    out["hand_over_s"], out["rss_after_hand_over"] = time.perf_counter() - start, processes.resident_memory()["rss"]
    out["dgemma_weight_bytes"] = quantize.loaded_weight_bytes(model)
    out["kernels"] = {"canvas": kernels.kernels(model, config.canvas_length), "AR": kernels.kernels(model, 1)}
    c, g = model.config, torch.Generator().manual_seed(0)
    ids = torch.randint(3, c.vocab_size, (1, args.prompt_len), generator=g)
    canvas = torch.randint(3, c.vocab_size, (1, c.canvas_length), generator=g)
    probs = torch.randn(1, c.canvas_length, c.vocab_size, generator=g).mul_(3).softmax(-1)
    x = torch.randn(1, c.canvas_length, c.hidden_size, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        cache = model.new_cache(1, args.prompt_len + 8 + c.canvas_length)
        start = time.perf_counter()
        model.encode(ids, cache, return_logits=False)
        out["prefill_s"] = time.perf_counter() - start
        ar = []
        for i in range(3):  # AR: one token and its logits (the cache has room for 8); the fastest counts
            start = time.perf_counter()
            model.encode(ids[:, i : i + 1], cache)
            ar.append(time.perf_counter() - start)
        out["ar_token_s"] = min(ar)
        # a step after the first as the sampling loop runs it: the previous step's probabilities embedded and their
        # (1, L, V) buffer let go, then the forward, whose logits stand in for the next step's probabilities (the
        # sampler would overwrite them with a softmax; the values do not change what either call costs)
        held = [probs]
        del probs

        def step():
            previous = PreviousStep(embedding=model.soft_embedding_from_probs(held.pop()))
            held.append(model.denoise(canvas, cache, self_conditioning=previous))

        out["step_s"] = timed(step)
        sc = PreviousStep(probs=held[0])  # the step cache embeds only the positions it runs: the buffer stays
        for f in FRACTIONS:
            active = torch.rand(1, c.canvas_length, generator=g).argsort(-1) < int(f * c.canvas_length)
            pack = PackedPositions.from_mask(active)
            out[f"step_{int(f * 100)}pct_active_s"] = timed(
                lambda pack=pack: model.decode_active(canvas, cache, pack, self_conditioning=sc))
        # the peak of what a user's process does (build, hand-over, prefill, AR, steps), before the parts' calls
        out["peak_rss_before_parts_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["parts"] = parts(model, x, held[0])
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["load_after"] = os.getloadavg()[0]
    out["diffusion_tokens_per_s"] = c.canvas_length / (args.steps * out["step_s"])
    out["ar_tokens_per_s"] = 1 / out["ar_token_s"]
    out["diffusion_vs_ar"] = out["diffusion_tokens_per_s"] / out["ar_tokens_per_s"]
    return out


def parts(model, x, probs) -> dict:
    """Seconds of each part of a canvas step (one layer of each kind; the head and soft embedding whole)."""
    c = model.config
    flat = x[0]
    sliding = model.layers[c.layer_types.index("sliding_attention")]
    full = next((model.layers[i] for i, t in enumerate(c.layer_types) if t == "full_attention"), None)

    def projections(block):
        attn = block.self_attn
        heads = x.new_zeros(1, c.canvas_length, attn.o_proj.in_features)
        return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x) if attn.v_proj is not None else None, attn.o_proj(heads)]

    out = {"attention projections, sliding layer": timed(lambda: projections(sliding))}
    if full is not None:
        out["attention projections, full layer"] = timed(lambda: projections(full))
    out["dense MLP, one layer"] = timed(lambda: sliding.mlp(x))
    out["experts, one layer, canvas"] = timed(lambda: sliding.experts(flat, *sliding.router(flat)))
    out["experts, one layer, 1 token"] = timed(lambda: sliding.experts(flat[:1], *sliding.router(flat[:1])))
    out["LM head, canvas"] = timed(lambda: model.head(x))
    out["soft embedding, canvas"] = timed(lambda: model.soft_embedding_from_probs(probs))
    return out


def end_to_end(args, env: dict) -> dict:
    """`dgemma bench` for one system (fixed steps, engine and AR turn about): its JSON line."""
    command = [sys.executable, "-m", "dgemma", "bench", "--config", args.preset, "--quantize", "int4", "--batch", "1",
               "--steps", str(args.steps), "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats),
               "--no-transformers", "--no-startup", "--no-adaptive", "--eager"]
    if args.layers:
        command += ["--layers", str(args.layers)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode:
        raise SystemExit(f"dgemma bench failed ({done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {r["system"]: r for r in result["results"]}
    engine, ar = rows["engine-fixed"], rows["ar"]
    return {"diffusion_tokens_per_s": engine["tokens_per_s"], "ar_tokens_per_s": ar["tokens_per_s"],
            "diffusion_vs_ar": result.get("speedup_vs_ar"), "ms_per_step": engine["ms_per_step"],
            "peak_rss_bytes": max(engine["peak_rss_bytes"], ar["peak_rss_bytes"]), "what_ran": result["what_ran"]}


def table(results: dict, end_to_end_run: bool):
    names = list(results)
    print(" | ".join(["figure"] + names + ([f"{names[-1]} / {names[0]}"] if len(names) == 2 else [])))

    def row(label, key, fmt="{:.3f}", inverse=False, get=lambda r, k: r.get(k)):
        values = [get(results[n], key) for n in names]
        cells = ["-" if v is None else fmt.format(v) for v in values]
        if len(values) == 2 and None not in values and values[0]:
            cells.append(f"{(values[0] / values[1]) if inverse else (values[1] / values[0]):.2f}x")
        print(" | ".join([label] + cells))

    gib = "{:.2f}"
    if not end_to_end_run:
        row("weights held by dgemma, GiB", "dgemma_weight_bytes", gib, get=lambda r, k: r[k] / 2**30)
        row("RSS after the hand-over, GiB", "rss_after_hand_over", gib, get=lambda r, k: r[k] / 2**30)
        row("hand-over, s", "hand_over_s", "{:.1f}")
        for key in ("prefill_s", "ar_token_s", "step_s") + tuple(f"step_{int(f * 100)}pct_active_s" for f in FRACTIONS):
            row(key + " (speed-up)", key, inverse=True)
        for part in results[names[0]]["parts"]:
            row(part + ", s (speed-up)", part, inverse=True, get=lambda r, k: r["parts"][k])
    else:
        row("ms per step", "ms_per_step", "{:.0f}", inverse=True)
    if not end_to_end_run:
        row("peak RSS before the parts, GiB", "peak_rss_before_parts_bytes", gib, get=lambda r, k: r[k] / 2**30)
    row("peak RSS, GiB", "peak_rss_bytes", gib, get=lambda r, k: r[k] / 2**30)
    row("diffusion tok/s", "diffusion_tokens_per_s")
    row("AR tok/s", "ar_tokens_per_s")
    row("diffusion / AR", "diffusion_vs_ar", "{:.2f}")
    for name, r in results.items():
        load = r.get("load_before"), r.get("load_after")
        print(f"{name}: load average {load[0]} -> {load[1]}; kernels: {json.dumps(r.get('kernels') or r.get('what_ran'))}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="diffusiongemma-26b-a4b")
    p.add_argument("--layers", type=int, default=None, help="the first N layers only (widths and vocabulary kept)")
    p.add_argument("--steps", type=int, default=16, help="fixed denoising steps per canvas, for the tokens/s")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--systems", default="torch,library", help="comma-separated, run in this order: torch, library")
    p.add_argument("--end-to-end", action="store_true", help="`dgemma bench` per system instead of the parts")
    p.add_argument("--repeats", type=int, default=1, help="--end-to-end: the bench's repeats")
    p.add_argument("--child", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        if args.child == "library":  # as `dgemma` does for an int4 model OpenVINO may take, before torch loads
            from dgemma.processes import shorten_openmp_spin

            shorten_openmp_spin()
        print(json.dumps(measure(args)))
        return
    systems = [s for s in args.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        p.error(f"--systems takes a comma-separated list of {', '.join(SYSTEMS)}")
    results = {}
    for system in systems:
        env = dict(os.environ, DGEMMA_CPU_KERNELS=SYSTEMS[system])
        load = os.getloadavg()[0]
        print(f"{system}: DGEMMA_CPU_KERNELS={env['DGEMMA_CPU_KERNELS']}, load average {load:.2f}", file=sys.stderr, flush=True)
        if args.end_to_end:
            results[system] = dict(end_to_end(args, env), load_before=load, load_after=os.getloadavg()[0])
            continue
        child = [sys.executable, __file__, "--child", system, "--preset", args.preset, "--steps", str(args.steps),
                 "--prompt-len", str(args.prompt_len)] + (["--layers", str(args.layers)] if args.layers else [])
        done = subprocess.run(child, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"{system}: the measuring process failed ({done.returncode})")
        results[system] = json.loads(done.stdout.strip().splitlines()[-1])
    table(results, args.end_to_end)
    print(json.dumps({"preset": args.preset, "layers": args.layers, "steps": args.steps, "end_to_end": args.end_to_end,
                      "results": results}))


if __name__ == "__main__":
    main()
