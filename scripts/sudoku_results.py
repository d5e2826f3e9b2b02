"""Turn the eval JSON files of a shipped sudoku model into RESULTS.md (tables with Wilson intervals).

    python scripts/sudoku_results.py RESULTS_DIR MODEL_DIR [COMPARE_STEP [AR_STEP]] > RESULTS_DIR/RESULTS.md

RESULTS_DIR holds eval/<mode>-<bucket>.json and trainer_state.json (scripts/ship_sudoku.sh writes them);
MODEL_DIR is the shipped model, whose generation_config.json says how it decodes.
"""

import json
import os
import sys
from pathlib import Path

from dgemma.config import SamplingConfig

folder, model = Path(sys.argv[1]), Path(sys.argv[2])
state = json.loads((folder / "trainer_state.json").read_text())
rows = []
compare_step = sys.argv[3] if len(sys.argv) > 3 else "?"
ar_step = sys.argv[4] if len(sys.argv) > 4 else "?"


def describe(s: SamplingConfig) -> str:
    return f"T {s.t_max} -> {s.t_min}, at most {s.max_denoising_steps} steps, entropy bound {s.entropy_bound}"


decoding = describe(SamplingConfig.from_hf_dict(json.loads((model / "generation_config.json").read_text())))
released = describe(SamplingConfig())  # what training writes: the released generation_config's values
for mode, label in (("diffusion", "diffusion (shipped)"), ("diffusion-clamped", "diffusion, givens clamped"),
                    ("diffusion-int8", "diffusion, int8 weights"),
                    ("diffusion-released", "diffusion, released decoding"),
                    ("diffusion-compare", f"diffusion at step {compare_step}"),
                    ("ar", f"autoregressive baseline at step {ar_step} (dgemma/assets/sudoku-ar)")):
    for bucket in ("easy", "medium", "hard"):
        f = folder / "eval" / f"{mode}-{bucket}.json"
        if f.is_file() and f.read_text().strip():
            rows.append((label, bucket, json.loads(f.read_text())))

offset = int(os.environ.get("STEP_OFFSET", "0"))  # a second stage counts on from stage 1's last step
step = state.get("step", 0) + offset
stages = f" ({offset:,} in stage 1 + {state.get('step', 0):,} in stage 2)" if offset else ""
print(f"# Sudoku results: the shipped model at step {step:,}{stages}\n")
print("Made by `scripts/ship_sudoku.sh` (the models come from `scripts/train_sudoku.sh`); every row is one "
      "`dgemma sudoku eval --file test_<bucket>.txt --batch 100 --seed 0` run, whose JSON line is in `eval/`.\n")
print("Held-out puzzles, generated with a unique solution, disjoint from the training set up to symmetry; "
      "solved = a complete valid grid keeping every given, checked independently of any stored answer. "
      f"Single shot, seed 0, the shipped sampler settings ({decoding}; chosen on separate validation "
      f"puzzles, see `decoding.json`) in every row except \"released decoding\" (the checkpoint's own "
      f"settings, DiffusionGemma's released values: {released}) and the autoregressive baseline "
      "(greedy, left to right).\n")
print("| decoding | bucket | solved | accuracy (95% Wilson) | cell acc. | blank-cell acc. | givens kept | "
      "steps | cells/forward | accepted later changed |")
print("|---|---|---|---|---|---|---|---|---|---|")
for label, bucket, r in rows:
    lo, hi = r["ci95"]
    steps = f"{r['mean_denoising_steps']:.1f}" if "mean_denoising_steps" in r else "81 (1 token each)"
    tpf = f"{r['tokens_per_forward']:.1f}" if "tokens_per_forward" in r else "1"
    changed = f"{100 * r['accepted_later_changed']:.1f}%" if "accepted_later_changed" in r else "-"
    print(f"| {label} | {bucket} | {r['solved']}/{r['total']} | {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | "
          f"{r['cell_accuracy']:.3f} | {r['blank_accuracy']:.3f} | {r['givens_kept']:.3f} | {steps} | {tpf} | {changed} |")
print("\n`eval/settle-<bucket>.png`: per cell, the mean denoising step from which a blank cell stayed accepted "
      "with its final digit (the order in which cells get fixed); "
      "`loss.png` and `training-metrics.jsonl`: the training curve (`ar-*`: the AR baseline's); "
      "`trainer_state*.json`: each run's settings; `scripts/train_sudoku.sh` + `scripts/sudoku-model.json`: "
      "the exact recipe (seed 0).")
