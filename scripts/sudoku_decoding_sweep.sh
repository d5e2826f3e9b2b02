#!/usr/bin/env bash
# The validation sweep behind scripts/sudoku-decoding.json: the shipped sudoku model under several sampler
# settings, on the validation puzzles only (never the test sets). Prints one markdown row per setting.
#   scripts/sudoku_decoding_sweep.sh [MODEL]     (default: the checkpoint's own settings are row 1)
# DATA (default runs/sudoku-data) must hold val_<bucket>.txt: dgemma sudoku prepare --validation 300.
# LIMIT=N evaluates the first N puzzles of each file (a quick look; the table in RESULTS.md used all 300).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-dgemma/assets/sudoku}
DATA=${DATA:-runs/sudoku-data}
for b in easy medium; do
  [ -f "$DATA/val_$b.txt" ] || { echo "no $DATA/val_$b.txt: run dgemma sudoku prepare --validation 300" >&2; exit 2; }
done
echo "| T start -> end | steps at most | entropy bound | easy solved | medium solved | medium, mean steps |"
echo "|---|---|---|---|---|---|"
# t_max t_min max_steps entropy_bound
for setting in "0.8 0.4 48 0.1" "1.0 1.0 48 0.1" "1.2 0.8 48 0.1" "1.5 1.0 48 0.1" "2.0 0.4 48 0.1" \
               "2.0 0.4 32 0.1" "2.0 0.4 24 0.1" "2.0 0.5 48 0.3"; do
  set -- $setting
  row="| $1 -> $2 | $3 | $4"
  for b in easy medium; do  # each eval parsed once: "solved/total | mean steps"
    result=$(dgemma sudoku eval --file "$DATA/val_$b.txt" --model "$MODEL" --batch 100 --seed 0 ${LIMIT:+--limit "$LIMIT"} \
             --t-max "$1" --t-min "$2" --steps "$3" --entropy-bound "$4" 2>/dev/null | tail -1 \
             | python -c 'import json, sys; r = json.load(sys.stdin); print("%d/%d | %.1f" % (r["solved"], r["total"], r["mean_denoising_steps"]))')
    row="$row | ${result% | *}"
  done
  echo "$row | ${result#* | } |"  # the last column: medium's (the last bucket's) mean steps
done
