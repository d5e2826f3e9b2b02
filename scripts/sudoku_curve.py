"""Learning curves of the sudoku runs: solved share against optimizer steps, diffusion and AR, per bucket.

    python scripts/sudoku_curve.py EVAL_DIR OUT.png [SECONDS_PER_STEP [STAGE2_START]]

EVAL_DIR holds `dgemma sudoku eval` JSON lines named `<diffusion|ar|shipped>-<step>-<bucket>.json`
(`shipped`: the shipped model with its own decoding, drawn as single stars). Prints a
markdown table (Wilson 95% intervals) and draws the plot, with the target bars (easy 95%, medium 80%).
SECONDS_PER_STEP (wall-clock, measured on the 2-core training machine) adds each point's cost;
STAGE2_START marks the step where the second training stage (per-step symmetry augmentation) began.
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAME = re.compile(r"^(diffusion|ar|shipped)-(\d+)-(easy|medium|hard)\.json$")
BARS = {"easy": 0.95, "medium": 0.80}
COLORS = {"easy": "tab:green", "medium": "tab:orange", "hard": "tab:red"}


def load(folder: Path):
    points = defaultdict(dict)  # (system, bucket) -> {step: result}
    for f in sorted(folder.iterdir()):
        m = NAME.match(f.name)
        if m and f.read_text().strip():
            system, step, bucket = m.group(1), int(m.group(2)), m.group(3)
            points[(system, bucket)][step] = json.loads(f.read_text())
    return points


def main():
    folder, out = Path(sys.argv[1]), sys.argv[2]
    seconds_per_step = float(sys.argv[3]) if len(sys.argv) > 3 else None
    stage2 = int(sys.argv[4]) if len(sys.argv) > 4 else None
    points = load(folder)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (system, bucket), by_step in sorted(points.items()):
        steps = sorted(by_step)
        acc = [by_step[s]["accuracy"] for s in steps]
        lo = [max(0.0, a - by_step[s]["ci95"][0]) for a, s in zip(acc, steps)]
        hi = [max(0.0, by_step[s]["ci95"][1] - a) for a, s in zip(acc, steps)]
        style = {"diffusion": ("o", "-", "diffusion, released decoding"), "ar": ("s", "--", "autoregressive"),
                 "shipped": ("*", "none", "diffusion, shipped decoding")}[system]
        ax.errorbar(steps, acc, yerr=[lo, hi], marker=style[0], markersize=12 if system == "shipped" else 6,
                    capsize=3, linestyle=style[1], color=COLORS[bucket], label=f"{style[2]} - {bucket}")
    for bucket, bar in BARS.items():
        ax.axhline(bar, color=COLORS[bucket], linewidth=0.8, linestyle=":")
        ax.text(ax.get_xlim()[0], bar + 0.01, f"bar: {bucket} {bar:.0%}", color=COLORS[bucket], fontsize=8)
    if stage2:
        ax.axvline(stage2, color="grey", linewidth=0.8, linestyle="--")
        ax.text(stage2, 0.33, " stage 2: a fresh symmetry\n per example and step", color="grey", fontsize=8)
    ax.set_xlabel("optimizer steps (batch 64)")
    ax.set_ylabel("puzzles solved (single shot, 300 per bucket)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Sudoku: the same 2.2M-parameter network, same data, same steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)

    print("| model | step | bucket | solved | accuracy (95% Wilson) |" + (" diffusion training time, 2 cores |" if seconds_per_step else ""))
    print("|---|---|---|---|---|" + ("---|" if seconds_per_step else ""))
    for (system, bucket), by_step in sorted(points.items()):
        for step in sorted(by_step):
            r = by_step[step]
            lo, hi = r["ci95"]
            cost = ""
            if seconds_per_step:  # measured for the diffusion run; the AR run's steps cost differently
                cost = f" {step * seconds_per_step / 3600:.1f} h |" if system != "ar" else " - |"
            print(f"| {system} | {step} | {bucket} | {r['solved']}/{r['total']} | "
                  f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] |{cost}")


if __name__ == "__main__":
    main()
