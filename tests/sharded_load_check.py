"""Run under torchrun by test_training_sharded.py: build the training model sharded from a checkpoint folder
(meta -> LoRA -> fully_shard -> each rank reads its rows), then write what was loaded and what each rank holds.

    torchrun --nproc-per-node 2 tests/sharded_load_check.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dgemma.model.checkpoint import model_config
from dgemma.training import distributed as D
from dgemma.training.model_setup import configure_trainable
from dgemma.training.weights import materialise, meta_model

LORA = dict(rank=4, alpha=8.0, targets=("q_proj", "mlp.down_proj", "experts"))


def main(model_dir: str, out: str):
    env = D.setup("cpu")
    _, config = model_config(Path(model_dir))
    model, plan = meta_model(model_dir, config, config.eos_token_id, torch.float32)
    configure_trainable(model, objective="diffusion", lora=LORA, train_router=False)
    D.shard(model)
    materialise(model, device=env.device, model_dir=model_dir, plan=plan, seed=7)
    local = {n: p.to_local() for n, p in model.named_parameters()}
    held = sum(t.numel() * t.element_size() for t in local.values())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        save_file({n: t.contiguous() for n, t in full.items()}, str(Path(out) / "gathered.safetensors"))
    report = {"rank": env.rank, "held_bytes": held, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "sharded": sum(hasattr(p, "placements") for p in model.parameters())}
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps(report))
    D.teardown(env)


if __name__ == "__main__":
    main(*sys.argv[1:])
