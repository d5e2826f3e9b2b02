"""LoRA adapters served together: one batch with per-row adapters against one batch per adapter (grouped).

A batch of rows asks for the base model and two adapters; each decoder forward is timed both ways,
interleaved, on the same prefilled cache:
  per-row   one forward over every row, each adapted linear adding its row's own low-rank term
            (dgemma.model.adapters.RowLoRALinear, what `dgemma serve --lora` runs)
  grouped   one forward per adapter over its rows only
Prints a table, then one JSON line.

    python benchmarks/adapters.py --preset bench-20m --rows 6 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dgemma
from dgemma.model.adapters import Adapter, install_adapters


def random_adapter(model, name: str, seed: int, rank: int = 16) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    weights = {n: (torch.randn(rank, m.in_features, generator=g) * 0.02, torch.randn(m.out_features, rank, generator=g) * 0.02)
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")
               and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    return Adapter(name, 2.0, weights, None)


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench-20m")
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset(args.preset)).eval()
    holder = install_adapters(model, [random_adapter(model, "a", 1), random_adapter(model, "b", 2)])
    L, V = model.config.canvas_length, model.config.vocab_size
    cache = model.new_cache(args.rows, args.prompt + L)
    rows = list(range(args.rows))
    ids = torch.tensor([i % 3 for i in rows])  # base, a, b, base, a, b, ...
    for r in rows:
        with holder.set(ids[r : r + 1]):
            model.encode(torch.randint(0, V, (1, args.prompt)), cache, rows=[r], return_logits=False)
    canvas = torch.randint(0, V, (args.rows, L))
    groups = [[r for r in rows if ids[r] == a] for a in range(3)]

    def per_row():
        with holder.set(ids):
            model.denoise(canvas, cache, rows=rows)

    def grouped():
        for group in groups:
            with holder.set(ids[group]):
                model.denoise(canvas[group], cache, rows=group)

    times = {"per-row": [], "grouped": []}
    for fn in (per_row, grouped):  # a first call each, untimed
        fn()
    for _ in range(args.repeats):
        for name, fn in (("per-row", per_row), ("grouped", grouped)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.preset}, {args.rows} rows (base, a, b, ...), prompt {args.prompt}, canvas {L}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'way':<9} {'median ms':>10}")
    for name, t in median.items():
        print(f"{name:<9} {t * 1e3:>10.2f}")
    print(f"grouped / per-row: {median['grouped'] / median['per-row']:.2f}x")
    print(json.dumps({"preset": args.preset, "rows": args.rows, "ms": {k: round(v * 1e3, 3) for k, v in median.items()},
                      "grouped_over_per_row": round(median["grouped"] / median["per-row"], 3)}))


if __name__ == "__main__":
    main()
