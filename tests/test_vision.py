"""The vision tower alone against transformers' Gemma4VisionModel + the DiffusionGemma image embedder (fp32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from dgemma.config import ConfigError, VisionConfig
from dgemma.images import ImageProcessor
from dgemma.model.vision import VisionEmbedder, VisionTower

TOL = 1e-4
# GQA, two layers, 4-pixel patches pooled 2 x 2, clipped linears and standardisation on
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=160, use_clipped_linears=True,
              standardize=True)
PROCESSOR = ImageProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int = 0):
    """Every parameter and persistent buffer away from its initial value; clipping ranges tight enough to
    clip some values."""
    g = torch.Generator().manual_seed(seed)
    for name, t in module.state_dict().items():
        if name.endswith(("input_min", "output_min")):
            t.fill_(-(torch.rand((), generator=g).item() * 2 + 0.5))
        elif name.endswith(("input_max", "output_max")):
            t.fill_(torch.rand((), generator=g).item() * 2 + 0.5)
        elif name.endswith("std_scale"):
            t.copy_(torch.rand(t.shape, generator=g) + 0.5)
        else:
            t.add_(torch.randn(t.shape, generator=g) * 0.3)


def reference(seed: int = 0):
    from transformers import Gemma4VisionConfig, Gemma4VisionModel
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
        DiffusionGemmaMultimodalEmbedder,
        DiffusionGemmaTextConfig,
    )

    torch.manual_seed(seed)
    config = Gemma4VisionConfig(**VISION)
    tower = Gemma4VisionModel(config).eval()
    embedder = DiffusionGemmaMultimodalEmbedder(config, DiffusionGemmaTextConfig(hidden_size=24)).eval()
    perturb(tower, seed)
    perturb(embedder, seed + 1)
    return config, tower, embedder


def images(*sizes):
    rng = np.random.default_rng(0)
    return PROCESSOR([Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes])


@torch.no_grad()
def test_soft_tokens_match_transformers_one_image_and_a_batch_of_two_sizes():
    hf_config, hf_tower, hf_embedder = reference()
    config = VisionConfig.from_hf_dict(hf_config.to_dict())
    tower, embedder = VisionTower(config), VisionEmbedder(config, 24)
    # the same names, every one of them: parameters and the clipping / standardisation buffers
    tower.load_state_dict(hf_tower.state_dict(), strict=True)
    embedder.load_state_dict(hf_embedder.state_dict(), strict=True)
    for batch in (images((37, 53)), images((37, 53), (90, 20))):
        expected = hf_embedder(hf_tower(pixel_values=batch.pixel_values,
                                        pixel_position_ids=batch.image_position_ids).last_hidden_state)
        soft, filled = tower(batch.pixel_values, batch.image_position_ids)
        assert filled.sum(dim=1).tolist() == batch.num_soft_tokens
        got = embedder(soft[filled])
        assert got.shape == expected.shape == (sum(batch.num_soft_tokens), 24)
        assert (got - expected).abs().max() <= TOL
    # an image's soft tokens do not depend on the other images of its batch (padding is invisible)
    soft, filled = tower(batch.pixel_values[1:], batch.image_position_ids[1:])
    alone = embedder(soft[filled])
    assert (alone - got[batch.num_soft_tokens[0]:]).abs().max() <= TOL


@torch.no_grad()
def test_clipping_and_standardisation_take_effect():
    """The perturbed clipping ranges and standardisation change the result (so the parity above covers them)."""
    hf_config, hf_tower, _ = reference()
    config = VisionConfig.from_hf_dict(hf_config.to_dict())
    tower = VisionTower(config)
    tower.load_state_dict(hf_tower.state_dict())
    batch = images((37, 53))
    soft, filled = tower(batch.pixel_values, batch.image_position_ids)
    for change in ("clipping", "standardisation"):
        other = VisionTower(config)
        state = dict(hf_tower.state_dict())
        for name in state:
            if change == "clipping" and name.endswith(("_min", "_max")):
                state[name] = torch.tensor(math.copysign(math.inf, state[name].item()))
            if change == "standardisation" and name.startswith("std_"):
                state[name] = torch.zeros_like(state[name]) if name == "std_bias" else torch.ones_like(state[name])
        other.load_state_dict(state)
        assert (other(batch.pixel_values, batch.image_position_ids)[0][filled] - soft[filled]).abs().max() > 1e-2


def test_vision_config_round_trip_and_refusals():
    from transformers import Gemma4VisionConfig

    config = VisionConfig.from_hf_dict(Gemma4VisionConfig(**VISION).to_dict())
    assert VisionConfig.from_hf_dict(config.to_hf_dict()) == config
    assert (config.num_heads, config.num_kv_heads, config.pooling_kernel_size) == (4, 2, 2)
    hf_tower = reference()[1]
    tower_params = sum(p.numel() for p in hf_tower.parameters())
    assert config.param_count(24) == tower_params + 32 * 24
    with pytest.raises(ConfigError, match="multiple of 4"):
        VisionConfig(head_dim=6)
    with pytest.raises(ConfigError, match="unsupported vision tower"):
        VisionConfig.from_hf_dict({"model_type": "siglip_vision_model"})


def test_an_image_wider_than_the_position_table_is_refused():
    config = VisionConfig.from_hf_dict({**VISION, "position_embedding_size": 8})
    batch = images((37, 53))  # resized to 20 x 12 patches
    with pytest.raises(ValueError, match="side of 20 patches exceeds the tower's 8 positions"):
        VisionTower(config)(batch.pixel_values, batch.image_position_ids)
