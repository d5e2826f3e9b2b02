"""The step cache (dgemma.generation.step_cache), measured two ways.

    python benchmarks/step_cache.py positions [--preset diffusiongemma-26b-a4b] [--layers 6] [--quantize int4]
        One denoising step's time by the fraction of canvas positions active, with 75/50/25% forced settled
        (random positions, every row), against the whole-canvas step the cache-off path runs: the first N
        layers of a preset at its widths and vocabulary (random weights), so the CPU gain at a given settling
        rate is known.

    python benchmarks/step_cache.py sudoku --file DIR/test_medium.txt [--model DIR ...] [--seeds 0,1,2]
            [--setting K,P,R[,share=S][,order=O][,on=model] ...] [--plot active.png] [--frontier frontier.png]
        Cache on against off on sudoku test puzzles (the shipped model unless --model; single shot, eager,
        through the engine as `dgemma sudoku eval`): solved with the 95% Wilson interval, the puzzles lost and
        gained against the first model's cache off (paired: the same seed per puzzle), denoising steps,
        decoder positions and wall time per puzzle, side by side in one run, each seed and the seeds pooled;
        --plot draws the mean active positions per running row by step, --frontier solved against positions.
        --setting: settle steps, settle probability, periodic refresh (0: never), and optionally the
        attention-targeted refresh's share and order (attention, random, oldest) and settle_on (default 2,0.99,0).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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

        recorder, record = self, StepCache.record

        def recording(cache, computed, positions, counts, canvas, active, read=None):
            recorder.by_step.setdefault(cache.steps, []).extend(c for c in counts if c)
            return record(cache, computed, positions, counts, canvas, active, read)

        StepCache.record = recording


SETTING_KEYS = {"share": ("refresh_share", float), "order": ("refresh_order", str), "on": ("settle_on", str)}


def parse_setting(text: str) -> dict:
    """"K,P,R[,share=S][,order=O][,on=model]" -> SamplingConfig fields of the step cache."""
    k, p, r, *more = text.split(",")
    fields = dict(step_cache=True, settle_steps=int(k), settle_probability=float(p), cache_refresh=int(r))
    for item in more:
        key, _, value = item.partition("=")
        name, kind = SETTING_KEYS[key]
        fields[name] = kind(value)
    return fields


def setting_name(fields: dict) -> str:
    name = f"{fields['settle_steps']}, {fields['settle_probability']:g}"
    if fields.get("settle_on", "tempered") != "tempered":
        name += f" ({fields['settle_on']})"
    if fields["cache_refresh"]:
        name += f", every {fields['cache_refresh']}"
    if fields.get("refresh_share"):
        name += f", {fields.get('refresh_order', 'attention')} {fields['refresh_share']:g}"
    return name


def family(fields: dict | None) -> str:
    """The frontier plot's series of a setting: what its refresh rule is."""
    if fields is None:
        return "cache off"
    if fields.get("refresh_share"):
        return fields.get("refresh_order", "attention")
    return "periodic" if fields["cache_refresh"] else "settle only"


def sudoku_bench(args) -> dict:
    """Through the engine, as `dgemma sudoku eval` (single shot, eager): one evaluation per model, setting and
    seed; each model's cache-off run is the paired reference (the same seed per puzzle)."""
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import answer_grid, evaluate, sudoku_sampling
    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.weights.hub import load_model

    examples, _ = sudoku.read_puzzle_file(args.file)
    puzzles = [e.puzzle for e in examples if e is not None][: args.limit]
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = [parse_setting(t) for t in args.setting or ["2,0.99,0"]]
    recorder = _Recorder()
    recorder.install()
    rows = []
    for model_path in args.model or [str(SHIPPED)]:
        model = load_model(model_path, dtype=torch.float32)
        label = Path(model_path).name
        for seed in seeds:
            base = sudoku_sampling(model, seed)
            systems = [(None, base.replace(step_cache=False))] if not args.no_off else []
            systems += [(fields, base.replace(**fields)) for fields in settings]
            for fields, sampling in systems:
                recorder.by_step = {}
                evaluation = evaluate(model, puzzles, batch=args.batch, sampling=sampling, seed=seed)
                d, sc = evaluation.decoding, evaluation.scores
                each = [sudoku.is_valid_solution(p, answer_grid(a)) for p, a in zip(puzzles, evaluation.answers)]
                rows.append({"model": label, "seed": seed, "system": "off" if fields is None else setting_name(fields),
                             "family": family(fields), "settings": fields, "solved": sc["solved"],
                             "total": sc["total"], "ci95": list(sc["ci95"]), "each": each,
                             "decoder_positions_per_puzzle": d["decoder_positions_per_puzzle"],
                             "seconds_per_puzzle": d["seconds_per_puzzle"],
                             "mean_denoising_steps": d["mean_denoising_steps"],
                             "active_by_step": {s: sum(c) / len(c) for s, c in sorted(recorder.by_step.items())}})
                _print_row(rows, rows[-1])
    pooled = _pooled(rows, seeds)
    if args.plot:
        _plot([r for r in rows if r["settings"] and r["seed"] == seeds[0]], args.plot, 81)
    if args.frontier:
        _frontier(pooled if len(seeds) > 1 else [r for r in rows if r["seed"] == seeds[0]], args.frontier,
                  f"{len(puzzles)} puzzles from {Path(args.file).name}, " +
                  (f"seeds {args.seeds} pooled" if len(seeds) > 1 else f"seed {seeds[0]}"))
    return {"benchmark": "step_cache sudoku", "file": args.file, "puzzles": len(puzzles), "batch": args.batch,
            "threads": torch.get_num_threads(), "seeds": seeds, "rows": rows, "pooled": pooled}


def _reference(rows, row):
    """The cache-off run a row is paired with: the first model's on the same seed (None when not run)."""
    first = rows[0]["model"]
    return next((r for r in rows if r["model"] == first and r["seed"] == row["seed"] and r["settings"] is None), None)


def _print_row(rows, r):
    from dgemma.tasks import sudoku

    ref = _reference(rows, r)
    off = next((o for o in rows if o["model"] == r["model"] and o["seed"] == r["seed"] and o["settings"] is None), ref)
    if len(rows) == 1:
        print(f"{'model':<16} {'seed':>4} {'system':<34} {'solved':>9} {'95% Wilson':>14} {'lost':>5} {'gained':>6} "
              f"{'steps':>6} {'positions':>9} {'/ off':>6} {'s/puzzle':>9} {'/ off':>6}", flush=True)
    if ref is not None:
        r["lost"] = sum(a and not b for a, b in zip(ref["each"], r["each"]))
        r["gained"] = sum(b and not a for a, b in zip(ref["each"], r["each"]))
        r["positions_ratio"] = r["decoder_positions_per_puzzle"] / ref["decoder_positions_per_puzzle"]
        r["time_ratio"] = r["seconds_per_puzzle"] / off["seconds_per_puzzle"]
    low, high = sudoku.wilson_interval(r["solved"], r["total"])
    print(f"{r['model']:<16} {r['seed']:>4} {r['system']:<34} {r['solved']:>4}/{r['total']:<4} "
          f"[{100 * low:5.1f},{100 * high:5.1f}] {r.get('lost', '-'):>5} {r.get('gained', '-'):>6} "
          f"{r['mean_denoising_steps']:>6.1f} {r['decoder_positions_per_puzzle']:>9.0f} "
          f"{r.get('positions_ratio', float('nan')):>6.2f} {r['seconds_per_puzzle']:>9.3f} "
          f"{r.get('time_ratio', float('nan')):>6.2f}", flush=True)


def _pooled(rows, seeds) -> list[dict]:
    """Per model and system, the seeds pooled: solved of all, its Wilson interval, lost/gained summed."""
    from dgemma.tasks import sudoku

    out = []
    for key in dict.fromkeys((r["model"], r["system"]) for r in rows):
        group = [r for r in rows if (r["model"], r["system"]) == key]
        if len(group) != len(seeds):
            continue
        solved, total = sum(r["solved"] for r in group), sum(r["total"] for r in group)
        positions = sum(r["decoder_positions_per_puzzle"] for r in group) / len(group)
        out.append({"model": key[0], "system": key[1], "family": group[0]["family"], "settings": group[0]["settings"],
                    "solved": solved, "total": total, "ci95": list(sudoku.wilson_interval(solved, total)),
                    "lost": sum(r.get("lost", 0) for r in group), "gained": sum(r.get("gained", 0) for r in group),
                    "decoder_positions_per_puzzle": positions,
                    "positions_ratio": sum(r.get("positions_ratio", float("nan")) for r in group) / len(group)})
    if len(seeds) > 1:
        print(f"seeds {','.join(map(str, seeds))} pooled:")
        for r in out:
            print(f"{r['model']:<16} {r['system']:<34} {r['solved']:>4}/{r['total']:<4} [{100 * r['ci95'][0]:5.1f},"
                  f"{100 * r['ci95'][1]:5.1f}] lost {r['lost']:>3} gained {r['gained']:>3} positions "
                  f"{r['decoder_positions_per_puzzle']:6.0f} ({r['positions_ratio']:.2f})")
    return out


def _plot(rows, path, canvas_length: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        steps = sorted(r["active_by_step"])
        ax.plot([s + 1 for s in steps], [r["active_by_step"][s] for s in steps], marker=".",
                label=f"{r['model']}: {r['system']}")
    ax.axhline(canvas_length, color="grey", linestyle=":", label="cache off")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("active positions per running row")
    ax.set_ylim(0, canvas_length * 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _frontier(rows, path, title: str):
    """Solved (with its 95% Wilson interval) against decoder positions per puzzle: a colour per refresh rule, a
    marker and line style per model; dashed, the bar the first model's cache off sets (the lower end of its
    interval, half its positions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    models = list(dict.fromkeys(r["model"] for r in rows))
    styles = {m: (marker, line) for m, marker, line in zip(models, "osD^v", ["-", "--", ":", "-.", "-"])}
    colours = {"cache off": "black", "settle only": "C0", "periodic": "C1", "attention": "C2", "random": "C3",
               "oldest": "C4"}
    for key in dict.fromkeys((r["model"], r["family"]) for r in rows):
        group = sorted((r for r in rows if (r["model"], r["family"]) == key),
                       key=lambda r: r["decoder_positions_per_puzzle"])
        x = [r["decoder_positions_per_puzzle"] for r in group]
        y = [100 * r["solved"] / r["total"] for r in group]
        err = [[yi - 100 * r["ci95"][0] for yi, r in zip(y, group)], [100 * r["ci95"][1] - yi for yi, r in zip(y, group)]]
        marker, line = styles[key[0]]
        ax.errorbar(x, y, yerr=err, marker=marker, linestyle=line if len(group) > 1 else "none", capsize=2,
                    color=colours.get(key[1], "C5"), label=f"{key[0]}: {key[1]}")
    off = next((r for r in rows if r["model"] == models[0] and r["settings"] is None), None)
    if off is not None:
        ax.axhline(100 * off["ci95"][0], color="grey", linestyle="--", linewidth=0.8)
        ax.axvline(off["decoder_positions_per_puzzle"] / 2, color="grey", linestyle="--", linewidth=0.8)
        ax.text(off["decoder_positions_per_puzzle"] / 2, 100 * off["ci95"][0], " bar: up and left of here",
                fontsize=7, color="grey", va="bottom")
    ax.set_xlabel("decoder positions per puzzle")
    ax.set_ylabel("solved (%), 95% Wilson interval")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
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
    sdk.add_argument("--model", action="append", default=None, help="a sudoku model folder (repeatable; default: "
                     "the shipped one); each model's runs are paired with the first model's cache off")
    sdk.add_argument("--limit", type=int, default=None)
    sdk.add_argument("--batch", type=int, default=32)
    sdk.add_argument("--seeds", default="0", help="comma-separated; with several, each system is pooled over them")
    sdk.add_argument("--setting", action="append", default=None, metavar="K,P,R[,share=S][,order=O][,on=model]",
                     help="settle steps, settle probability, periodic refresh (0: never); refresh_share, "
                          "refresh_order, settle_on (repeatable; default 2,0.99,0)")
    sdk.add_argument("--no-off", action="store_true", help="leave out the cache-off runs (no pairing)")
    sdk.add_argument("--plot", default=None, help="active positions per running row by step (PNG)")
    sdk.add_argument("--frontier", default=None, help="solved against decoder positions (PNG)")
    args = p.parse_args()
    out = positions(args) if args.what == "positions" else sudoku_bench(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
