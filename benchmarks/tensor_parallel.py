"""1 rank against N ranks, side by side: `dgemma bench --tensor-parallel 1` and `--tensor-parallel N` on the same
model folder, alternated for a few rounds (timings on a shared machine drift: alternating keeps the drift
out of the ratio). Prints a table and, last, one JSON line: tokens/s per batch size (the best round) and
each rank's memory after loading (peak RSS growth, private growth) against the plan.

    python benchmarks/tensor_parallel.py [--model DIR] [--ranks 2] [--rounds 2] [-- more dgemma bench flags]

Without --model, the bench-20m preset's random weights are written to a temporary folder first (the
ranks then read their slices from its shard, as they would from a real checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def bench(model: str, ranks: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dgemma", "bench", "--model", model, "--tensor-parallel", str(ranks), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("extra", nargs="*", help="dgemma bench flags (after --)")
    args = p.parse_args()
    extra = args.extra or ["--batch", "1,4", "--steps", "16", "--repeats", "1", "--dtype", "fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            import dgemma
            from dgemma.weights.random_weights import random_model

            model = f"{tmp}/bench-20m"
            dgemma.save_pretrained(random_model(dgemma.get_preset("bench-20m")), model)
        runs = {1: [], args.ranks: []}
        for _ in range(args.rounds):
            for ranks in runs:
                runs[ranks].append(bench(model, ranks, extra))
    mb = 2**20
    print(f"{'ranks':>5} {'batch':>5} {'tokens/s':>9}   per-rank memory after loading (MB): "
          "peak growth / private / plan")
    summary = {}
    for ranks, results in runs.items():
        best = {}
        for result in results:
            for row in result["results"]:
                best[row["batch"]] = max(best.get(row["batch"], 0.0), row["tokens_per_s"])
        last = results[-1]
        memory = [(m["peak_rss_after_load"] - m["rss_before_load"], m["private_growth"])
                  for m in last["memory_per_rank"]]
        plan = last["plan_weight_bytes_per_rank"]
        text = ", ".join(f"{g / mb:.0f} / {p / mb:.0f} / {plan / mb:.0f}" for g, p in memory)
        for batch, tps in sorted(best.items()):
            print(f"{ranks:>5} {batch:>5} {tps:>9.1f}   {text}")
        summary[ranks] = {"tokens_per_s": best, "memory_per_rank": last["memory_per_rank"], "plan": plan}
    ratios = {b: summary[args.ranks]["tokens_per_s"][b] / tps for b, tps in summary[1]["tokens_per_s"].items()}
    print(f"tokens/s ratio, {args.ranks} ranks / 1: " + ", ".join(f"batch {b}: {r:.2f}" for b, r in ratios.items()))
    print(json.dumps({"bench_flags": extra, "rounds": args.rounds, "runs": summary, "ratio": ratios}))


if __name__ == "__main__":
    main()
