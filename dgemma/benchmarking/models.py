"""The models a benchmark runs without a checkpoint: a preset, or its first N layers, with random weights."""

from __future__ import annotations

import torch

from dgemma.config import get_preset
from dgemma.weights.random_weights import random_model


def preset_model(preset: str, *, layers: int | None = None, device="cpu", dtype: torch.dtype = torch.float32,
                 quantize: str | None = None, seed: int = 0):
    """Preset `preset` with random weights made on the device in the dtype, tensor by tensor (quantised ones
    directly in int8 / int4: `dgemma.weights.random_weights.random_model`). `layers`: its first N layers only,
    its widths and vocabulary kept (ValueError for a count the preset does not have)."""
    config = get_preset(preset)
    if layers is not None:
        if not 1 <= layers <= config.num_layers:
            raise ValueError(f"takes 1 to {config.num_layers} for {preset}, not {layers}")
        config = config.replace(num_layers=layers, layer_types=config.layer_types[:layers])
    return random_model(config, device=device, dtype=dtype, quantize=quantize, seed=seed)
