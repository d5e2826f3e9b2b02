"""The Gemma 4 vision tower: images, as patches, to soft tokens in the text model's embedding space.

  patches (N, P, 3 p^2) in [0, 1]    N images padded to P patch slots; a padding slot has position (-1, -1)
    -> linear patch embedding + learned x and y position embeddings
    -> ViT blocks: bidirectional attention over an image's real patches, 2-D RoPE (the first half of every
       head turns with the patch's column, the second half with its row), q/k RMSNorm, scale-free v norm,
       scaling 1.0, a gated-GELU MLP; norms before and after both
    -> each k x k square of patches averaged into one soft token, times sqrt(D), in fp32
    -> optionally standardised: (x - std_bias) * std_scale
    -> `VisionEmbedder`: scale-free RMSNorm, then a linear map to the text hidden size

The text encoder puts an image's soft tokens where the prompt holds its placeholder tokens
(`DiffusionGemma.encode`, `dgemma.images` makes both). Module and parameter names are the checkpoint's
(`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`).

Shapes: N images, P patch slots, D vision hidden, S soft-token slots per image (P / k^2), H text hidden.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.config import VisionConfig
from dgemma.model.attention import apply_rope, rope_inv_freq, rope_tables
from dgemma.model.layers import RMSNorm, gelu


class ClippedLinear(nn.Module):
    """A bias-free linear map; with `use_clipped_linears`, its input and output are clamped to the ranges
    the checkpoint stores (`input_min`, `input_max`, `output_min`, `output_max`; +-inf until loaded)."""

    def __init__(self, config: VisionConfig, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = config.use_clipped_linears
        if self.clipped:
            for name, value in (("input_min", -math.inf), ("input_max", math.inf),
                                ("output_min", -math.inf), ("output_max", math.inf)):
                self.register_buffer(name, torch.tensor(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


def rope_2d(x: torch.Tensor, rope) -> torch.Tensor:
    """x (N, P, heads, Dh): the first half of every head rotated by the patch's column, the second by its row.
    rope: ((cos, sin) of the columns, (cos, sin) of the rows), each (N, P, 1, Dh / 2)."""
    half = x.shape[-1] // 2
    (cos_x, sin_x), (cos_y, sin_y) = rope
    return torch.cat([apply_rope(x[..., :half], cos_x, sin_x), apply_rope(x[..., half:], cos_y, sin_y)], dim=-1)


class VisionAttention(nn.Module):
    """GQA over the patches of one image, both ways, with q/k RMSNorm, scale-free v norm and scaling 1.0."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        d, self.head_dim = config.hidden_size, config.head_dim
        self.q_proj = ClippedLinear(config, d, config.num_heads * self.head_dim)
        self.k_proj = ClippedLinear(config, d, config.num_kv_heads * self.head_dim)
        self.v_proj = ClippedLinear(config, d, config.num_kv_heads * self.head_dim)
        self.o_proj = ClippedLinear(config, config.num_heads * self.head_dim, d)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        """x (N, P, D), mask (N, 1, 1, P) True on real patches -> (N, P, D)."""
        N, P, _ = x.shape
        q = rope_2d(self.q_norm(self.q_proj(x).view(N, P, -1, self.head_dim)), rope)
        k = rope_2d(self.k_norm(self.k_proj(x).view(N, P, -1, self.head_dim)), rope)
        v = self.v_norm(self.v_proj(x).view(N, P, -1, self.head_dim))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=1.0, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(N, P, -1))


class VisionMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)) with clippable linears."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = ClippedLinear(config, d, inner)
        self.up_proj = ClippedLinear(config, d, inner)
        self.down_proj = ClippedLinear(config, inner, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    """Patch pixels (in [0, 1], mapped to [-1, 1]) -> a linear embedding plus the learned embeddings of the
    patch's column (table 0) and row (table 1); padding slots get no position embedding."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, config.position_embedding_size, config.hidden_size))

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """pixel_values (N, P, 3 p^2), positions (N, P, 2) long, padding (N, P) bool -> (N, P, D)."""
        x = self.input_proj((2 * (pixel_values - 0.5)).to(self.input_proj.weight.dtype))
        where = positions.clamp(min=0)
        table = self.position_embedding_table
        pos = F.embedding(where[..., 0], table[0]) + F.embedding(where[..., 1], table[1])
        return x + torch.where(padding[..., None], 0.0, pos)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = nn.Module()  # a container, so that parameter names are the checkpoint's
        self.encoder.layers = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        if config.standardize:
            self.register_buffer("std_bias", torch.zeros(config.hidden_size))
            self.register_buffer("std_scale", torch.ones(config.hidden_size))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (N, P, 2) -> ((cos, sin) by column, (cos, sin) by row), each (N, P, 1, Dh / 2): each half
        of a head is an ordinary RoPE of half the head size."""
        half = self.config.head_dim // 2
        inv_freq = rope_inv_freq(half, self.config.rope_theta, 1.0, positions.device)
        return rope_tables(positions[..., 0], inv_freq, dtype), rope_tables(positions[..., 1], inv_freq, dtype)

    def check(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The soft tokens (N,) each image becomes; ValueError for inputs `forward` cannot take (a caller
        that runs the tower later, such as the engine's loop, checks them when they arrive)."""
        c, k = self.config, self.config.pooling_kernel_size
        if pixel_values.dim() != 3 or pixel_values.shape[-1] != 3 * c.patch_size**2:
            raise ValueError(f"pixel_values must be (images, patches, {3 * c.patch_size**2}), "
                             f"got {tuple(pixel_values.shape)}")
        if positions.shape != (*pixel_values.shape[:2], 2):
            raise ValueError(f"image_position_ids must be {(*pixel_values.shape[:2], 2)}, got {tuple(positions.shape)}")
        if pixel_values.shape[1] % (k * k):
            raise ValueError(f"{pixel_values.shape[1]} patch slots per image do not pool into {k}x{k} squares")
        if positions.numel() and int(positions.max()) >= c.position_embedding_size:
            raise ValueError(f"an image side of {int(positions.max()) + 1} patches exceeds the tower's "
                             f"{c.position_embedding_size} positions")
        return (positions != -1).any(dim=-1).sum(dim=-1) // (k * k)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor, filled: torch.Tensor | None = None):
        """pixel_values (N, P, 3 p^2), positions (N, P, 2) (column, row), -1 on padding slots ->
        soft tokens (N, S, D) and their mask (N, S) bool: image n has its first
        (real patches of n) / k^2 slots filled. `filled`: those counts (N,) on the device when the caller
        checked the inputs already (`check`, which reads them)."""
        N, P, _ = pixel_values.shape
        k = self.config.pooling_kernel_size
        if filled is None:
            filled = self.check(pixel_values, positions)
        filled = filled[:, None]  # (N, 1)
        padding = (positions == -1).all(dim=-1)  # (N, P)
        x = self.patch_embedder(pixel_values, positions, padding)
        rope = self.rope(positions, x.dtype)
        mask = ~padding[:, None, None, :]  # every patch attends to its image's real patches
        for block in self.encoder.layers:
            x = block(x, rope, mask)

        # Average each k x k square of patches: patch (column c, row r) of an image C patches wide lands in
        # soft token (c // k) + (C // k) * (r // k), row-major over the pooled grid.
        where = positions.clamp(min=0)
        columns = where[..., 0].amax(dim=-1, keepdim=True) + 1  # (N, 1)
        slot = where[..., 0] // k + (columns // k) * (where[..., 1] // k)  # (N, P)
        S, D, dtype = P // (k * k), x.shape[-1], x.dtype
        x = x.float().masked_fill(padding[..., None], 0.0)
        pooled = x.new_zeros(N, S, D).scatter_add_(1, slot[..., None].expand(N, P, D), x) / (k * k)
        # rounded to the tower's dtype as the reference does, then scaled and standardised in fp32:
        # sqrt(D) times the activations can leave the fp16 range, and the bias subtraction cancels them
        soft = pooled.to(dtype).float() * math.sqrt(D)
        if self.config.standardize:
            soft = (soft - self.std_bias.float()) * self.std_scale.float()
        return soft.to(dtype), torch.arange(S, device=soft.device) < filled


class VisionEmbedder(nn.Module):
    """Soft tokens (..., D) -> text embeddings (..., H): scale-free RMSNorm, then a linear map. (Not scaled by
    sqrt(H) as token embeddings are.)"""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.embedding_projection = nn.Linear(config.hidden_size, text_hidden_size, bias=False)

    def forward(self, soft: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft))
