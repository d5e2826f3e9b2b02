"""Named model shapes: the released 26B-A4B, the tests' tiny model, the benchmarks' bench-20m."""

from __future__ import annotations

import copy

from dgemma.config.model import FULL, SLIDING, ConfigError, ModelConfig


def _tiny_layers(n: int, every: int = 2) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % every == 0 or i == n - 1 else SLIDING for i in range(n))


PRESETS: dict[str, ModelConfig] = {
    # The released model's text backbone (google/diffusiongemma-26B-A4B-it).
    "diffusiongemma-26b-a4b": ModelConfig(),
    # Tests: every feature (sliding + full layers, K=V, partial RoPE, MoE) at toy size.
    "tiny": ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, sliding_window=8, global_head_dim=32, num_global_kv_heads=1,
        layer_types=_tiny_layers(4), num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=4096, canvas_length=16,
    ),
    # Benchmarks: 20.0M parameters (experts 12.6M; 8.6M active per token), vocab 8192, 8 layers, 16
    # experts top-2, canvas 256; the experts are half the hidden size wide (the released model's are a
    # quarter).
    "bench-20m": ModelConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=64, sliding_window=512, global_head_dim=128, num_global_kv_heads=1,
        layer_types=((SLIDING,) * 3 + (FULL,)) * 2, num_experts=16, top_k_experts=2,
        moe_intermediate_size=128, max_position_embeddings=32768, canvas_length=256,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}") from None
