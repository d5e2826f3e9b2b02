"""Run under torchrun by test_training_sharded.py: build the training model sharded from a checkpoint folder
(meta -> LoRA -> fully_shard with bf16 mixed precision -> each rank reads its rows), then write what was
loaded, what each rank holds, and the loss and adapter gradients of one batch (every rank the same batch).

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

from dgemma.training import distributed as D
from dgemma.training.model_setup import configure_trainable
from dgemma.training.weights import materialise, meta_model
from dgemma.weights.checkpoint import model_config

LORA = dict(rank=4, alpha=8.0, targets=("q_proj", "mlp.down_proj", "experts"))


def batch_loss(model, lockstep: bool, cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The diffusion loss of one fixed batch of two examples (mean)."""
    from dgemma.training.data import Example, collate
    from dgemma.training.objective import diffusion_losses, draw_noise

    c = model.config
    examples = [Example([2, 5, 6, 7, 3], [7, 6, 5]), Example([2, 9, 4, 3], [4, 9, 11, 12, 13, 14, 15, 16, 4])]
    batch = collate(examples, [0, 1], canvas_length=c.canvas_length, pad_id=c.pad_token_id, eos_id=1)
    noise = draw_noise(batch, run_seed=0, canvas_length=c.canvas_length, vocab_size=c.vocab_size,
                       eps=1e-3, self_cond_prob=0.5)
    return diffusion_losses(model, batch, noise, lockstep=lockstep, cache_dtype=cache_dtype).total.mean()


def main(model_dir: str, out: str):
    env = D.setup("cpu")
    _, config = model_config(Path(model_dir))
    model, plan = meta_model(model_dir, config, config.eos_token_id, torch.float32)
    configure_trainable(model, objective="diffusion", lora=LORA, train_router=False)
    D.shard(model, mixed_precision="bf16")
    materialise(model, device=env.device, model_dir=model_dir, plan=plan, seed=7)
    local = {n: p.to_local() for n, p in model.named_parameters()}
    held = sum(t.numel() * t.element_size() for t in local.values())
    loss = batch_loss(model, lockstep=True, cache_dtype=torch.bfloat16)  # the cache holds bf16 keys
    loss.backward()
    grad = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        save_file({n: t.contiguous() for n, t in full.items()}, str(Path(out) / "gathered.safetensors"))
        save_file({n: t.contiguous() for n, t in grad.items()}, str(Path(out) / "grads.safetensors"))
    report = {"rank": env.rank, "loss": float(loss), "held_bytes": held, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "sharded": sum(hasattr(p, "placements") for p in model.parameters())}
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps(report))
    D.teardown(env)


if __name__ == "__main__":
    main(*sys.argv[1:])
