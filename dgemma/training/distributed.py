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
from pathlib import Path

import torch
import torch.distributed as dist

from dgemma import devices


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
    """--device for this process: "auto" as `dgemma.devices` resolves it; "cuda" is the process's own GPU."""
    name = devices.resolve_device(name)
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


def shard(model, *, mixed_precision: str | None = None, activation_checkpointing: bool = False) -> None:
    """FSDP2 in place: one unit per layer, then the root. Called on the meta-device model, before any
    weight exists, so each process only ever allocates its own shards (`weights.materialise`).

    mixed_precision "bf16": FSDP2's `MixedPrecisionPolicy` gathers parameters in bf16 for the forward and
    backward and reduce-scatters gradients in fp32; the sharded master weights and AdamW stay fp32.
    activation_checkpointing: each block keeps only its input and recomputes its activations in the
    backward (torch's non-reentrant checkpoint, applied as a module hook so parameter names do not change).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # Block.forward returns its keys/values as transposed views; we only read them (copied into the
    # cache), never modify them in place, which is what this warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        if activation_checkpointing:
            checkpoint_block(block)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for method in ("encode", "denoise", "head"):
        register_fsdp_forward_method(model, method)


def checkpoint_block(block) -> None:
    """Activation checkpointing for one block (also used without FSDP)."""
    from torch.distributed._composable import checkpoint

    checkpoint(block)


def set_gradient_sync(model, env: DistEnv, enabled: bool):
    """Skip the reduce-scatter on all but the last micro-batch of an accumulation."""
    if env.distributed:
        model.set_requires_gradient_sync(enabled)


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        values = values.to(env.device)
        dist.all_reduce(values)
    return values.cpu()


def from_rank0(make, env: DistEnv):
    """`make()` run on rank 0 and its value (picklable) handed to every rank; `make()` itself in one process."""
    if not env.distributed:
        return make()
    box = [make() if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(env: DistEnv):
    if env.distributed:
        dist.barrier()


def as_float(value) -> float:
    """A scalar that may be a DTensor (FSDP's grad norm) -> float."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ---------------------------------------------------------------------------------------------
# Sharded state: DCP (torch.distributed.checkpoint), every process writes and reads its own part
# ---------------------------------------------------------------------------------------------
def _options(frozen_too: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a LoRA run stores its adapters only: the frozen base is read again from its source on resume
    return StateDictOptions(ignore_frozen_params=not frozen_too, strict=frozen_too)


def quiet_single_process():
    """DCP warns that it runs in one process when there is no process group; here that is the intent."""
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")


def _tensor_state(model, optimizer, frozen_too: bool):
    """(state for DCP: {"model": ..., "optim": {"state": ...}}, the full optimizer state dict). Only tensors
    go to DCP (safetensors files); AdamW's param_groups are the run's settings, rebuilt from its config."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(frozen_too))
    return {"model": model_state, "optim": {"state": optim_state["state"]}}, optim_state


def save_state(folder: Path, model, optimizer, *, frozen_too: bool):
    """Model (sharded DTensors or plain tensors) and AdamW's moments and step counts under "model." /
    "optim.state.": every process writes its own safetensors file (DCP's Hugging Face writer, the
    offsets of each shard in the file's metadata), all at once; nothing is pickled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    quiet_single_process()
    state, _ = _tensor_state(model, optimizer, frozen_too)
    writer = HuggingFaceStorageWriter(str(folder), save_distributed=dist.is_initialized())
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())


def load_state(folder: Path, model, optimizer, *, frozen_too: bool):
    """The inverse of `save_state`, on any number of processes: each reads the rows it owns from whichever
    files hold them, so a checkpoint written by another world size loads (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    quiet_single_process()
    state, optim_state = _tensor_state(model, optimizer, frozen_too)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not dist.is_initialized())
    optim_state["state"] = state["optim"]["state"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state,
                   options=_options(frozen_too))
