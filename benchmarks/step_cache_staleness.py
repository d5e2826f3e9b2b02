"""What the step cache's kept state costs on sudoku: a settled position's logits against its keys/values.

    python benchmarks/step_cache_staleness.py --file DIR/test_medium.txt [--limit N] [--setting 2,0.995]

The step cache (dgemma.generation.step_cache) keeps two things for a settled position: its logits (what the
sampler, the self-conditioning and the stop rule read) and its keys/values in every layer (what the active
positions attend to). This diagnostic runs the whole canvas through the decoder as well at each step, so
that either can be given fresh while the other stays as the cache keeps it:

    off          the cache off
    cache        the cache as built: both kept
    fresh-kv     settled positions' keys/values fresh (the active positions read the canvas as it is now);
                 their logits kept
    fresh-kv@M   the same, but below layer M their keys/values kept (so @1 keeps only the first layer's)
    fresh-logits settled positions' logits fresh; their keys/values kept

It costs a full step on top of the cache's, so it only counts puzzles: solved with the 95% Wilson interval,
per system, through the plain loop (`dgemma.generation.generate`, 16 puzzles per call, call i seeded with 16 * i).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

import dgemma
from dgemma.generation.step_cache import StepCache

CHUNK = 16


def _kept_slots(cache, length: int, below_layer: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Copies of the canvas slots (keys, values or None) of layers < below_layer, each (rows, Hkv, L, D)."""
    return [(k[:, :, :length].clone(), None if v is None else v[:, :, :length].clone())
            for k, v in zip(cache.keys[:below_layer], cache.values[:below_layer])]


def _put_back(cache, kept, settled: torch.Tensor):
    """Write the kept entries (`_kept_slots`) of the settled positions (B, L) back into their layers."""
    where = settled[:, None, :, None]
    length = settled.shape[1]
    for (k, v), (old_k, old_v) in zip(zip(cache.keys, cache.values), kept):
        k[:, :, :length] = torch.where(where, old_k, k[:, :, :length])
        if v is not None:
            v[:, :, :length] = torch.where(where, old_v, v[:, :, :length])


_ORIGINAL = StepCache.logits_for


def install(system: str, num_layers: int):
    """Patch StepCache.logits_for for one system of the module docstring (the original for off and cache)."""
    StepCache.logits_for = _ORIGINAL
    if system in ("off", "cache"):
        return
    fresh_logits = system == "fresh-logits"
    kept_below = 0 if system == "fresh-kv" else num_layers if fresh_logits else int(system.split("@")[1])

    def logits_for(step_cache, model, canvas, cache, done, *, self_conditioning=None, rows=None):
        settled = ~step_cache.active(done) & ~done[:, None]
        kept = _kept_slots(cache, canvas.shape[1], kept_below)
        # the whole canvas as it is now: every position's fresh keys/values go into the slots
        whole = model.denoise(canvas, cache, self_conditioning=self_conditioning).clone()
        _put_back(cache, kept, settled)
        logits = _ORIGINAL(step_cache, model, canvas, cache, done, self_conditioning=self_conditioning, rows=rows)
        return torch.where(settled[..., None], whole, logits) if fresh_logits else logits

    StepCache.logits_for = logits_for


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--setting", default="2,0.995", metavar="SETTLE_STEPS,PROBABILITY")
    p.add_argument("--system", action="append", default=None,
                   help="off, cache, fresh-kv, fresh-kv@M, fresh-logits (repeatable; default: all of them, M = 1, 3, 5)")
    args = p.parse_args()
    for system in args.system or []:
        depth = system.split("@", 1)[1] if system.startswith("fresh-kv@") else None
        if system not in ("off", "cache", "fresh-kv", "fresh-logits") and not (depth and depth.isdigit()):
            p.error(f"--system: expected off, cache, fresh-kv, fresh-kv@M or fresh-logits, not {system!r}")

    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.generation import generate
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import answer_grid, sudoku_sampling

    model = dgemma.load_model(args.model or SHIPPED, dtype=torch.float32)
    examples, _ = sudoku.read_puzzle_file(args.file)
    examples = [e for e in examples if e is not None][: args.limit]
    k, probability = args.setting.split(",")
    base = sudoku_sampling(model, 0)
    cached = base.replace(step_cache=True, settle_steps=int(k), settle_probability=float(probability))
    systems = args.system or ["off", "cache", "fresh-kv", "fresh-kv@1", "fresh-kv@3", "fresh-kv@5", "fresh-logits"]
    rows = []
    print(f"{len(examples)} puzzles from {args.file}, settle {args.setting}, {torch.get_num_threads()} threads")
    print(f"{'system':<14} {'solved':>9} {'95% Wilson':>14}")
    for system in systems:
        install(system, len(model.layers))
        solved = 0
        for start in range(0, len(examples), CHUNK):
            chunk = examples[start : start + CHUNK]
            out = generate(model, [sudoku.encode_prompt(e.puzzle) for e in chunk],
                           base if system == "off" else cached, seed=start)
            solved += sudoku.score([e.puzzle for e in chunk], [answer_grid(t) for t in out.tokens])["solved"]
        low, high = sudoku.wilson_interval(solved, len(examples))
        rows.append({"system": system, "solved": solved, "total": len(examples), "ci95": [low, high]})
        print(f"{system:<14} {solved:>4}/{len(examples):<4} [{100 * low:5.1f},{100 * high:5.1f}]", flush=True)
    install("off", len(model.layers))
    print(json.dumps({"benchmark": "step_cache staleness", "file": args.file, "setting": args.setting,
                      "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
