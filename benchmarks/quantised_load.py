"""How long loading takes with quantising while loading: a synthetic sharded bf16 checkpoint (random weights,
written once), loaded as bf16, int8 and int4 (int4 on a bf16 CPU model includes repacking for torch's CPU
int4 matmul), and the int4 folder `dgemma quantize` writes, loaded as stored. The shards sit in the page cache after writing, so the times are the CPU's work, not the disk's.

    python benchmarks/quantised_load.py [--experts 64] [--layers 10] [--hidden 1024]

Prints a table (seconds, seconds per billion parameters, the 26B-A4B's 25.25B at that rate), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import torch

import dgemma
from dgemma.config import ModelConfig
from dgemma.weights.random_weights import random_model

PARAMS_26B = 25.25e9


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--shard-mb", type=int, default=200)
    args = p.parse_args()
    h = args.hidden
    config = ModelConfig(vocab_size=8192, hidden_size=h, intermediate_size=h, num_layers=args.layers, num_heads=8,
                         num_kv_heads=4, head_dim=128, sliding_window=64, global_head_dim=256, num_global_kv_heads=1,
                         layer_types=(("sliding_attention",) * 4 + ("full_attention",)) * (args.layers // 5)
                         + ("sliding_attention",) * (args.layers % 5),
                         num_experts=args.experts, top_k_experts=4, moe_intermediate_size=h // 2, canvas_length=16)
    params = config.param_counts()["total"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dgemma-load-") as folder:
        dgemma.save_pretrained(random_model(config, dtype=torch.bfloat16), folder, max_shard_bytes=args.shard_mb << 20)

        def timed_load(label: str, path, **kwargs):
            start = time.perf_counter()
            model = dgemma.load_model(path, dtype=torch.bfloat16, **kwargs)
            seconds = time.perf_counter() - start
            rows.append({"format": label, "seconds": round(seconds, 2),
                         "seconds_per_billion": round(seconds / params * 1e9, 1),
                         "minutes_at_26b": round(seconds / params * PARAMS_26B / 60, 1)})
            del model

        for fmt in (None, "int8", "int4"):
            timed_load(fmt or "bf16", folder, quantize=fmt)
        # `dgemma quantize`: quantised once and saved; loading that folder reads it as stored
        saved = f"{folder}-int4"
        dgemma.save_pretrained(dgemma.load_model(folder, dtype=torch.bfloat16, quantize="int4", cpu_int4_kernel=False),
                               saved, max_shard_bytes=args.shard_mb << 20)
        try:
            timed_load("int4, saved by dgemma quantize", saved)
        finally:
            shutil.rmtree(saved, ignore_errors=True)
    print(f"{params / 1e9:.2f}B parameters, bf16 shards of <= {args.shard_mb} MB, {torch.get_num_threads()} threads")
    print("| format | seconds | s per billion | 26B-A4B at that rate (min) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['seconds']} | {r['seconds_per_billion']} | {r['minutes_at_26b']} |")
    print(json.dumps({"params": params, "threads": torch.get_num_threads(), "loads": rows}))


if __name__ == "__main__":
    main()
