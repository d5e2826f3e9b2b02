"""Checkpoints that a run killed at any moment resumes from, written without pickle.

    OUT/checkpoints/step-0000200/
        model/                      Hugging Face format (LoRA merged): load_model and transformers read it
        adapter.safetensors         LoRA runs only: the unmerged adapters (the base is rebuilt from its source)
        optimizer.safetensors       AdamW moments and step counts, "<parameter name>/<key>"
        rng-rank00000.safetensors   each process's torch RNG states as uint8 tensors
        trainer_state.json          step, samples consumed (the data position), the run's config, param groups

A checkpoint is written into `.step-0000200.tmp` and renamed into place when complete, so every
`step-*` folder is whole; leftovers of a killed write are removed on resume. The data order, the noise
and the learning rate are pure functions of (seed, step), so step + weights + optimizer + RNG is the
whole state of a run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dgemma.training import distributed as D
from dgemma.training.distributed import DistEnv
from dgemma.training.lora import adapter_state

CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:07d}"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1][1] if found else None


def remove_partial_writes(out: Path):
    root = Path(out) / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and ".tmp" in p.name:
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Optimizer and RNG state <-> flat tensors
# ---------------------------------------------------------------------------------------------
def flatten_optimizer_state(osd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """{"state": {name: {key: tensor}}, "param_groups": [...]} -> tensors + JSON-able groups."""
    tensors = {}
    for name, per_param in osd["state"].items():
        for key, value in per_param.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{name}/{key}"] = t.detach().cpu().contiguous().clone()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for flat, t in tensors.items():
        name, _, key = flat.rpartition("/")
        state.setdefault(name, {})[key] = t
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(state: dict[str, torch.Tensor], device: torch.device):
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)


# ---------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------
def save_checkpoint(out: Path, step: int, *, env: DistEnv, model, optimizer, trainer_state: dict,
                    export, lora: bool, keep: int) -> Path:
    """Collective: every process calls it. `export(full_state, folder)` writes the HF model folder."""
    final = checkpoint_dir(out, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier(env)
    model_state = D.full_model_state(model)  # main process: every tensor, on CPU; others: {}
    optim_state = D.full_optimizer_state(model, optimizer)
    save_file(rng_state(env.device), str(tmp / f"rng-rank{env.rank:05d}.safetensors"))
    if env.is_main:
        export(model_state, tmp / "model")
        if lora:
            adapters = {n: t.contiguous() for n, t in adapter_state(model_state).items()}
            save_file(adapters, str(tmp / "adapter.safetensors"))
        tensors, groups = flatten_optimizer_state(optim_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {**trainer_state, "world_size": env.world_size, "optimizer_param_groups": groups}
        (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2) + "\n")
    D.barrier(env)
    if env.is_main:
        os.rename(tmp, final)
        for _, old in list_checkpoints(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(env)
    return final


def read_trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / "trainer_state.json").read_text())


def load_checkpoint(path: Path, *, env: DistEnv, model, optimizer, lora: bool) -> dict:
    """Restore weights (adapters for LoRA), optimizer and this process's RNG; returns trainer_state."""
    from dgemma.model.checkpoint import load_model

    path = Path(path)
    meta = read_trainer_state(path)
    if lora:
        weights = load_file(str(path / "adapter.safetensors"))
    else:
        weights = load_model(path / "model").state_dict()
    D.load_model_state(model, weights, strict=not lora)
    optim = unflatten_optimizer_state(load_file(str(path / "optimizer.safetensors")), meta["optimizer_param_groups"])
    D.load_optimizer_state(model, optimizer, optim)
    rng_file = path / f"rng-rank{env.rank:05d}.safetensors"
    if rng_file.is_file():  # absent when resuming on more processes than wrote the checkpoint
        restore_rng(load_file(str(rng_file)), env.device)
    return meta
