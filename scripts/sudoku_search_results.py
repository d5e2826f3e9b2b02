"""Tables and a plot from the JSON lines of scripts/sudoku_search_eval.sh.

    python scripts/sudoku_search_results.py OUT [LABEL=FOLDER ...]

Prints markdown tables (accuracy with 95% Wilson intervals, forwards and seconds per puzzle) for every
<model>-<RxC>-<bucket>.json in OUT, and draws OUT/search.png: accuracy per bucket against decoder
forwards per puzzle, one line per model through its budgets. Extra LABEL=FOLDER arguments add the
single-shot rows of another folder of the same layout (e.g. the model before fine-tuning).
"""

import json
import re
import sys
from pathlib import Path

BUCKETS = ("easy", "medium", "hard", "minimal")
GIVENS = {"easy": "40-45", "medium": "30-39", "hard": "24-29", "minimal": "21-23"}
# the project's targets for the diffusion model (None: report only), single shot and with the 8 x 8 search
TARGETS = {"easy": (0.99, 1.0), "medium": (0.90, 0.99), "hard": (0.60, 0.95), "minimal": (None, 0.80)}
NAME = re.compile(r"(?P<model>diffusion|ar)-(?P<rounds>\d+)x(?P<cands>\d+)-(?P<bucket>\w+)\.json$")


def load(folder: Path) -> dict:
    runs = {}
    for f in sorted(folder.glob("*.json")):
        m = NAME.match(f.name)
        if m and f.read_text().strip():
            key = (m["model"], int(m["rounds"]), int(m["cands"]), m["bucket"])
            runs[key] = json.loads(f.read_text())
    return runs


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    lo, hi = r["ci95"]
    return f"{100 * r['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({r['solved']}/{r['total']})"


def main():
    out = Path(sys.argv[1])
    runs = load(out)
    extra = {label: load(Path(path)) for label, path in (a.split("=", 1) for a in sys.argv[2:])}
    budgets = sorted({(k[1], k[2]) for k in runs})
    print("| bucket | single shot: target | measured | search (8 x 8): target | measured |")
    print("|---|---|---|---|---|")
    for b in BUCKETS:
        marks = []
        for (rounds, cands), target in zip(((1, 1), (8, 8)), TARGETS[b]):
            r = runs.get(("diffusion", rounds, cands, b))
            verdict = "" if r is None or target is None else (" met" if r["accuracy"] >= target else " **not met**")
            goal = "report" if target is None else "100%" if target == 1 else f">= {100 * target:.0f}%"
            marks += [goal, (cell(r) + verdict) if r else "not measured"]
        print(f"| {b} ({GIVENS[b]}) | " + " | ".join(marks) + " |")
    print()
    print("| model | search (rounds x candidates) | " + " | ".join(f"{b} ({GIVENS[b]})" for b in BUCKETS) + " |")
    print("|---|---|" + "---|" * len(BUCKETS))
    for label, source in [("diffusion", runs), ("autoregressive", runs)] + [(k, v) for k, v in extra.items()]:
        model = "ar" if label == "autoregressive" else "diffusion"
        for rounds, cands in budgets:
            row = [source.get((model, rounds, cands, b)) for b in BUCKETS]
            if any(row):
                search = "single shot" if (rounds, cands) == (1, 1) else f"{rounds} x {cands}"
                print(f"| {label} | {search} | " + " | ".join(cell(r) for r in row) + " |")
    print()
    print("| model | search | bucket | forwards per puzzle | seconds per puzzle (batch 64) | accepted by the rules |")
    print("|---|---|---|---|---|---|")
    for (model, rounds, cands, bucket), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1:3], BUCKETS.index(kv[0][3]))):
        print(f"| {model} | {rounds} x {cands} | {bucket} | {r['forwards_per_puzzle']:.1f} | "
              f"{r['seconds_per_puzzle']:.3f} | {100 * r['verifier_accepted']:.1f}% |")
    speed = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("speed-*.json")) if f.read_text().strip()}
    if speed:
        print()
        print("| model | batch | seconds per puzzle | forwards per puzzle | puzzles |")
        print("|---|---|---|---|---|")
        for name, r in speed.items():
            _, model, batch = name.split("-")
            print(f"| {model} | {batch.removeprefix('batch')} | {r['seconds_per_puzzle']:.3f} | "
                  f"{r['forwards_per_puzzle']:.1f} | {r['total']} |")
    plot(runs, out / "search.png")


def plot(runs: dict, path: Path):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BUCKETS), figsize=(4 * len(BUCKETS), 3.6), sharey=True)
    for ax, bucket in zip(axes, BUCKETS):
        for model, style in (("diffusion", "o-"), ("ar", "s--")):
            points = sorted((r["forwards_per_puzzle"], r["accuracy"], f"{k[1]}x{k[2]}")
                            for k, r in runs.items() if k[0] == model and k[3] == bucket)
            if points:
                ax.plot([p[0] for p in points], [100 * p[1] for p in points], style,
                        label="diffusion" if model == "diffusion" else "autoregressive")
                for x, y, budget in points:
                    ax.annotate(budget, (x, 100 * y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(8, 10000)  # the same axis in every panel; minor ticks unlabelled
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{bucket} ({GIVENS[bucket]} givens)")
        ax.set_xlabel("decoder forwards per puzzle")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("solved (%)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("held-out sudoku: accuracy against forwards (rounds x candidates of the rules-checked search)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
