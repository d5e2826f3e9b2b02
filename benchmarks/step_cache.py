"""The step cache (dgemma.generation.step_cache), measured two ways.

    python benchmarks/step_cache.py positions [--preset diffusiongemma-26b-a4b] [--layers 6] [--quantize int4]
        One denoising step's time by the fraction of canvas positions active, with 75/50/25% forced settled
        (random positions, every row), against the whole-canvas step the cache-off path runs: the first N
        layers of a preset at its widths and vocabulary (random weights), so the CPU gain at a given settling
        rate is known.

    python benchmarks/step_cache.py sudoku --file DIR/test_medium.txt [--limit N] [--batch 32] [--plot out.png]
        Cache on against off on sudoku test puzzles (the shipped model unless --model; single shot, eager,
        through the engine as `dgemma sudoku eval`): solved with the 95% Wilson interval, the puzzles lost and
        gained against cache off (paired: the same seed per puzzle), denoising steps,
        decoder positions and wall time per puzzle, side by side in one run; --plot draws the mean active
        positions per running row by step.
        --setting SETTLE_STEPS,PROBABILITY,REFRESH (repeatable) picks the cache settings (default 2,0.99,0).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dgemma


def _timed(fns: dict, repeats: int) -> dict:
    """name -> the best of `repeats` calls' seconds, after one untimed call each; the calls interleaved, round
    after round, so that a machine's load falls on every variant alike."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def positions(args) -> dict:
    from dgemma.model.network import PreviousStep
    from dgemma.model.packing import PackedPositions
    from dgemma.weights.random_weights import random_model

    config = dgemma.get_preset(args.preset)
    config = config.replace(num_layers=args.layers, layer_types=config.layer_types[: args.layers])
    model = random_model(config, dtype=torch.bfloat16, quantize=args.quantize)
    L, B = config.canvas_length, args.batch
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(B, args.prompt_len + L)
    canvas = torch.randint(3, config.vocab_size, (B, L), generator=g)
    soft = PreviousStep(embedding=torch.randn(B, L, config.hidden_size, generator=g).to(model.dtype))
    rows = []
    with torch.no_grad():
        model.encode(torch.randint(3, config.vocab_size, (B, args.prompt_len), generator=g), cache,
                     return_logits=False)
        fns = {"off": lambda: model.denoise(canvas, cache, self_conditioning=soft)}
        for fraction in (1.0, 0.75, 0.5, 0.25):
            count = round(fraction * L)
            active = torch.zeros(B, L, dtype=torch.bool)
            for b in range(B):
                active[b, torch.randperm(L, generator=g)[:count]] = True
            pack = PackedPositions.from_mask(active)
            fns[fraction] = lambda p=pack: model.decode_active(canvas, cache, p, self_conditioning=soft)
        times = _timed(fns, args.repeats)
    rows.append({"active": 1.0, "path": "denoise (cache off)", "step_s": times.pop("off"), "ratio": 1.0})
    for fraction, s in times.items():
        rows.append({"active": fraction, "path": "decode_active", "step_s": s, "ratio": s / rows[0]["step_s"]})
    print(f"{args.preset}, first {args.layers} layers, {args.quantize or 'bf16'}, batch {B}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats}")
    print(f"{'active':>7} {'path':<22} {'step s':>9} {'/ off':>7}")
    for r in rows:
        print(f"{r['active']:>7.2f} {r['path']:<22} {r['step_s']:>9.3f} {r['ratio']:>7.2f}")
    return {"benchmark": "step_cache positions", "preset": args.preset, "layers": args.layers,
            "quantize": args.quantize, "batch": B, "threads": torch.get_num_threads(), "rows": rows}


class _Recorder:
    """Active positions per running row by step index, over every canvas (for the plot)."""

    def __init__(self):
        self.by_step: dict[int, list[int]] = {}

    def install(self):
        from dgemma.generation.step_cache import StepCache

        recorder, take = self, StepCache.take

        def recording_take(cache, computed, pack, canvas, active):
            recorder.by_step.setdefault(cache.steps, []).extend(c for c in pack.counts if c)
            return take(cache, computed, pack, canvas, active)

        StepCache.take = recording_take


def sudoku_bench(args) -> dict:
    """Through the engine, as `dgemma sudoku eval` (single shot, eager): one evaluation per system."""
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import answer_grid, evaluate, sudoku_sampling
    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.weights.hub import load_model

    model = load_model(args.model or SHIPPED, dtype=torch.float32)
    examples, _ = sudoku.read_puzzle_file(args.file)
    puzzles = [e.puzzle for e in examples[: args.limit] if e is not None] if args.limit else [e.puzzle for e in examples]
    base = sudoku_sampling(model, args.seed)
    recorder = _Recorder()
    recorder.install()
    systems = [("off", base.replace(step_cache=False))]
    for text in args.setting or ["2,0.99,0"]:
        k, p, r = text.split(",")
        systems.append((f"on ({k}, {p}, R={r})", base.replace(step_cache=True, settle_steps=int(k),
                                                                settle_probability=float(p), cache_refresh=int(r))))
    rows = []
    for name, sampling in systems:
        recorder.by_step = {}
        evaluation = evaluate(model, puzzles, batch=args.batch, sampling=sampling, seed=args.seed)
        d, sc = evaluation.decoding, evaluation.scores
        active = {s: sum(c) / len(c) for s, c in sorted(recorder.by_step.items())}
        each = [sudoku.is_valid_solution(p, answer_grid(a)) for p, a in zip(puzzles, evaluation.answers)]
        rows.append({"system": name, "solved": sc["solved"], "total": sc["total"], "ci95": list(sc["ci95"]),
                     "each": each,
                     "decoder_positions_per_puzzle": d["decoder_positions_per_puzzle"],
                     "seconds_per_puzzle": d["seconds_per_puzzle"], "mean_denoising_steps": d["mean_denoising_steps"],
                     "active_by_step": active})
    off = rows[0]
    print(f"{len(puzzles)} puzzles from {args.file}, engine batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"{'system':<22} {'solved':>9} {'95% Wilson':>14} {'lost':>5} {'gained':>6} {'steps':>6} {'positions':>9} "
          f"{'/ off':>6} {'s/puzzle':>9} {'/ off':>6}")
    for r in rows:
        r["time_ratio"] = r["seconds_per_puzzle"] / off["seconds_per_puzzle"]
        r["positions_ratio"] = r["decoder_positions_per_puzzle"] / off["decoder_positions_per_puzzle"]
        # paired with cache off (the same seed per puzzle): puzzles it solves that cache off does not, and back
        r["lost"] = sum(a and not b for a, b in zip(off["each"], r["each"]))
        r["gained"] = sum(b and not a for a, b in zip(off["each"], r["each"]))
        print(f"{r['system']:<22} {r['solved']:>4}/{r['total']:<4} [{100 * r['ci95'][0]:5.1f},{100 * r['ci95'][1]:5.1f}]"
              f" {r['lost']:>5} {r['gained']:>6}"
              f" {r['mean_denoising_steps']:>6.1f} {r['decoder_positions_per_puzzle']:>9.0f} {r['positions_ratio']:>6.2f}"
              f" {r['seconds_per_puzzle']:>9.3f} {r['time_ratio']:>6.2f}")
    if args.plot:
        _plot(rows[1:], args.plot, model.config.canvas_length)
    return {"benchmark": "step_cache sudoku", "file": args.file, "puzzles": len(puzzles), "batch": args.batch,
            "threads": torch.get_num_threads(), "rows": rows}


def _plot(rows, path, canvas_length: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        steps = sorted(r["active_by_step"])
        ax.plot([s + 1 for s in steps], [r["active_by_step"][s] for s in steps], marker=".", label=r["system"])
    ax.axhline(canvas_length, color="grey", linestyle=":", label="cache off")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("active positions per running row")
    ax.set_ylim(0, canvas_length * 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    pos = sub.add_parser("positions")
    pos.add_argument("--preset", default="diffusiongemma-26b-a4b")
    pos.add_argument("--layers", type=int, default=6, help="the preset's first N layers (widths kept)")
    pos.add_argument("--quantize", choices=["int8", "int4"], default=None)
    pos.add_argument("--batch", type=int, default=1)
    pos.add_argument("--prompt-len", type=int, default=16)
    pos.add_argument("--repeats", type=int, default=2)
    sdk = sub.add_parser("sudoku")
    sdk.add_argument("--file", required=True)
    sdk.add_argument("--model", default=None)
    sdk.add_argument("--limit", type=int, default=None)
    sdk.add_argument("--batch", type=int, default=32)
    sdk.add_argument("--seed", type=int, default=0)
    sdk.add_argument("--setting", action="append", default=None, metavar="K,P,R")
    sdk.add_argument("--plot", default=None)
    args = p.parse_args()
    out = positions(args) if args.what == "positions" else sudoku_bench(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
