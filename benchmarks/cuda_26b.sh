#!/usr/bin/env bash
# The published comparison point: DiffusionGemma 26B-A4B, batch 1, fixed 16 steps per 256-token canvas
# (vLLM: 1,288 tok/s on one H200, 1,008 on one H100, FP8). Random bf16 weights, the real shape; needs a
# GPU with ~60 GB free. transformers at this size takes minutes per canvas, so it is left out. --compile
# adds the compiled engine next to the eager one (inductor's kernels; the routed experts stay one op).
set -euo pipefail
dgemma bench --config diffusiongemma-26b-a4b --device cuda --dtype bf16 --batch 1,4 --steps 16 \
  --prompt-len 128 --no-transformers --repeats 2 --compile --plot bench-26b.png "$@"
