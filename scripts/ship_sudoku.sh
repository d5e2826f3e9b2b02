#!/usr/bin/env bash
# Copy a training checkpoint into dgemma/assets/sudoku (the model `dgemma sudoku` uses by default), and the
# AR baseline's model, if given, into dgemma/assets/sudoku-ar; measure them on the held-out bucket sets
# (plain and clamped decoding, per bucket) and write the results to results/sudoku: the eval JSON lines and
# their tables (TABLES.md) in eval/, the training logs and plots. Only what it makes is replaced there.
#   scripts/ship_sudoku.sh runs/sudoku-diffusion/checkpoints/step-N [runs/sudoku-ar/checkpoints/step-M/model]
# COMPARE=runs/sudoku-diffusion/checkpoints/step-M/model also measures the diffusion model at the AR step count
# (set COMPARE_STEP and AR_STEP to label the table). CURVE=runs/curve adds the learning curve: the eval
# JSONs of earlier checkpoints (<diffusion|ar>-<step>-<bucket>.json) plus this model's, plotted.
# A second-stage checkpoint: STAGE1=<stage 1 run folder> and STEP_OFFSET=<stage 1's last step> count its
# steps from the start of stage 1 and join both stages' training logs.
# DECODING (default scripts/sudoku-decoding.json) sets the shipped model's sampler; the checkpoint's own
# (released) settings are measured too, as "diffusion-released", and they are what the learning curve uses.
# REUSE=<an earlier ship's eval/> copies the AR baseline's results instead of measuring them again.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=${1:?checkpoint folder}
AR=${2:-}
DATA=${DATA:-runs/sudoku-data}
DEST=dgemma/assets/sudoku
AR_DEST=dgemma/assets/sudoku-ar
RESULTS=results/sudoku
rm -rf "$DEST.tmp" "$RESULTS.tmp" && mkdir -p "$DEST.tmp" "$RESULTS.tmp/eval"
cp "$CKPT"/model/config.json "$CKPT"/model/generation_config.json "$CKPT"/model/model.safetensors "$DEST.tmp/"
DECODING=${DECODING:-scripts/sudoku-decoding.json}
# merge the decoding settings into generation_config.json; print them as `dgemma sudoku eval` flags
DECODE_ARGS=$(python scripts/write_decoding.py "$DEST.tmp/generation_config.json" "$DECODING")
cp "$DECODING" "$RESULTS.tmp/decoding.json"
echo '{"task": "sudoku"}' > "$DEST.tmp/dgemma_task.json"
RUN=$(dirname "$(dirname "$CKPT")")
OFFSET=${STEP_OFFSET:-0}
cp "$CKPT/trainer_state.json" "$RESULTS.tmp/trainer_state.json"
if [ -n "${STAGE1:-}" ]; then
  cp "$STAGE1/checkpoints/step-$(printf %07d "$OFFSET")/trainer_state.json" "$RESULTS.tmp/trainer_state-stage1.json"
  python - "$STAGE1/metrics.jsonl" "$RUN/metrics.jsonl" "$OFFSET" "$RESULTS.tmp" <<'PY'
import json, sys
from pathlib import Path
from dgemma.training.progress import plot_loss
first, second, offset, dest = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
last = json.loads((dest / "trainer_state.json").read_text())["step"]  # a run resumed past it logs on
def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
rows = [dict(r, stage=1) for r in records(first) if r["step"] <= offset]
rows += [dict(r, stage=2, step=r["step"] + offset, stage_step=r["step"]) for r in records(second) if r["step"] <= last]
(dest / "training-metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
plot_loss(rows, dest / "loss.png", title=f"diffusion training loss (stage 2 from step {offset})")
PY
else
  cp "$RUN/metrics.jsonl" "$RESULTS.tmp/training-metrics.jsonl"
  [ -f "$RUN/loss.png" ] && cp "$RUN/loss.png" "$RESULTS.tmp/loss.png"
fi
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
if [ -n "$AR" ]; then
  rm -rf "$AR_DEST" && mkdir -p "$AR_DEST"
  cp "$AR"/config.json "$AR"/generation_config.json "$AR"/model.safetensors "$AR_DEST/"
fi
EVAL="$RESULTS.tmp/eval"
for bucket in easy medium hard; do
  dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 \
    --plot "$EVAL/settle-$bucket.png" | tail -1 > "$EVAL/diffusion-$bucket.json"
  dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 --clamp \
    | tail -1 > "$EVAL/diffusion-clamped-$bucket.json"
  if [ "$bucket" = easy ]; then  # int8 against fp32 on one bucket
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$DEST" --batch 100 --seed 0 --quantize int8 \
      | tail -1 > "$EVAL/diffusion-int8-$bucket.json"
  fi
  dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$CKPT/model" --batch 100 --seed 0 \
    | tail -1 > "$EVAL/diffusion-released-$bucket.json"  # the checkpoint's own sampler settings
  if [ -n "${COMPARE:-}" ]; then  # another diffusion checkpoint, e.g. at the AR baseline's step count
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$COMPARE" --batch 100 --seed 0 $DECODE_ARGS \
      | tail -1 > "$EVAL/diffusion-compare-$bucket.json"
  fi
  if [ -n "${REUSE:-}" ]; then  # the AR baseline's results from an earlier ship's eval/
    cp "$REUSE/ar-$bucket.json" "$EVAL/"
  fi
  if [ -n "$AR" ] && [ -z "${REUSE:-}" ]; then
    dgemma sudoku eval --file "$DATA/test_$bucket.txt" --model "$AR_DEST" --ar --batch 100 \
      | tail -1 > "$EVAL/ar-$bucket.json"
  fi
done
# the tables this run measured; results/sudoku/RESULTS.md (written by hand around them) is left as it is
TABLES="$EVAL/TABLES.md"
python scripts/sudoku_results.py "$RESULTS.tmp" "$DEST" "${COMPARE_STEP:-?}" "${AR_STEP:-?}" > "$TABLES"
if [ -n "${CURVE:-}" ]; then
  mkdir -p "$EVAL/curve" && cp "$CURVE"/*.json "$EVAL/curve/"
  STEP=$(python -c "import json; print(json.load(open('$RESULTS.tmp/trainer_state.json'))['step'] + $OFFSET)")
  for b in easy medium; do  # every point of the curve is measured with the checkpoints' released decoding
    cp "$EVAL/diffusion-released-$b.json" "$EVAL/curve/diffusion-$STEP-$b.json"
    cp "$EVAL/diffusion-$b.json" "$EVAL/curve/shipped-$STEP-$b.json"  # and its own decoding, apart
    if [ -n "$AR${REUSE:-}" ]; then cp "$EVAL/ar-$b.json" "$EVAL/curve/ar-$AR_STEP-$b.json"; fi
  done
  { printf '\n## Learning curve\n\nEvery diffusion point is measured with the released decoding (T 0.8 -> 0.4, at most 48 steps), so the points compare with each other; the stars are the shipped model with its shipped decoding.\n\n![learning curve](../learning-curve.png)\n\n'
    python scripts/sudoku_curve.py "$EVAL/curve" "$RESULTS.tmp/learning-curve.png" "${SECONDS_PER_STEP:-1.9}" \
      ${STAGE1:+"$OFFSET"}; } >> "$TABLES"
fi
# replace what this run made, one entry at a time: the folder's other results (search/, stage3/, orders/,
# RESULTS.md) stay
mkdir -p "$RESULTS"
for made in "$RESULTS.tmp"/*; do
  rm -rf "$RESULTS/$(basename "$made")" && mv "$made" "$RESULTS/"
done
rmdir "$RESULTS.tmp"
echo "new tables: $TABLES -> $RESULTS/eval/TABLES.md (copy what changed into $RESULTS/RESULTS.md)"
ls -la "$DEST" ${AR:+"$AR_DEST"} "$RESULTS" "$RESULTS/eval"
