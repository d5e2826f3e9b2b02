"""Which network a run trains and which of its weights learn.

Sources: `--model DIR` (a Hugging Face folder: fine-tuning) or `--init preset:NAME | config.json` (random
init, seeded), with field overrides such as vocab_size=16 or hidden_size=128 for models trained here.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import cycle, islice
from pathlib import Path

import torch

from dgemma import devices
from dgemma.config import FULL, ConfigError, ModelConfig, get_preset
from dgemma.model.experts import Experts
from dgemma.training.lora import apply_lora
from dgemma.weights.checkpoint import read_json

MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def parse_override(text: str) -> tuple[str, object]:
    """"key=value" -> (key, value); the value is read as JSON when it parses (numbers, lists), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def apply_overrides(base: ModelConfig, overrides: dict) -> ModelConfig:
    unknown = sorted(set(overrides) - MODEL_FIELDS)
    if unknown:
        raise ConfigError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(sorted(MODEL_FIELDS))}")
    overrides = dict(overrides)
    n = overrides.get("num_layers", base.num_layers)
    if n != base.num_layers and "layer_types" not in overrides:
        # repeat the base pattern over the new depth; the last layer is always full attention
        pattern = list(islice(cycle(base.layer_types), n))
        overrides["layer_types"] = tuple(pattern[:-1] + [FULL]) if n else ()
    try:
        return base.replace(**overrides)
    except TypeError as e:
        raise ConfigError(f"bad model override: {e}") from None


def config_from_init(init: str, overrides: dict) -> ModelConfig:
    """"preset:NAME" or a JSON file: a Hugging Face config.json, or flat ModelConfig fields (with an optional
    "preset" key as the base)."""
    if init.startswith("preset:"):
        return apply_overrides(get_preset(init.removeprefix("preset:")), overrides)
    path = Path(init)
    if not path.is_file():
        raise ConfigError(f"--init expects preset:NAME or a config JSON file; {init!r} is neither")
    raw = read_json(path, ConfigError)
    if "text_config" in raw or "model_type" in raw:
        return apply_overrides(ModelConfig.from_hf_dict(raw), overrides)
    preset = raw.pop("preset", None)
    base = get_preset(preset) if preset else ModelConfig()
    return apply_overrides(base, {**raw, **overrides})


def resolve_model_config(model_dir: str | None, init: str | None, overrides: dict) -> ModelConfig:
    """The architecture, read cheaply (no weights) so data can be checked before anything heavy."""
    if (model_dir is None) == (init is None):
        raise ConfigError("give exactly one of --model DIR (fine-tune) or --init preset:NAME|config.json "
                          "(from scratch)")
    if model_dir is not None:
        if overrides:
            raise ConfigError("model field overrides (--set, --vocab-size) only apply with --init")
        from dgemma.weights.checkpoint import read_config, read_headers, without_missing_vision

        # the shard headers say whether a vision tower is stored (config.json always describes one): the
        # memory plan must count what the run will hold
        config = ModelConfig.from_hf_dict(read_config(Path(model_dir)))
        return without_missing_vision(config, read_headers(Path(model_dir)))
    return config_from_init(init, overrides)


def resolve_precision(precision: str, device: torch.device) -> str:
    """--precision auto -> bf16 where the device multiplies bf16 natively (`dgemma.devices.native_bf16`: an
    AVX2 CPU runs a bf16-autocast step 9x slower than fp32), else fp32; fp32 and bf16 stay."""
    if precision != "auto":
        return precision
    return "bf16" if devices.native_bf16(device) else "fp32"


def base_dtype(config) -> torch.dtype:
    """A LoRA base never learns: under bf16 (autocast or mixed precision) it is held in bf16 (half the
    memory); adapters stay fp32.
    Everything else keeps fp32 master weights."""
    bf16 = config.precision == "bf16" or config.mixed_precision == "bf16"
    return torch.bfloat16 if config.lora and bf16 else torch.float32


def configure_trainable(model, *, objective: str, lora: dict | None, train_router: bool) -> int:
    """Choose what learns; returns the number of trainable parameters.

    Full training: everything but the routers (frozen unless asked). LoRA: only the adapters. The
    autoregressive baseline never runs the decoder, so its self-conditioning block stays frozen; a vision
    tower never sees an image here, so it stays frozen too.
    """
    if lora is not None:
        apply_lora(model, **lora)
    else:
        model.requires_grad_(True)
        if not train_router:
            for block in model.layers:
                block.router.requires_grad_(False)
    if objective == "ar":
        model.self_conditioning.requires_grad_(False)
    for tower in (model.vision_tower, model.embed_vision):  # training is text-only: carried through unchanged
        if tower is not None:
            tower.requires_grad_(False)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if n == 0:
        raise ConfigError("nothing to train: every parameter is frozen")
    return n


TRAINING_MODE = "training"  # the warm marker's mode for compiled training (`policy.warm_key`)


def compile_for_training(model, shape: str | None = None):
    """torch.compile the parts of every block that are pure tensor functions, forward and backward: the
    attention's projections (q/k/v, their norms, RoPE) and the feed-forward half (dense MLP, router,
    routed experts, six norms). Training on a CPU spends most of a step in their elementwise ops, each a
    pass over (B, T, H) memory and an autograd node in eager mode; compiled, inductor fuses them into a
    few loops per region (benchmarks/README.md: where the time goes). The attention itself and the cache
    bookkeeping around it stay eager (they hold host-side state a graph would specialise on per layer).

    Returns the blocks' `CompileState` (whose `succeeded()` marks `shape`, the step's label, warm in the
    compile cache once a step ran), or None where compiling is unavailable (no C++ compiler, no triton): the
    model stays eager after one warning line, as does the whole model once a compile fails (CompiledOrEager).
    """
    from dgemma.compilation import policy, steps

    reason = policy.unavailable_reason(model.device)
    if reason is not None:
        policy.warn_eager(reason)
        return None
    policy.use_disk_cache()
    # one graph per (layer kind, with or without gradients, sequence length): a few more than the default 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    state = steps.CompileState(model, TRAINING_MODE, shape)
    for block in model.layers:
        for experts in (m for m in block.modules() if isinstance(m, Experts)):
            experts.trace_grid = False  # a step's thousands of tokens route unevenly: see dgemma.model.experts
        block.feed_forward = steps.CompiledOrEager(block.feed_forward, state)
        block.self_attn.project = steps.CompiledOrEager(block.self_attn.project, state)
    return state
