"""Multi-process training on PyTorch's own engine: torchrun + FSDP2 (`fully_shard`), gloo on CPU, NCCL on GPU.

    torchrun --nproc-per-node N -m dgemma train ...

Every layer is its own FSDP unit and the root holds the embedding (tied LM head), the final norm and the
self-conditioning block. The model is entered through `encode`, `denoise` and `head` rather than
`forward`, so those are registered as FSDP forward methods (they gather the root's shards).
Gradients are averaged over processes by FSDP; the objective scales each process's loss so the average
is the mean over the global batch.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def setup(device: str = "auto") -> DistEnv:
    """Join the process group torchrun describes in the environment (a no-op for a plain run)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv(device=pick_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def teardown(env: DistEnv):
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard(model) -> None:
    """FSDP2 in place: one unit per layer, then the root."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # Block.forward returns its keys/values as transposed views; we only read them (copied into the
    # cache), never modify them in place, which is what this warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    for method in ("encode", "denoise", "head"):
        register_fsdp_forward_method(model, method)


def set_gradient_sync(model, env: DistEnv, enabled: bool):
    """Skip the reduce-scatter on all but the last micro-batch of an accumulation."""
    if env.distributed:
        model.set_requires_gradient_sync(enabled)


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        values = values.to(env.device)
        dist.all_reduce(values)
    return values.cpu()


def barrier(env: DistEnv):
    if env.distributed:
        dist.barrier()


def as_float(value) -> float:
    """A scalar that may be a DTensor (FSDP's grad norm) -> float."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ---------------------------------------------------------------------------------------------
# Full (unsharded) state dicts: collective calls; the main process receives the tensors (on CPU)
# ---------------------------------------------------------------------------------------------
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_model_state(model, state: dict[str, torch.Tensor], *, strict: bool = True):
    """Every process passes the same full state dict; each keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=strict))


def load_optimizer_state(model, optimizer, state: dict):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())
