#!/usr/bin/env bash
# DiffusionGemma 26B-A4B's shape on one CUDA GPU, random weights: bf16, int8 and int4 at batch 1, 4 and 16,
# fixed 16 denoising steps per 256-token canvas, 128-token prompts; the engine's tokens checked against
# the plain loop; a markdown table of the results. Meant to finish within 10 minutes on an H100 / H200
# (each part has its own time limit and the table keeps whatever finished).
#
#   bash benchmarks/cuda_26b.sh [OUT_DIR] [--tensor-parallel N]     (default: bench-26b-cuda/, one GPU)
#
# --tensor-parallel N splits the model over N GPUs (dgemma starts the N ranks; NCCL): each part then times
# the split engine alone (`dgemma bench --tensor-parallel N`: tokens/s by batch, every rank's memory after
# loading against the plan; each rank makes its slices' random weights itself). bf16 needs ~60/N GB free
# per GPU.
#
# The published point to compare with: vLLM serves DiffusionGemma 26B-A4B at 1,008 tok/s on one H100 and
# 1,288 tok/s on one H200 (batch 1, FP8, fixed 16 steps). transformers takes minutes per canvas at this
# size, and AR decoding (256 forwards per canvas) would not fit the 10 minutes with the rest: both are
# left out (drop `--no-ar` below to time AR beside the engine).
#
# Needs a GPU with ~60 GB free for bf16 (50 GB of weights). Python: $PYTHON, else .venv/bin/python, else
# python3; if its torch has no CUDA, a venv (.venv-cuda) is made with torch from the PyTorch index and
# dgemma installed into it (needs the network once).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench-26b-cuda
TP=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --tensor-parallel) TP=(--tensor-parallel "$2"); shift 2 ;;
    *) OUT=$1; shift ;;
  esac
done
mkdir -p "$OUT"
PY=${PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=.venv/bin/python
PY=${PY:-python3}

has_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if ! has_cuda "$PY"; then
  echo "== $PY has no CUDA torch: making .venv-cuda" >&2
  python3 -m venv .venv-cuda
  .venv-cuda/bin/pip install -q --upgrade pip
  .venv-cuda/bin/pip install -q torch --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
  PY=.venv-cuda/bin/python
fi
# dgemma's own dependencies (and triton, which a CUDA torch wheel brings) from the checkout
"$PY" -c 'import dgemma, safetensors, rich' 2>/dev/null || "$PY" -m pip install -q -e .
"$PY" - <<'EOF' | tee "$OUT/environment.txt"
import torch
from torch.utils._triton import has_triton
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB, triton {has_triton()}")
EOF

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
COMMON=(--config diffusiongemma-26b-a4b --device cuda --batch 1,4,16 --steps 16 --prompt-len 128
        --no-transformers --no-adaptive --no-startup --repeats 1 --check-tokens ${TP[@]+"${TP[@]}"})
part() {  # part NAME SECONDS ARGS...: one bench process; its JSON line (the last of stdout) goes to NAME.json
  local name=$1 limit=$2; shift 2
  echo "== $name (at most ${limit}s): dgemma bench ${COMMON[*]} $*" >&2
  local start=$SECONDS
  if timeout --signal=INT --kill-after=20 "$limit" "$PY" -m dgemma bench "${COMMON[@]}" "$@" \
       > "$OUT/$name.log" 2> "$OUT/$name.err"; then
    tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  else
    echo "   $name stopped (exit $?; time limit or error): see $OUT/$name.err" >&2
  fi
  echo "   $name: $((SECONDS - start)) s" >&2
}
# bf16: the eager engine, then compiled (mode "default" on CUDA)
part bf16 360 --dtype bf16 --with-eager --no-ar --plot "$OUT/bf16.png"
# weight-only int8 / int4: the eager engine (the quantised experts' GPU path is the thing to measure)
part int8 90 --dtype bf16 --quantize int8 --eager --no-ar
part int4 90 --dtype bf16 --quantize int4 --eager --no-ar

"$PY" - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| weights | engine | batch | tokens/s | ms/step | GPU peak GiB | rows = plain loop | token agreement |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for name in ("bf16", "int8", "int4"):
    path = out / f"{name}.json"
    if not path.is_file():
        print(f"| {name} | did not finish (see {name}.err) | | | | | | |")
        continue
    result = json.loads(path.read_text())
    if "tensor_parallel" in result:  # the split engine alone (--tensor-parallel)
        plan = result["plan_weight_bytes_per_rank"] / 2**30
        peak = max(m["peak_rss_after_load"] for m in result["memory_per_rank"]) / 2**30
        for r in result["results"]:
            print(f"| {name} | engine, {result['tensor_parallel']} ranks (plan {plan:.1f} GiB a rank, host peak "
                  f"{peak:.1f} GiB) | {r['batch']} | {r['tokens_per_s']:,.0f} | - | - | - | - |")
        continue
    check = result.get("tokens_check", {})
    for r in result["results"]:
        c = check.get(str(r["batch"]), {}) if r["system"].startswith("engine") else {}
        peak = f"{r['gpu_peak_bytes'] / 2**30:.1f}" if r.get("gpu_peak_bytes") else "-"
        ms = f"{r['ms_per_step']:.1f}" if r.get("ms_per_step") else "-"
        rows = f"{c['rows_equal']}/{c['rows']}" if c else "-"
        agreement = f"{100 * c['token_agreement']:.1f}%" if c else "-"
        print(f"| {name} | {r['system']} ({r['group']}) | {r['batch']} | {r['tokens_per_s']:,.0f} | {ms} | {peak} | {rows} | {agreement} |")
print()
print("vLLM, published: 1,008 tok/s (H100), 1,288 tok/s (H200), batch 1, FP8, fixed 16 steps.")
EOF
