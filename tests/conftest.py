"""Shared fixtures: tiny random DiffusionGemma checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

S, F = "sliding_attention", "full_attention"

# Several shapes: alternating layers with GQA; three sliding + one full, no GQA on sliding layers and
# top-1 routing; a window larger than most prompts.
TINY_TEXT_CONFIGS = {
    "alternating": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
        layer_types=[S, F, S, F], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=512,
    ),
    "gemma-pattern": dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=12, global_head_dim=24, num_global_key_value_heads=2, sliding_window=6,
        layer_types=[S, S, S, F], num_experts=3, top_k_experts=1, moe_intermediate_size=16,
        max_position_embeddings=512,
    ),
    "wide-window": dict(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=64,
        layer_types=[S, F], num_experts=6, top_k_experts=3, moe_intermediate_size=8,
        max_position_embeddings=512,
    ),
}
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)


def make_hf_model(name: str = "alternating", canvas_length: int = 16, seed: int = 0):
    """A transformers DiffusionGemmaForBlockDiffusion with random weights, norms and scales perturbed so
    that every parameter matters (ones would hide a missing scale)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    cfg = DiffusionGemmaConfig(text_config=dict(TINY_TEXT_CONFIGS[name]), vision_config=dict(TINY_VISION),
                               canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        scalars = torch.rand(len(model.model.decoder.layers)) * 0.5 + 0.75
        for layers in (model.model.decoder.layers, model.model.encoder.language_model.layers):
            for layer, value in zip(layers, scalars):
                layer.layer_scalar.fill_(float(value))
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) for every tiny config, written once per session."""
    out = {}
    for i, name in enumerate(TINY_TEXT_CONFIGS):
        model = make_hf_model(name, seed=i)
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out
