#!/usr/bin/env bash
# The held-out buckets (easy, medium, hard, minimal) single shot and with the verifier search, the diffusion
# model against the AR baseline under the same budget (AR: best of rounds x candidates samples under the
# same rules checker), and seconds per puzzle at batch 1 and 64. One JSON line per run in OUT:
#   <diffusion|ar>-<RxC>-<bucket>.json   (RxC: rounds x candidates; 1x1 = single shot)
#   speed-<diffusion|ar>-batch<B>.json   (medium puzzles, single shot)
#   scripts/sudoku_search_eval.sh [DATA] [OUT]       N puzzles per bucket (default 100)
# Then `python scripts/sudoku_search_results.py OUT` prints the tables and draws OUT/search.png.
# PREFIX runs each eval under a command (e.g. PREFIX="nice -n 10"); MODEL and AR_MODEL
# default to the shipped ones; BUDGETS lists the searches (default "1x1 8x8"), BUCKETS the buckets (empty: none),
# MODELS the models (default "diffusion ar").
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-runs/sudoku-data-v3}
OUT=${2:-results/sudoku/search}
N=${N:-100}
MODEL=${MODEL:-dgemma/assets/sudoku}
AR_MODEL=${AR_MODEL:-dgemma/assets/sudoku-ar}
BUDGETS=${BUDGETS-1x1 8x8}
BUCKETS=${BUCKETS-easy medium hard minimal}
MODELS=${MODELS-diffusion ar}
mkdir -p "$OUT"
run() {  # run NAME ARGS...: one eval, its JSON line to OUT/NAME.json
  local name=$1; shift
  ${PREFIX:-} dgemma sudoku eval "$@" --seed 0 | tail -1 > "$OUT/$name.json.tmp" && mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}
for bucket in $BUCKETS; do
  for budget in $BUDGETS; do
    search=(--rounds "${budget%x*}" --candidates "${budget#*x}")
    if [[ " $MODELS " == *" diffusion "* ]]; then
      run "diffusion-$budget-$bucket" --file "$DATA/test_$bucket.txt" --limit "$N" --batch 64 --model "$MODEL" "${search[@]}"
    fi
    if [[ " $MODELS " == *" ar "* ]]; then
      run "ar-$budget-$bucket" --file "$DATA/test_$bucket.txt" --limit "$N" --batch 64 --ar --model "$AR_MODEL" "${search[@]}"
    fi
  done
done
if [ -n "${SPEED:-}" ]; then  # seconds per puzzle, single shot, batch 1 and 64
  for batch in 1 64; do
    run "speed-diffusion-batch$batch" --file "$DATA/test_medium.txt" --limit "$SPEED" --batch "$batch" --model "$MODEL"
    run "speed-ar-batch$batch" --file "$DATA/test_medium.txt" --limit "$SPEED" --batch "$batch" --ar --model "$AR_MODEL"
  done
fi
