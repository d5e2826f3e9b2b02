"""Checkpoints that a run killed at any moment resumes from, written by every process at once.

    OUT/checkpoints/step-0000200/
        state/                      torch.distributed.checkpoint (DCP) in safetensors: the weights that learn
                                    ("model.*": all of them, or the LoRA adapters) and AdamW's moments and
                                    step counts ("optim.state.*"); one file per process, each shard's place
                                    in the full tensor in the file's metadata
        rng-rank00000.safetensors   each process's torch RNG states as uint8 tensors
        trainer_state.json          step, samples consumed (the data position), the run's config, world size

Each process writes its own shards; nothing is gathered. A checkpoint is written into
`.step-0000200.tmp` and renamed into place when complete, so every `step-*` folder is whole; leftovers of a
killed write are removed on resume. DCP reshards on load, so a run resumes on another number of processes.
Nothing is pickled: tensors are safetensors, the rest JSON.
The data order, the noise and the learning rate are pure functions of (seed, step), so step + weights +
optimizer + RNG is the whole state of a run. `dgemma export` turns a checkpoint into a Hugging Face folder
(`dgemma.training.export`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from dgemma.training import distributed as D
from dgemma.training.distributed import DistEnv

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
# RNG state <-> flat tensors
# ---------------------------------------------------------------------------------------------
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
STATE = "state"  # the DCP folder inside a checkpoint


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (the disk is full...): one line naming the step, the cause and the
    checkpoint a `--resume` continues from. The partial write is gone; earlier checkpoints are untouched."""


def save_checkpoint(out: Path, step: int, *, env: DistEnv, model, optimizer, trainer_state: dict,
                    lora: bool, keep: int) -> Path:
    """Collective: every process calls it and writes its own shards."""
    final = checkpoint_dir(out, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier(env)
    try:
        D.save_state(tmp / STATE, model, optimizer, frozen_too=not lora)
        save_file(rng_state(env.device), str(tmp / f"rng-rank{env.rank:05d}.safetensors"))
        if env.is_main:
            meta = {**trainer_state, "world_size": env.world_size}
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2) + "\n")
    except (OSError, CheckpointException) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back at once
        previous = latest_checkpoint(out)
        resume = f"{previous.name} is intact: --resume continues from it" if previous else "no earlier checkpoint"
        raise CheckpointWriteError(f"writing the checkpoint of step {step} failed ({_cause(e)}); {resume}") from None
    D.barrier(env)
    if env.is_main:
        os.rename(tmp, final)
        for _, old in list_checkpoints(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(env)
    return final


def _cause(error: BaseException) -> str:
    """What failed, in a few words: DCP's CheckpointException carries each process's own error."""
    if isinstance(error, CheckpointException):
        error = next((e for e, _ in error.failures.values() if isinstance(e, BaseException)), error)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def read_trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / "trainer_state.json").read_text())


def load_checkpoint(path: Path, *, env: DistEnv, model, optimizer, lora: bool) -> dict:
    """Restore the weights that learn, the optimizer and this process's RNG; returns trainer_state. The
    checkpoint may come from another number of processes (DCP reshards)."""
    path = Path(path)
    meta = read_trainer_state(path)
    D.load_state(path / STATE, model, optimizer, frozen_too=not lora)
    rng_file = path / f"rng-rank{env.rank:05d}.safetensors"
    if rng_file.is_file():  # absent when resuming on more processes than wrote the checkpoint
        restore_rng(load_file(str(rng_file)), env.device)
    return meta


def _stored(folder: Path) -> dict:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): v for k, v in metadata.items() if k.startswith("model.")}


def read_model_tensors(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors of a checkpoint's stored weights (all, or `names`), read in this process alone: for
    export and inspection. Names are the training model's (LoRA runs: `...q_proj.lora_A`, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = Path(path) / STATE
    available = _stored(folder)
    names = list(available) if names is None else names
    out = {n: torch.empty(available[n].size, dtype=available[n].properties.dtype) for n in names}
    if out:
        D.quiet_single_process()
        dcp.load({f"model.{n}": t for n, t in out.items()}, storage_reader=HuggingFaceStorageReader(str(folder)),
                 no_dist=True)
    return out
