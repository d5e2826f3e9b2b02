#!/usr/bin/env bash
# Ship the models of stage 3 (the whole range of givens: STAGE=3 scripts/train_sudoku.sh and its AR twin) and
# measure them.
#   scripts/ship_sudoku_range.sh STEP [DIFFUSION_RUN] [AR_RUN]   (runs: runs/sudoku-{diffusion,ar}-stage3)
# Exports both runs' checkpoints at STEP (`dgemma export`): the diffusion model into dgemma/assets/sudoku with
# the decoding of scripts/sudoku-decoding.json written into its generation_config.json, the AR model into
# dgemma/assets/sudoku-ar; both runs' training logs and settings up to STEP go to results/sudoku/stage3/. Then, unless
# EVAL=0, scripts/sudoku_search_eval.sh measures the shipped pair into results/sudoku/search (DATA, N,
# BUDGETS, BUCKETS, SPEED and PREFIX pass through) and scripts/sudoku_search_results.py prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?the step of the checkpoints to ship}
RUN=${2:-runs/sudoku-diffusion-stage3}
AR_RUN=${3:-runs/sudoku-ar-stage3}
DATA=${DATA:-runs/sudoku-data-v3}
LOGS=results/sudoku/stage3
for pair in "$RUN:dgemma/assets/sudoku" "$AR_RUN:dgemma/assets/sudoku-ar"; do
  src=${pair%%:*} dest=${pair#*:}
  dgemma export "$src" --step "$STEP" --out "$dest.tmp"
  chmod 644 "$dest.tmp"/*
  echo '{"task": "sudoku"}' > "$dest.tmp/dgemma_task.json"
done
python scripts/write_decoding.py dgemma/assets/sudoku.tmp/generation_config.json scripts/sudoku-decoding.json >/dev/null
rm -rf dgemma/assets/sudoku && mv dgemma/assets/sudoku.tmp dgemma/assets/sudoku
rm -rf dgemma/assets/sudoku-ar && mv dgemma/assets/sudoku-ar.tmp dgemma/assets/sudoku-ar
rm -rf "$LOGS" && mkdir -p "$LOGS"
for pair in "$RUN:diffusion" "$AR_RUN:ar"; do
  run=${pair%%:*} name=${pair#*:}
  state=$run/checkpoints/step-$(printf %07d "$STEP")/trainer_state.json
  cp "$state" "$LOGS/trainer_state-$name.json"
  python - "$run/metrics.jsonl" "$state" "$LOGS" "$name" <<'PY'
import json, sys
from pathlib import Path
from dgemma.training.progress import plot_loss
metrics, state, dest, name = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
last = json.loads(state.read_text())["step"]  # a run that went on past the shipped step logs on
rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
rows = [r for r in rows if r["step"] <= last]
(dest / f"training-metrics-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
plot_loss(rows, dest / f"loss-{name}.png", title=f"{name} training loss, stage 3 (whole range of givens)")
PY
done
if [ "${EVAL:-1}" != 0 ]; then
  scripts/sudoku_search_eval.sh "$DATA" results/sudoku/search
  python scripts/sudoku_search_results.py results/sudoku/search
fi
ls -la dgemma/assets/sudoku dgemma/assets/sudoku-ar "$LOGS"
