#!/usr/bin/env bash
# Does the shipped sudoku model underfit or overfit? Single shot on puzzles it was trained on against unseen
# validation puzzles with the same number of givens: if it solves its own training puzzles about as often
# as new ones, it has not memorised them, and more capacity and training (not more data) is the lever.
#
#   bash scripts/sudoku_fit_check.sh [DATA (default runs/sudoku-data-v3)] [MODEL (default: the shipped one)]
#
# Prints one line per set (solved / puzzles, cell accuracy). Eager, seed 0, 128 puzzles per set at most.
set -euo pipefail
DATA=${1:-runs/sudoku-data-v3}
MODEL=${2:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python - "$DATA" "$TMP" <<'PY'
import sys
data, out = sys.argv[1:]
def givens(line):
    return 81 - sum(c in "0." for c in line.split(",")[0])
sets = {"train_low-24-27": ("train_low.txt", 24, 27), "val_hard-24-27": ("val_hard.txt", 24, 27),
        "train_low-22-23": ("train_low.txt", 22, 23), "val_minimal-22-23": ("val_minimal.txt", 22, 23)}
for name, (file, lo, hi) in sets.items():
    rows = [l.strip() for l in open(f"{data}/{file}") if l.strip() and lo <= givens(l) <= hi][:128]
    open(f"{out}/{name}.txt", "w").write("\n".join(rows) + "\n")
PY
for name in train_low-24-27 val_hard-24-27 train_low-22-23 val_minimal-22-23; do
    dgemma sudoku eval --file "$TMP/$name.txt" --batch 64 --eager --seed 0 ${MODEL:+--model "$MODEL"} 2>/dev/null \
        | tail -n 1 | python -c "import json, sys; d = json.load(sys.stdin); print(f\"$name: {d['solved']}/{d['total']} solved ({100 * d['accuracy']:.1f}%), cells {d['cell_accuracy']:.3f}\")"
done
