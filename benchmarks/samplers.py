"""The samplers against each other on sudoku: solved puzzles against decoder forwards and time, over a sweep of
step counts (dgemma.sampling.samplers: entropy-bound, block-refinement, ddim).

    python benchmarks/samplers.py sudoku --data DIR --buckets easy,medium,hard,minimal --out runs.jsonl \\
        --system entropy-bound:8,12,16,24 --system block-refinement:4,8,12 --system ddim,corrector_steps=1:8,12
        The shipped sudoku model (unless --model) on DIR/test_<bucket>.txt (`dgemma sudoku prepare`), through the
        engine as `dgemma sudoku eval` (eager, seed 0, one search per puzzle): for every system and step count
        (--steps: the forwards per canvas each sampler may spend), solved with the 95% Wilson interval, decoder
        forwards, denoising steps and seconds per puzzle. A system is SAMPLER[,FIELD=VALUE...]:STEPS,...
        (SamplingConfig fields). --rounds R --candidates C runs the verifier search instead of single shot;
        --limit N takes the first N puzzles of each bucket. Each result is appended to --out as one JSON line
        as soon as it is measured, and a result already there is not measured again (a long sweep resumes).

    python benchmarks/samplers.py plot --results runs.jsonl [more.jsonl] [--timed timed.jsonl] --out DIR
        One PNG per sampler (DIR/samplers-frontier-<sampler>.png): solved against forwards per puzzle (a line
        per bucket and mode) and, with --timed (a shorter run of some of the same settings, timed alone),
        against its seconds per puzzle on medium, the entropy bound's in grey behind; and
        the table of which settings reach the entropy bound's solved count (inside its 95% interval) in at most
        2/3 of its forwards.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REFERENCE = "entropy-bound"  # the sampler the others are measured against, at the model's own step count
BUCKET_COLOURS = {"easy": "tab:blue", "medium": "tab:green", "hard": "tab:orange", "minimal": "tab:red"}
MARKS = ("o", "s")  # single shot, search


def parse_system(text: str) -> tuple[str, dict, list[int]]:
    """'ddim,corrector_steps=1:8,12' -> ('ddim', {'corrector_steps': 1}, [8, 12])."""
    head, _, steps = text.partition(":")
    sampler, *settings = head.split(",")
    fields = {}
    for item in settings:
        key, _, value = item.partition("=")
        fields[key] = json.loads(value) if value[:1].isdigit() or value[:1] in "-[{" else value
    return sampler, fields, [int(s) for s in steps.split(",") if s]


def label(sampler: str, fields: dict) -> str:
    return sampler + "".join(f", {k}={v}" for k, v in sorted(fields.items()))


def sudoku(args) -> dict:
    import torch

    import dgemma
    from dgemma.tasks import sudoku as task
    from dgemma.tasks.sudoku_eval import evaluate, sudoku_sampling

    model_dir = args.model or str(Path(dgemma.__file__).parent / "assets" / "sudoku")
    model = dgemma.load_model(model_dir, dtype=torch.float32)
    out = Path(args.out)
    done = {json.dumps(r["key"]) for r in _read(out)} if out.exists() else set()
    mode = "single shot" if args.rounds * args.candidates == 1 else f"{args.rounds} x {args.candidates} search"
    rows = []
    for bucket in args.buckets.split(","):
        examples, _ = task.read_puzzle_file(Path(args.data) / f"test_{bucket}.txt")
        puzzles = [e.puzzle for e in examples[: args.limit]]
        for system in args.system:
            sampler, fields, steps_list = parse_system(system)
            for steps in steps_list:
                key = {"system": label(sampler, fields), "steps": steps, "bucket": bucket, "mode": mode,
                       "puzzles": len(puzzles), "model": model_dir}
                if json.dumps(key) in done:
                    continue
                sampling = sudoku_sampling(model, args.seed, sampler=sampler, max_denoising_steps=steps, **fields)
                result = evaluate(model, puzzles, batch=args.batch, sampling=sampling, seed=args.seed,
                                  rounds=args.rounds, candidates=args.candidates)
                s, d = result.scores, result.decoding
                row = {"key": key, "sampler": sampler, "fields": fields, **{k: key[k] for k in key if k != "model"},
                       "solved": s["solved"], "total": s["total"], "ci95": s["ci95"],
                       "forwards_per_puzzle": round(d["forwards_per_puzzle"], 2),
                       "denoising_steps_per_puzzle": round(d["mean_denoising_steps"], 2),
                       "seconds_per_puzzle": round(d["seconds_per_puzzle"], 4), "mean_rounds": d["mean_rounds"],
                       "batch": args.batch, "threads": torch.get_num_threads()}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
                _print_row(row)
    return {"benchmark": "samplers sudoku", "mode": mode, "out": str(out), "measured": len(rows)}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _print_row(r: dict):
    lo, hi = r["ci95"]
    print(f"{r['system']:<44} {r['bucket']:<8} {r['mode']:<14} steps {r['steps']:>3}  {r['solved']:>4}/{r['total']:<4}"
          f" [{100 * lo:5.1f}, {100 * hi:5.1f}]  forwards {r['forwards_per_puzzle']:>7.1f}"
          f"  s/puzzle {r['seconds_per_puzzle']:.3f}", flush=True)


def reference_rows(rows: list[dict], reference_steps: int) -> dict:
    """(bucket, mode) -> the entropy bound's row at `reference_steps`."""
    return {(r["bucket"], r["mode"]): r for r in rows
            if r["system"] == REFERENCE and r["steps"] == reference_steps}


def matches(rows: list[dict], reference_steps: int, fraction: float = 2 / 3) -> list[dict]:
    """Every other setting against the entropy bound at `reference_steps` in its bucket and mode: whether its
    solved rate is at least the lower end of the bound's 95% interval, and its forwards at most `fraction` of
    the bound's."""
    reference = reference_rows(rows, reference_steps)
    out = []
    for r in rows:
        ref = reference.get((r["bucket"], r["mode"]))
        if ref is None or r is ref:
            continue
        accuracy = r["solved"] / r["total"]
        cost = r["forwards_per_puzzle"] / ref["forwards_per_puzzle"]
        out.append({"system": r["system"], "steps": r["steps"], "bucket": r["bucket"], "mode": r["mode"],
                    "solved": r["solved"], "total": r["total"], "reference_solved": ref["solved"],
                    "reference_ci95": ref["ci95"], "forwards_ratio": round(cost, 3),
                    "within_interval": accuracy >= ref["ci95"][0], "cheap_enough": cost <= fraction + 1e-9})
    return out


def plot(args) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = list({(r["system"], r["steps"], r["bucket"], r["mode"]): r  # one row a setting: the first measured
                 for path in reversed(args.results) for r in reversed(_read(Path(path)))}.values())[::-1]
    timed = {(r["system"], r["steps"]): r["seconds_per_puzzle"] for path in args.timed for r in _read(Path(path))
             if r["bucket"] == "medium"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samplers = sorted({r["sampler"] for r in rows}, key=lambda s: (s != REFERENCE, s))
    written = []
    medium = [{**r, "seconds_per_puzzle": timed[r["system"], r["steps"]]} for r in rows
              if r["bucket"] == "medium" and r["mode"] == "single shot" and (r["system"], r["steps"]) in timed]
    panels = [("forwards_per_puzzle", "decoder forwards per puzzle", rows)]
    if timed:  # the sweep's own seconds are left out: a long sweep shares the machine
        panels.append(("seconds_per_puzzle", "seconds per puzzle (medium, single shot; the --timed run)", medium))
    for sampler in samplers:
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 3.5, 5), sharey=True, squeeze=False)
        for ax, (x_key, x_label, panel) in zip(axes[0], panels):
            if sampler != REFERENCE:
                for (system, bucket, mode), points in _series(panel, REFERENCE).items():
                    _draw(ax, points, x_key, f"{system}: {bucket}, {mode}", style="--" + MARKS[mode != "single shot"],
                          colour="0.6", alpha=0.7)
            systems = sorted({r["system"] for r in panel if r["sampler"] == sampler}, key=len)
            for (system, bucket, mode), points in _series(panel, sampler).items():
                line = ("-", ":", "-.", "--")[systems.index(system) % 4]
                _draw(ax, points, x_key, f"{system}: {bucket}, {mode}", style=line + MARKS[mode != "single shot"],
                      colour=BUCKET_COLOURS.get(bucket))
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(ticker.ScalarFormatter())
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
        axes[0, 0].set_ylabel("solved (95% Wilson interval)")
        axes[0, 0].set_ylim(0, 1.02)
        axes[0, -1].legend(*axes[0, 0].get_legend_handles_labels(), fontsize=7, loc="upper left",
                           bbox_to_anchor=(1.01, 1.0))  # beside the plot: the lower corners hold hard and minimal
        fig.suptitle(f"{sampler} on the shipped sudoku model: solved against cost over step counts")
        fig.tight_layout()
        path = out / f"samplers-frontier-{sampler}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    table = matches(rows, args.reference_steps)
    found = [m for m in table if m["within_interval"] and m["cheap_enough"]]
    print(f"settings within the entropy bound's interval (at {args.reference_steps} steps) in <= 2/3 of its forwards:")
    for m in found or [{"system": "none"}]:
        print("  " + ", ".join(f"{k}={v}" for k, v in m.items()))
    return {"benchmark": "samplers plot", "plots": written, "matches": found}


def _series(rows: list[dict], sampler: str) -> dict:
    series: dict = {}
    for r in rows:
        if r["sampler"] == sampler:
            series.setdefault((r["system"], r["bucket"], r["mode"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["steps"]) for k, v in sorted(series.items())}


def _draw(ax, points, x_key, name, *, style, colour=None, alpha=1.0):
    xs = [p[x_key] for p in points]
    ys = [p["solved"] / p["total"] for p in points]
    low = [y - p["ci95"][0] for y, p in zip(ys, points)]
    high = [p["ci95"][1] - y for y, p in zip(ys, points)]
    bars = ax.errorbar(xs, ys, yerr=[low, high], fmt=style, ms=3, capsize=2, lw=1, color=colour, alpha=alpha,
                       label=name)
    for x, y, p in zip(xs, ys, points):
        ax.annotate(str(p["steps"]), (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points",
                    color=bars[0].get_color())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("sudoku")
    s.add_argument("--data", required=True, help="a `dgemma sudoku prepare` folder (test_<bucket>.txt)")
    s.add_argument("--buckets", default="medium")
    s.add_argument("--system", action="append", required=True, help="SAMPLER[,FIELD=VALUE...]:STEPS,...")
    s.add_argument("--model", default=None)
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--rounds", type=int, default=1)
    s.add_argument("--candidates", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="JSON lines, appended to")
    q = sub.add_parser("plot")
    q.add_argument("--results", nargs="+", required=True)
    q.add_argument("--timed", nargs="*", default=[], help="results of a quiet run whose seconds the time panel uses")
    q.add_argument("--out", required=True)
    q.add_argument("--reference-steps", type=int, default=24, help="the entropy bound's step count to match")
    args = p.parse_args(argv)
    print(json.dumps(sudoku(args) if args.part == "sudoku" else plot(args)))


if __name__ == "__main__":
    main()
