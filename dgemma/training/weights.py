"""A training model's weights, materialised shard by shard: no process ever holds a full copy.

    model = meta_model(...)           # DiffusionGemma on the meta device: shapes only
    configure_trainable(model, ...)   # LoRA wrappers (adapters included), frozen routers
    shard(model)                      # FSDP2 `fully_shard` per block + root (several processes only)
    materialise(model, ...)           # `to_empty` on the run's device, then every rank fills its own rows

Weights come from a Hugging Face folder through `torch.distributed.checkpoint` and its
`HuggingFaceStorageReader`: each rank asks for the rows of the `Shard(0)` DTensors it owns and the reader
takes them from the memory-mapped safetensors with `get_slice`, so only those pages are ever touched.
A random init (`--init`) draws every tensor in the order `DiffusionGemma.reset_parameters(seed)` does,
one tensor at a time, and keeps its own rows; so do the LoRA adapters (`init_adapters`). One process and
N processes therefore start from the same numbers.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dgemma.config import ConfigError, ModelConfig, SamplingConfig
from dgemma.training.lora import LoRAExperts, LoRALinear, lora_init_

BASE_NAME = re.compile(r"\.base\.(weight|bias)$")  # LoRALinear keeps the wrapped layer as `.base`


def plain_name(name: str) -> str:
    """A parameter name of the LoRA-wrapped model -> its name in the plain model (and the checkpoint)."""
    return BASE_NAME.sub(r".\1", name)


def meta_model(model_dir: str | None, config: ModelConfig, eos_id: int, dtype: torch.dtype):
    """(model on the meta device in `dtype`, the load plan or None). From a folder: the checkpoint's headers
    are checked and every key's fate decided (as `load_model` does), but no weight is read."""
    from dgemma.model.network import DiffusionGemma

    if model_dir is None:
        with torch.device("meta"):
            model = DiffusionGemma(config, SamplingConfig(eos_token_ids=(eos_id,), pad_token_id=config.pad_token_id))
        return model.to(dtype), None
    from dgemma.weights.checkpoint import open_checkpoint

    model, plan, _ = open_checkpoint(Path(model_dir))
    if model.quantization:
        raise ConfigError(f"{model_dir}: its weights are stored in {model.quantization}; training needs the "
                          f"unquantised checkpoint")
    return model.to(dtype), plan


def _local_rows_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of a full tensor that this rank holds of `param` (a DTensor's local shard, or all of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank has the full tensor and keeps its own chunk, no communication
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def set_from_full(param: torch.Tensor, full: torch.Tensor):
    local = param.to_local() if hasattr(param, "to_local") else param
    local.copy_(_local_rows_of(param, full.to(device=local.device, dtype=local.dtype)))


@torch.no_grad()
def materialise(model, *, device: torch.device, model_dir: str | None, plan, seed: int):
    """Allocate this rank's shards on `device` and fill them: base weights from the checkpoint (or the
    seeded random init), then the LoRA adapters' seeded init. Collective when the model is sharded."""
    model.to_empty(device=device)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    base = {plain_name(n): t for n, t in tensors.items() if ".lora_" not in n}
    if plan is not None:
        _read_checkpoint(base, plan, Path(model_dir))
    else:
        _random_init(base, model.config, seed)
    init_adapters(model, seed)


def _read_checkpoint(targets: dict[str, torch.Tensor], plan, folder: Path):
    """DCP's Hugging Face reader: each (possibly sharded) tensor is filled with the rows this rank owns,
    read by `get_slice` from the memory-mapped files; bf16 on disk -> the parameter's dtype on copy."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    missing = sorted(set(targets) - set(plan.sources))
    if missing:
        raise RuntimeError(f"internal: no checkpoint source for {missing[:3]}")
    state = {plan.sources[name]: t for name, t in targets.items()}
    import torch.distributed as dist

    from dgemma.training.distributed import quiet_single_process

    quiet_single_process()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not dist.is_initialized())


def random_init_tensors(config: ModelConfig, seed: int, shapes: dict[str, tuple]):
    """names -> full tensors of the seeded random init, drawn as `DiffusionGemma.reset_parameters(seed)`
    draws them: parameters in order from one generator (normal * initializer_range for matrices, ones for
    vectors), buffers (the layer scalars) ones. Names must be asked for in `shapes` order (a model's
    `state_dict` order, which keeps the parameters in `named_parameters` order)."""
    from dgemma.model.network import DiffusionGemma

    with torch.device("meta"):
        reference = DiffusionGemma(config)
    params = {name for name, _ in reference.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    order = iter(shapes)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            if next(order) != name:
                raise RuntimeError(f"internal: random init read out of order at {name}")
            shape, dtype = shapes[name]
            if name in params and len(shape) >= 2:
                out[name] = (torch.randn(shape, generator=gen) * std).to(dtype)
            else:
                out[name] = torch.ones(shape, dtype=dtype)
        return out

    return read


def _random_init(targets: dict[str, torch.Tensor], config: ModelConfig, seed: int):
    """Each rank draws every tensor of the seeded init in turn and keeps its rows. Peak: one full tensor."""
    from dgemma.model.network import DiffusionGemma

    with torch.device("meta"):
        reference = DiffusionGemma(config)
    shapes = {name: (tuple(t.shape), torch.float32) for name, t in reference.state_dict().items()}
    read = random_init_tensors(config, seed, shapes)
    for name in shapes:
        set_from_full(targets[name], read([name])[name])


def init_adapters(model, seed: int):
    """LoRA A: kaiming-uniform from a generator seeded by `seed`, module by module in `named_modules`
    order (per expert for fused experts); B: zero. Every rank draws the full (small) adapter, keeps its rows."""
    gen = torch.Generator().manual_seed(seed + 1)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            pairs = [(module.lora_A, module.lora_B)]
        elif isinstance(module, LoRAExperts):
            pairs = [(module.lora_gate_up_A, module.lora_gate_up_B), (module.lora_down_A, module.lora_down_B)]
        else:
            continue
        for A, B in pairs:
            full = torch.empty(A.shape)
            for matrix in full.view(-1, *A.shape[-2:]):  # one init per expert, as for a single adapter
                lora_init_(matrix, generator=gen)
            set_from_full(A, full)
            set_from_full(B, torch.zeros(B.shape))
