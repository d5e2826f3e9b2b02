"""Training steps per second of the sudoku recipe, compiled (the default) against eager (`--eager`, the
code path as it ran before training compiled), in one run: the same seed, data and settings.

The recipe is scripts/train_sudoku.sh's stage 1: the 2.2M-parameter model of scripts/sudoku-model.json
from scratch, batch 64, bf16 autocast, the encoder's next-token loss off, AdamW at peak 1e-3. The data
is N generated puzzles (seed 0), written once to a temporary folder. Each system is one `dgemma train`
process (the real command), logging every 10 steps; the systems run one after the other, in the order
given, `--rounds` times (turn about, so a change in the machine's load touches both).

    python benchmarks/train_step.py                       # 30 steps: eager bf16 against compiled bf16
    python benchmarks/train_step.py --systems eager:bf16 compiled:bf16 eager:fp32 compiled:fp32

Per system: the first 10 steps' seconds (a compiled run compiles there), steps/s over steps 11-30 (the
steady rate) and over all 30, and the final loss (the mean over the last 10 steps). A table, then one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--init", str(ROOT / "scripts/sudoku-model.json"), "--eos-id", "1", "--batch-size", "64",
          "--encoder-loss-weight", "0", "--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "200", "--seed", "0",
          "--log-every", "10", "--no-progress", "--keep-checkpoints", "1"]


def write_puzzles(path: Path, count: int):
    from dgemma.tasks import sudoku

    lines = [json.dumps({"prompt_ids": sudoku.encode_prompt(ex.puzzle), "response_ids": sudoku.encode_solution(
        ex.solution)}) + "\n" for ex in sudoku.generate_examples(count, seed=0)]
    path.write_text("".join(lines))


def run_system(system: str, data: Path, work: Path, steps: int) -> dict:
    """One `dgemma train` run; system = "eager:bf16", "compiled:fp32", ..."""
    mode, precision = system.split(":")
    out = work / f"{mode}-{precision}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dgemma", "train", *RECIPE, "--data", str(data), "--out", str(out),
           "--steps", str(steps), "--save-every", str(steps), "--precision", precision]
    if mode == "eager":
        cmd.append("--eager")
    env = {k: v for k, v in os.environ.items() if k != "DGEMMA_EAGER"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{system}: dgemma train failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["elapsed_s"] for r in records}
    first, last = 10, steps
    return {"system": system, "first_10_s": at[first], "steady_steps_per_s": (last - first) / (at[last] - at[first]),
            "steps_per_s": last / at[last], "final_loss": records[-1]["loss"], "process_s": round(wall, 1),
            "warning": next((line for line in proc.stderr.splitlines() if line.startswith("warning")), None)}


def _reference(runs: list[dict], run: dict) -> dict:
    """What a run is compared with: the first eager run in its precision, else the first run."""
    precision = run["system"].split(":")[1]
    return next((r for r in runs if r["system"] == f"eager:{precision}"), runs[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["eager:bf16", "compiled:bf16"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--puzzles", type=int, default=640, help="generated training puzzles (default 640)")
    p.add_argument("--rounds", type=int, default=1, help="times each system runs, turn about")
    args = p.parse_args(argv)
    if args.steps < 20 or args.steps % 10:
        raise SystemExit("--steps must be a multiple of 10, at least 20")
    with tempfile.TemporaryDirectory(prefix="dgemma-train-bench-") as tmp:
        work = Path(tmp)
        write_puzzles(work / "train.jsonl", args.puzzles)
        runs = [run_system(s, work / "train.jsonl", work, args.steps)
                for _ in range(args.rounds) for s in args.systems]
    print(f"{'system':<16} {'first 10 steps s':>17} {'steps/s 11-' + str(args.steps):>15} "
          f"{'steps/s all':>12} {'x eager, 11-' + str(args.steps):>15} {'x eager, all':>13} {'final loss':>11}")
    for r in runs:
        reference = _reference(runs, r)
        r["x_steady"] = r["steady_steps_per_s"] / reference["steady_steps_per_s"]
        r["x_all"] = r["steps_per_s"] / reference["steps_per_s"]
        r["loss_vs_reference"] = r["final_loss"] / reference["final_loss"] - 1
        print(f"{r['system']:<16} {r['first_10_s']:>17.1f} {r['steady_steps_per_s']:>15.3f} {r['steps_per_s']:>12.3f} "
              f"{r['x_steady']:>15.2f} {r['x_all']:>13.2f} {r['final_loss']:>11.4f}")
        if r["warning"]:
            print(f"  {r['system']}: {r['warning']}")
    print(json.dumps({"benchmark": "train_step", "steps": args.steps, "puzzles": args.puzzles,
                      "threads": os.environ.get("OMP_NUM_THREADS"), "runs": runs}))


if __name__ == "__main__":
    main()
