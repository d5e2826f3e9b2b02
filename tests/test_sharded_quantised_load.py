"""A sharded bf16 checkpoint quantised shard by shard while loading: the process's peak resident memory stays
near the quantised model plus one shard, far below the checkpoint's size (how a 50 GB 26B-A4B checkpoint
loads as 14 GB of int4 on a 24 GB machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dgemma.config import ModelConfig
from dgemma.model.network import DiffusionGemma
from dgemma.weights.checkpoint import INDEX_FILE, checkpoint_key

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 200 << 20

# 10 layers of 64 experts 512 wide over hidden 1024: 1.07G parameters, 2.1 GB in bf16
CONFIG = ModelConfig(vocab_size=8192, hidden_size=1024, intermediate_size=1024, num_layers=10, num_heads=8,
                     num_kv_heads=4, head_dim=128, sliding_window=64, global_head_dim=256, num_global_kv_heads=1,
                     layer_types=(("sliding_attention",) * 4 + ("full_attention",)) * 2, num_experts=64,
                     top_k_experts=4, moe_intermediate_size=512, canvas_length=16)

CHILD = """
import json, resource, sys, torch
import dgemma
from dgemma.quant.quantize import loaded_weight_bytes
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = dgemma.load_model(sys.argv[1], dtype=torch.bfloat16, quantize="int8")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "weights": loaded_weight_bytes(model)}))
"""


def write_sharded_checkpoint(folder: Path, config: ModelConfig) -> int:
    """Random bf16 tensors straight into safetensors shards of ~SHARD_BYTES (never the whole model in memory);
    returns the bytes written."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DiffusionGemma(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weight_map, shard, size, total, files = {}, {}, 0, 0, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        files.append(name)

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02 if len(shape) >= 2 else torch.ones(shape)).to(torch.bfloat16)
        if shard and size + t.nbytes > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[checkpoint_key(name)] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return total


def test_quantised_load_peaks_near_quantised_size_plus_one_shard(tmp_path):
    total = write_sharded_checkpoint(tmp_path, CONFIG)
    largest_shard = max(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert total > 2e9 and largest_shard < 300 << 20
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    added = out["peak"] - out["base"]
    print(f"checkpoint {total / 2**20:,.0f} MiB in shards of <= {largest_shard / 2**20:,.0f} MiB; quantised "
          f"{out['weights'] / 2**20:,.0f} MiB; loading added {added / 2**20:,.0f} MiB of peak RSS")
    assert out["weights"] < 0.6 * total  # int8 + fp16 scales (the embedding and norms stay bf16)
    # the quantised weights, one shard's pages and one tensor's temporaries; a dense load would add `total`
    assert added < out["weights"] + 2 * largest_shard, (added / 2**20, out["weights"] / 2**20)
    assert added < 0.8 * total
