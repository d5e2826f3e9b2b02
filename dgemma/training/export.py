"""A training checkpoint -> a Hugging Face folder (LoRA merged) that dgemma and transformers load.

    dgemma export runs/ft --out exported/            # the newest checkpoint of the run
    dgemma export runs/ft --step 400 --out exported/

Runs in one process and streams: the output is planned in safetensors shards from the shapes alone, and
each shard's tensors are read when it is written (from the checkpoint's DCP files; for LoRA runs the base
from the run's source folder, or its seeded random init), merged, written and dropped. The peak is one
output shard plus the (small) adapters, never the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dgemma.config import ConfigError
from dgemma.training.config import TrainConfig
from dgemma.training.lora import merge_lora_state
from dgemma.training.state import latest_checkpoint, list_checkpoints, read_model_tensors, read_trainer_state
from dgemma.weights.checkpoint import LazyWeights, save_pretrained

SHARD_BYTES = 2 * 1024**3


def find_checkpoint(run: Path, step: int | None) -> Path:
    found = dict(list_checkpoints(run))
    if not found:
        raise ConfigError(f"{run}: no complete checkpoint (expected {run}/checkpoints/step-*)")
    if step is None:
        return latest_checkpoint(run)
    if step not in found:
        raise ConfigError(f"{run}: no checkpoint for step {step}; there are {', '.join(map(str, sorted(found)))}")
    return found[step]


def export_checkpoint(checkpoint: Path, out: Path, *, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `out` (atomic: a temporary folder renamed into place) from a checkpoint folder."""
    from dgemma.training.model_setup import base_dtype, resolve_model_config
    from dgemma.training.weights import meta_model, random_init_tensors

    saved = read_trainer_state(checkpoint)["config"]
    config = TrainConfig.from_json(saved)
    model_config = resolve_model_config(config.model, config.init, config.model_overrides)
    eos_id = config.eos_id if config.eos_id is not None else model_config.eos_token_id
    plain, plan = meta_model(config.model, model_config, eos_id, base_dtype(config))
    if config.cache_aware > 0:  # trained to read the step cache's kept keys/values: it says so, and runs with it on
        plain.sampling_config = plain.sampling_config.replace(step_cache=True)
        generation = dict(plain.hf_generation_config or {})
        generation["dgemma"] = {**(generation.get("dgemma") or {}), "cache_aware_training": {
            "probability": config.cache_aware, "settle": config.cache_aware_settle}}
        plain.hf_generation_config = generation
    if config.tokenizer:
        plain.source_dir = config.tokenizer  # tokenizer files are copied from here
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in plain.state_dict().items()}

    if config.lora:
        adapters = read_model_tensors(checkpoint)  # every stored tensor of a LoRA run is an adapter
        scale = config.lora_alpha / config.lora_rank
        if plan is not None:
            base = _folder_reader(Path(config.model), plan, shapes)
        else:
            base = random_init_tensors(model_config, config.seed, shapes)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            merged = merge_lora_state(_with_adapters(base(names), adapters), scale)
            return {n: merged[n] for n in names}
    else:
        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return read_model_tensors(checkpoint, names)

    sizes = {n: torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for n, (s, d) in shapes.items()}
    save_pretrained(plain, out, max_shard_bytes=max_shard_bytes, weights=LazyWeights(sizes, read))
    return Path(out)


def export_adapter(checkpoint: Path, out: Path) -> Path | None:
    """A LoRA checkpoint's adapters in PEFT's format (dgemma.model.adapters) at `out`; None, with the reason
    on stderr, when they have no PEFT form (adapted experts)."""
    import sys

    from dgemma.model.adapters import AdapterError
    from dgemma.training.model_setup import resolve_model_config
    from dgemma.weights.peft import write_peft_adapter

    config = TrainConfig.from_json(read_trainer_state(checkpoint)["config"])
    adapters = {n: t for n, t in read_model_tensors(checkpoint).items() if ".lora_" in n}
    model_config = resolve_model_config(config.model, config.init, config.model_overrides)
    try:
        return write_peft_adapter(out, adapters, rank=config.lora_rank, alpha=config.lora_alpha,
                                  dropout=config.lora_dropout, base_model=config.model or config.init,
                                  config=model_config)
    except AdapterError as e:
        print(f"note: adapter not written in PEFT's format: {e}; `dgemma export` merges it", file=sys.stderr)
        return None


def _with_adapters(part: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base tensors `part` with the adapters that merge into them, named as the training model names them
    (`x.base.weight` beside `x.lora_A`; `...experts.gate_up_proj` beside `...experts.lora_gate_up_A`), which
    is what `merge_lora_state` reads."""
    out = {}
    for name, tensor in part.items():
        prefix = name.rpartition(".")[0]
        if f"{prefix}.lora_A" in adapters and name.endswith(".weight"):  # a wrapped linear
            out[f"{prefix}.base.weight"] = tensor
            out.update({f"{prefix}.{k}": adapters[f"{prefix}.{k}"] for k in ("lora_A", "lora_B")})
            continue
        out[name] = tensor
        if f"{prefix}.lora_down_A" in adapters:  # fused experts
            out.update({k: v for k, v in adapters.items() if k.startswith(prefix + ".lora_")})
    return out


def _folder_reader(folder: Path, plan, shapes):
    """names -> full tensors read from the base model's safetensors (one shard file open at a time)."""
    from safetensors import safe_open

    from dgemma.weights.checkpoint import read_headers

    stored = read_headers(folder)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            key = plan.sources[name]
            with safe_open(str(stored[key].file), "pt") as f:
                out[name] = f.get_tensor(key).to(shapes[name][1])
        return out

    return read
