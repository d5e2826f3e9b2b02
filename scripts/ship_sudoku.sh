#!/usr/bin/env bash
# Copy a training checkpoint into dgemma/assets/sudoku (the model `dgemma sudoku` uses by default) and
# measure it on the held-out bucket sets: plain and clamped decoding, per bucket, JSON kept beside it.
#   scripts/ship_sudoku.sh runs/sudoku-diffusion/checkpoints/step-N [runs/sudoku-ar/checkpoints/step-M/model]
# COMPARE=runs/sudoku-diffusion/checkpoints/step-M/model also measures the diffusion model at the AR step count
# (set COMPARE_STEP and AR_STEP to label the table). CURVE=runs/curve adds the learning curve: the eval
# JSONs of earlier checkpoints (<diffusion|ar>-<step>-<bucket>.json) plus this model's, plotted.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=${1:?checkpoint folder}
AR=${2:-}
DATA=${DATA:-runs/sudoku-data}
DEST=dgemma/assets/sudoku
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp/eval"
cp "$CKPT"/model/config.json "$CKPT"/model/generation_config.json "$CKPT"/model/model.safetensors "$DEST.tmp/"
echo '{"task": "sudoku"}' > "$DEST.tmp/dgemma_task.json"
RUN=$(dirname "$(dirname "$CKPT")")
cp "$RUN/metrics.jsonl" "$DEST.tmp/training-metrics.jsonl"
[ -f "$RUN/loss.png" ] && cp "$RUN/loss.png" "$DEST.tmp/loss.png"
cp "$CKPT/trainer_state.json" "$DEST.tmp/trainer_state.json"
cp scripts/train_sudoku.sh scripts/sudoku-model.json "$DEST.tmp/"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
for bucket in easy medium hard; do
  dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 \
    --plot "$DEST/eval/settle-$bucket.png" | tail -1 > "$DEST/eval/diffusion-$bucket.json"
  dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 --clamp \
    | tail -1 > "$DEST/eval/diffusion-clamped-$bucket.json"
  if [ "$bucket" = easy ]; then  # int8 against fp32 on one bucket
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 --quantize int8 \
      | tail -1 > "$DEST/eval/diffusion-int8-$bucket.json"
  fi
  if [ -n "${COMPARE:-}" ]; then  # another diffusion checkpoint, e.g. at the AR baseline's step count
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$COMPARE" --batch 100 --seed 0 \
      | tail -1 > "$DEST/eval/diffusion-compare-$bucket.json"
  fi
  if [ -n "$AR" ]; then
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$AR" --ar --batch 100 \
      | tail -1 > "$DEST/eval/ar-$bucket.json"
  fi
done
python scripts/sudoku_results.py "$DEST" "${COMPARE_STEP:-?}" "${AR_STEP:-?}" > "$DEST/RESULTS.md"
if [ -n "${CURVE:-}" ]; then
  mkdir -p "$DEST/eval/curve" && cp "$CURVE"/*.json "$DEST/eval/curve/"
  STEP=$(python -c "import json; print(json.load(open('$DEST/trainer_state.json'))['step'])")
  for b in easy medium; do
    cp "$DEST/eval/diffusion-$b.json" "$DEST/eval/curve/diffusion-$STEP-$b.json"
    if [ -n "$AR" ]; then cp "$DEST/eval/ar-$b.json" "$DEST/eval/curve/ar-$AR_STEP-$b.json"; fi
    if [ -n "${COMPARE:-}" ]; then cp "$DEST/eval/diffusion-compare-$b.json" "$DEST/eval/curve/diffusion-$COMPARE_STEP-$b.json"; fi
  done
  { printf '\n## Learning curve\n\n![learning curve](learning-curve.png)\n\n'
    python scripts/sudoku_curve.py "$DEST/eval/curve" "$DEST/learning-curve.png" "${SECONDS_PER_STEP:-1.9}"; } >> "$DEST/RESULTS.md"
fi
ls -la "$DEST" "$DEST/eval"
