"""Training steps per second of the sudoku recipe: the step as it ran before training compiled (eager, bf16
autocast: the recipe's old `--precision bf16`), eager at the recipe's precision now (`--precision auto`:
bf16 where the CPU multiplies it natively, else fp32) and the default (compiled, auto), in one run: the
same seed, data and settings.

The recipe is scripts/train_sudoku.sh's stage 1: the 2.2M-parameter model of scripts/sudoku-model.json
from scratch, batch 64, the encoder's next-token loss off, AdamW at peak 1e-3. The data is N generated
puzzles (seed 0), written once to a temporary folder. Each system is one `dgemma train` process (the real
command), logging every 10 steps; the systems run one after the other, in the order given, `--rounds`
times (turn about, so a change in the machine's load touches them all).

    python benchmarks/train_step.py                  # eager:bf16 (before), eager:auto, compiled:auto
    python benchmarks/train_step.py --systems eager:fp32 compiled:fp32 eager:bf16 compiled:bf16
    python benchmarks/train_step.py --systems default:bf16 old:bf16 --cold-cache --old-code /tmp/f15729f

Systems: `eager` (--eager), `compiled` (--compile), `default` (no flag: the compile policy chooses by the
run's length and the cache), `old` (the code at --old-code, e.g. a `git worktree add` of an old commit,
run from that folder with no compile flag). `--cold-cache` gives every process an empty compile cache.

Per system: the precision it ran in, the first 10 steps' seconds (a compiled run compiles there), steps/s
over steps 11-N (the steady rate) and over all N, the final loss (the mean over the last 10 steps), and
ratios against the round's first system and against the round's eager run at the same precision. A
table, then one JSON line last.
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


def run_system(system: str, data: Path, work: Path, steps: int, *, old_code: str | None = None,
               cold_cache: bool = False) -> dict:
    """One `dgemma train` run; system = "eager:bf16", "compiled:auto", "default:auto" (no flag: the
    compile policy decides), "old:bf16" (the code at --old-code, run as it was: no compile flag)."""
    mode, precision = system.split(":")
    out = work / f"{mode}-{precision}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dgemma", "train", *RECIPE, "--data", str(data), "--out", str(out),
           "--steps", str(steps), "--save-every", str(steps), "--precision", precision]
    if mode in ("eager", "compiled"):
        cmd.append(f"--{mode}" if mode == "eager" else "--compile")
    env = {k: v for k, v in os.environ.items() if k != "DGEMMA_EAGER"}
    if mode == "old":
        if old_code is None:
            raise SystemExit("old:PRECISION needs --old-code DIR (e.g. a `git worktree add` of the old commit)")
        env["PYTHONPATH"] = old_code
    if cold_cache:  # an empty compile cache for this process: what a newcomer's first run meets
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cache-", dir=work)
    started = time.perf_counter()
    # the old code runs from its own folder: `python -m` puts the working directory first on the path
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          cwd=old_code if mode == "old" else None)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{system}: dgemma train failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["elapsed_s"] for r in records}
    first, last = 10, steps
    started_line = next(line for line in proc.stderr.splitlines() if line.startswith("training "))
    return {"system": system, "ran_in": started_line.rsplit(", ", 1)[1], "first_10_s": at[first],
            "started": started_line.split(" on cpu, ", 1)[-1], "elapsed_s": at,
            "steady_steps_per_s": (last - first) / (at[last] - at[first]), "steps_per_s": last / at[last],
            "final_loss": records[-1]["loss"], "process_s": round(wall, 1),
            "warning": next((line for line in proc.stderr.splitlines() if line.startswith("warning")), None)}


def _ratios(round_runs: list[dict]):
    """Each run of a round against the round's first run and its eager run in the same precision."""
    for r in round_runs:
        eager = next((e for e in round_runs if e["system"].startswith("eager:") and e["ran_in"] == r["ran_in"]),
                     None)
        for key, reference in (("first", round_runs[0]), ("eager", eager)):
            r[f"x_{key}_steady"] = r["steady_steps_per_s"] / reference["steady_steps_per_s"] if reference else None
            r[f"x_{key}_all"] = r["steps_per_s"] / reference["steps_per_s"] if reference else None
        r["loss_vs_first"] = r["final_loss"] / round_runs[0]["final_loss"] - 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["eager:bf16", "eager:auto", "compiled:auto"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--puzzles", type=int, default=640, help="generated training puzzles (default 640)")
    p.add_argument("--rounds", type=int, default=1, help="times each system runs, turn about")
    p.add_argument("--old-code", metavar="DIR", help="the package root that old:PRECISION runs (its PYTHONPATH)")
    p.add_argument("--cold-cache", action="store_true",
                   help="each run starts from an empty compile cache (TORCHINDUCTOR_CACHE_DIR in a fresh folder)")
    args = p.parse_args(argv)
    if args.steps < 20 or args.steps % 10:
        raise SystemExit("--steps must be a multiple of 10, at least 20")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="dgemma-train-bench-") as tmp:
        work = Path(tmp)
        write_puzzles(work / "train.jsonl", args.puzzles)
        for _ in range(args.rounds):
            rounds.append([run_system(s, work / "train.jsonl", work, args.steps, old_code=args.old_code,
                                      cold_cache=args.cold_cache) for s in args.systems])
            _ratios(rounds[-1])
    n = args.steps

    def x(value):
        return f"{value:.2f}" if value is not None else "-"

    print(f"{'round':>5} {'system':<15} {'ran in':<14} {'first 10 s':>10} {f'steps/s 11-{n}':>13} "
          f"{'steps/s all':>11} {'x first, 11-' + str(n):>15} {'x first, all':>12} {'x eager, 11-' + str(n):>15} "
          f"{'x eager, all':>12} {'final loss':>10}")
    for i, runs in enumerate(rounds, 1):
        for r in runs:
            print(f"{i:>5} {r['system']:<15} {r['ran_in']:<14} {r['first_10_s']:>10.1f} "
                  f"{r['steady_steps_per_s']:>13.3f} {r['steps_per_s']:>11.3f} {x(r['x_first_steady']):>15} "
                  f"{x(r['x_first_all']):>12} {x(r['x_eager_steady']):>15} {x(r['x_eager_all']):>12} "
                  f"{r['final_loss']:>10.4f}")
            if r["warning"]:
                print(f"      {r['system']}: {r['warning']}")
    print(json.dumps({"benchmark": "train_step", "steps": args.steps, "puzzles": args.puzzles,
                      "threads": os.environ.get("OMP_NUM_THREADS"), "rounds": rounds}))


if __name__ == "__main__":
    main()
