#!/usr/bin/env bash
# The acceptance orders (entropy, margin, confidence) on the shipped sudoku model: validation first (to
# choose the order), then the held-out test sets, single shot and with the 8 x 8 verifier search.
# One JSON line per run in OUT:  <val|test>-<order>-<RxC>-<bucket>.json  (RxC: rounds x candidates)
#   scripts/sudoku_order_eval.sh [DATA] [OUT]
# DATA holds val_<bucket>.txt and test_<bucket>.txt (`dgemma sudoku prepare ... --validation N`).
# STAGE=val or test (default both); VAL_N, TEST_N, SEARCH_N: puzzles per bucket (defaults 64, 100, 12);
# ORDERS, VAL_BUCKETS, BUCKETS choose the rest. `python scripts/sudoku_order_results.py OUT` prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-runs/sudoku-data-v3}
OUT=${2:-results/sudoku/orders}
ORDERS=${ORDERS:-entropy margin confidence}
VAL_BUCKETS=${VAL_BUCKETS:-medium hard minimal}
BUCKETS=${BUCKETS:-easy medium hard minimal}
MODEL=${MODEL:-dgemma/assets/sudoku}
mkdir -p "$OUT"
run() {  # run NAME ARGS...: one eval, its JSON line to OUT/NAME.json
  local name=$1; shift
  [ -s "$OUT/$name.json" ] && return 0  # done before: an interrupted run resumes
  ${PREFIX:-} dgemma sudoku eval --model "$MODEL" --batch 64 --seed 0 "$@" | tail -1 > "$OUT/$name.json.tmp"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}
if [ "${STAGE:-both}" != test ]; then
  for order in $ORDERS; do
    for bucket in $VAL_BUCKETS; do
      run "val-$order-1x1-$bucket" --file "$DATA/val_$bucket.txt" --limit "${VAL_N:-64}" --accept-order "$order"
    done
  done
fi
if [ "${STAGE:-both}" != val ]; then  # every single shot first, then the searches
  for order in $ORDERS; do
    for bucket in $BUCKETS; do
      run "test-$order-1x1-$bucket" --file "$DATA/test_$bucket.txt" --limit "${TEST_N:-100}" --accept-order "$order"
    done
  done
  for order in $ORDERS; do
    for bucket in $BUCKETS; do
      run "test-$order-8x8-$bucket" --file "$DATA/test_$bucket.txt" --limit "${SEARCH_N:-12}" --accept-order "$order" \
        --rounds 8 --candidates 8
    done
  done
fi
