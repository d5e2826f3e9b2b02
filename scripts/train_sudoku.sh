#!/usr/bin/env bash
# The exact recipe behind the shipped sudoku model (dgemma/assets/sudoku) and its AR baseline
# (dgemma/assets/sudoku-ar); scripts/ship_sudoku.sh copies them there and measures them.
#
#   stage 1  from scratch, seed 0: the 20,000 puzzles x 5 fixed symmetries of `dgemma sudoku prepare`,
#            a 6,000-step cosine (peak 1e-3) stopped at step 4,750 (--until).
#   stage 2  from stage 1's weights, seed 1: a fresh random symmetry of every example at every step
#            (--augment sudoku), a new 3,500-step cosine (peak 4e-4, 100 warmup steps) stopped at step
#            3,000 (UNTIL2; lr there is 6e-5 against the 4e-5 floor).
#
#   stage 3  the whole range of givens: from stage 2's weights (INIT3), seed 2, on DATA3 = the same 20,000
#            puzzles plus 3,000 with 22-27 givens (x4 symmetric copies each, 37.5% of the lines),
#            fresh random symmetries at every step, a new cosine from 3e-4 over STEPS3 = 1,200 steps
#            (UNTIL3 stops early).
#            The AR baseline gets the same stage from its own weights: OBJECTIVE=ar STAGE=3
#            INIT3=<the AR model> (the same data in the same order, the same steps).
#
#   stage cache-aware  (STAGE=cache-aware) a model trained to read the step cache's kept keys/values: from the
#            shipped model (INIT_CA, default dgemma/assets/sudoku), seed 3, on DATA3 with --cache-aware 0.5
#            (docs/training.md), a new cosine from 1e-4 over STEPS_CA = 400 steps (20 warmup steps), bf16
#            autocast. About 1.1x a plain step: ~23 minutes on the idle 2 cores. Its export turns the step cache on
#            (its generation_config.json says how it was trained); benchmarks/README.md measures it.
#
# The AR baseline is stage 1 with OBJECTIVE=ar UNTIL=1500 STAGE=1: the same data in the same order for the
# same number of steps as the diffusion model at step 1,500 (its checkpoint is the like-for-like comparison).
# STAGE=1, 2, 3, cache-aware or all (default: 1 and 2). Resumable: rerun the same command with RESUME=1 after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-runs/sudoku-data}
STAGE=${STAGE:-all}
OBJECTIVE=${OBJECTIVE:-diffusion}
UNTIL=${UNTIL:-4750}
UNTIL2=${UNTIL2:-3000}
OUT=${OUT:-runs/sudoku-$OBJECTIVE}
OUT2=${OUT2:-runs/sudoku-$OBJECTIVE-stage2}
DATA3=${DATA3:-runs/sudoku-data-v3}
INIT3=${INIT3:-$OUT2/checkpoints/step-$(printf %07d "$UNTIL2")/model}
STEPS3=${STEPS3:-1200}
UNTIL3=${UNTIL3:-$STEPS3}
OUT3=${OUT3:-runs/sudoku-$OBJECTIVE-stage3}
INIT_CA=${INIT_CA:-dgemma/assets/sudoku}
STEPS_CA=${STEPS_CA:-400}
OUT_CA=${OUT_CA:-runs/sudoku-cache-aware}
[ "$STAGE" = 3 ] || [ "$STAGE" = cache-aware ] || [ -f "$DATA/train.jsonl" ] || dgemma sudoku prepare --out "$DATA" --train 20000 --augment 4 --per-bucket 300 --validation 300 --seed 0
COMMON=(--objective "$OBJECTIVE" --eos-id 1 --batch-size 64 --precision auto
        --encoder-loss-weight 0 --save-every "${SAVE_EVERY:-250}" --keep-checkpoints "${KEEP:-2}" ${RESUME:+--resume})
if [ "$STAGE" = 1 ] || [ "$STAGE" = all ]; then
  dgemma train --init scripts/sudoku-model.json --data "$DATA/train.jsonl" "${COMMON[@]}" --steps 6000 --until "$UNTIL" \
    --lr 1e-3 --min-lr 1e-4 --warmup-steps 200 --seed 0 --out "$OUT"
fi
if [ "$STAGE" = 2 ] || [ "$STAGE" = all ]; then
  dgemma train --model "$OUT/checkpoints/step-$(printf %07d "$UNTIL")/model" --data "$DATA/train.jsonl" "${COMMON[@]}" --augment sudoku \
    --steps 3500 --until "$UNTIL2" --lr 4e-4 --min-lr 4e-5 --warmup-steps 100 --seed 1 --out "$OUT2"
fi
if [ "$STAGE" = 3 ]; then
  [ -f "$DATA3/train.jsonl" ] || dgemma sudoku prepare --out "$DATA3" --train 20000 --augment 0 --per-bucket 300 \
    --validation 300 --minimal 100 --minimal-validation 40 --low-train 3000 --low-augment 3 --workers 2 --seed 0
  dgemma train --model "$INIT3" --data "$DATA3/train.jsonl" "${COMMON[@]}" --augment sudoku \
    --steps "$STEPS3" --until "$UNTIL3" --lr 3e-4 --min-lr 3e-5 --warmup-steps 50 --seed 2 --out "$OUT3"
fi
if [ "$STAGE" = cache-aware ]; then
  [ -f "$DATA3/train.jsonl" ] || { echo "STAGE=cache-aware reads $DATA3/train.jsonl: run STAGE=3 first (it writes it)" >&2; exit 2; }
  dgemma train --model "$INIT_CA" --data "$DATA3/train.jsonl" "${COMMON[@]}" --augment sudoku --cache-aware 0.5 \
    --steps "$STEPS_CA" --lr 1e-4 --min-lr 1e-5 --warmup-steps 20 --seed 3 --out "$OUT_CA"
fi
