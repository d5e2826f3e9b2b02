#!/usr/bin/env bash
# The exact recipe behind the shipped sudoku model (dgemma/assets/sudoku) and its AR baseline.
# Both runs see the same data in the same order (same --seed) for the same number of optimizer steps.
# Resumable: rerun the same command with RESUME=1 after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-runs/sudoku-data}
STEPS=${STEPS:-3000}
OBJECTIVE=${OBJECTIVE:-diffusion}
OUT=${OUT:-runs/sudoku-$OBJECTIVE}
[ -f "$DATA/train.jsonl" ] || dgemma sudoku prepare --out "$DATA" --train 20000 --augment 4 --per-bucket 300 --seed 0
dgemma train --init scripts/sudoku-model.json --objective "$OBJECTIVE" --data "$DATA/train.jsonl" --eos-id 1 \
  --steps "$STEPS" --batch-size 64 --lr 1e-3 --min-lr 1e-4 --warmup-steps 200 --precision bf16 \
  --encoder-loss-weight 0 --seed 0 --save-every 250 --keep-checkpoints 2 --out "$OUT" ${RESUME:+--resume}
