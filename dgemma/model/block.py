"""One layer of the DiffusionGemma backbone: attention (GQA, sliding or full), the router, and the block
that runs attention and then a dense MLP beside the routed experts.

Shapes: B batch, T new tokens, S keys (cached slots and the new tokens), H hidden, D head dim.

A block is told where its own keys/values go among the cached ones (`place_entries`), one of:
  place_after_prefix              the encoder: after the prefix, by concatenation (the caller writes the cache)
  place_in_canvas_slots           the decoder in generation: into the canvas slots of the cache's buffers
  KVCache.place_before_prefix     the decoder in training: before the prefix, by concatenation
  KVCache.place_active_in_slots   the step cache: the packed active positions into their canvas slots
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dgemma.config import ModelConfig
from dgemma.model.attention import apply_rope, attention, attention_read
from dgemma.model.experts import Experts
from dgemma.model.layers import FusedLinears, GatedMLP, RMSNorm, fused_inside_graphs
from dgemma.model.packing import PackedPositions


class Attention(nn.Module):
    """GQA with q/k RMSNorm, scale-free v norm and scaling 1.0. Full layers have no v_proj (K = V)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.sliding = config.is_sliding(layer)
        self.window = config.sliding_window if self.sliding else None
        self.head_dim = config.layer_head_dim(layer)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.layer_kv_heads(layer)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False) if self.sliding else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.fused_qkv: FusedLinears | None = None  # q|k(|v) as one matmul in compiled graphs, see FusedLinears

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, H) -> q (B, Hq, T, D) and the tokens' cache entries (k, v), each (B, Hkv, T, D).

        Sliding layers: finished keys and values. Full layers (K = V): the raw projection, and v None;
        `keys_values` turns entries into keys and values when attending.
        """
        B, T, _ = x.shape
        if fused_inside_graphs(self.fused_qkv):
            q, k_raw, *v = self.fused_qkv(x)
        else:
            q, k_raw, v = self.q_proj(x), self.k_proj(x), [self.v_proj(x)] if self.v_proj is not None else []
        q = apply_rope(self.q_norm(q.view(B, T, self.num_heads, self.head_dim)), cos, sin)
        k_raw = k_raw.view(B, T, self.num_kv_heads, self.head_dim)
        if self.v_proj is None:
            return q.transpose(1, 2), k_raw.transpose(1, 2), None
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v[0].view(B, T, self.num_kv_heads, self.head_dim))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor | None, key_rope):
        """Cache entries over S keys -> keys, values (B, Hkv, S, D). key_rope: cos, sin (B, S, 1, D) of
        the keys' positions, used on full layers only (raw K = V entries get k_norm + RoPE and v_norm)."""
        if v is not None:
            return k, v
        cos, sin = (t.transpose(1, 2) for t in key_rope)  # (B, 1, S, D) for the (B, Hkv, S, D) layout
        return apply_rope(self.k_norm(k), cos, sin), self.v_norm(k)

    def attend(self, q, k, v, mask: torch.Tensor | None, pack: PackedPositions | None = None,
               read: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, Hq, T, D), k/v (B, Hkv, S, D), mask (B, 1, T, S) bool or None (all visible) -> (B, T, H).

        With `pack` (the step cache's packed positions): q (1, Hq, N, D) holds the N packed queries of n rows,
        k/v (n, Hkv, S, D) and mask (n, 1, L, S) (a canvas mask: its query rows are all alike) are per row;
        each bucket of rows with similar active counts attends together (`PackedPositions`) -> (1, N, H).
        `read` (n, L) fp32, with `pack`: each canvas slot's attention weight from the packed queries, summed over
        heads, is added to it (`attention_read`)."""
        if pack is None:
            out = attention(q, k, v, mask)  # a block of queries at a time past a score budget
            B, _, T, _ = q.shape
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        out = q.new_empty(self.num_heads, q.shape[2], v.shape[-1])  # (Hq, N, D)
        every_row = k.shape[0]
        for size, members, tokens in pack.buckets:
            whole = members.shape[0] == every_row  # every row is in this bucket: members are 0 .. n-1
            qg = q[0][:, tokens].transpose(0, 1)  # (g, Hq, A, D)
            kg, vg = (k, v) if whole else (k[members], v[members])
            mg = None if mask is None else (mask if whole else mask[members])[:, :, :size]
            if read is None:
                out[:, tokens] = attention(qg, kg, vg, mg).transpose(0, 1)
                continue
            # a row's queries past its count repeat its last one (PackedPositions): they do not count twice
            valid = torch.ones_like(tokens, dtype=torch.bool)
            valid[:, 1:] = tokens[:, 1:] != tokens[:, :-1]
            attended, weights = attention_read(qg, kg, vg, mg, valid)
            out[:, tokens] = attended.transpose(0, 1)
            read.index_add_(0, members, weights[:, : read.shape[1]])  # the canvas slots come first
        return self.o_proj(out.transpose(0, 1).reshape(1, q.shape[2], self.num_heads * self.head_dim))


class Router(nn.Module):
    """Top-k routing on the raw residual: scale-free RMSNorm * scale * H^-1/2 -> softmax (fp32) -> top-k,
    renormalised, times a learned per-expert scale."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root_size = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor):
        """x (N, H) -> weights (N, k), expert ids (N, k)."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = scores.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Block(nn.Module):
    """attention, then a dense MLP in parallel with routed experts; each with its own norms."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = GatedMLP(h, config.intermediate_size)
        self.router = Router(config)
        self.experts = Experts(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        # The block's output scale. The checkpoint stores it twice, once per stack, and transformers ties
        # every weight of the two stacks but not these buffers: each stack scales by its own copy.
        self.register_buffer("layer_scalar", torch.ones(1))  # decoder
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) residual stream -> (B, T, H) residual stream, before the layer scalar."""
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat)  # routed on the raw residual, not the normed input
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts).view_as(x)
        routed = self.post_feedforward_layernorm_2(routed)
        return x + self.post_feedforward_layernorm(dense + routed)

    def forward(self, x, rope, key_rope, mask, place_entries, *, encoder: bool, pack: PackedPositions | None = None,
                read: torch.Tensor | None = None):
        """rope: cos, sin (B, T, 1, D) of the new tokens; key_rope: the same for every key (full layers).
        `place_entries(k, v)` puts this block's own cache entries among the cached ones (the encoder:
        after the prefix; the decoder: the canvas before it) in the order `mask` and `key_rope` expect.
        `pack`: x (1, N, H) holds packed canvas positions of several rows (`DiffusionGemma.decode_active`), and
        `read` (n, L) collects the attention they put on each canvas slot (`Attention.attend`).
        Returns the new residual and this block's own entries k, v (v None on full layers)."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), *rope)
        keys, values = self.self_attn.keys_values(*place_entries(k, v), key_rope)
        attended = self.self_attn.attend(q, keys, values, mask) if pack is None else self.self_attn.attend(
            q, keys, values, mask, pack=pack, read=read)
        x = x + self.post_attention_layernorm(attended)
        scalar = self.encoder_layer_scalar if encoder else self.layer_scalar
        return self.feed_forward(x) * scalar, k, v


def place_after_prefix(old_k: torch.Tensor, old_v: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None):
    """New tokens' entries k, v (B, Hkv, T, D) after their layer's cached ones -> (B, Hkv, S + T, D)."""
    return torch.cat([old_k, k], dim=2), None if v is None else torch.cat([old_v, v], dim=2)


def place_in_canvas_slots(keys: torch.Tensor, values: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None):
    """Write the canvas's entries k, v (B, Hkv, L, D) into the first L slots of its layer's buffers."""
    L = k.shape[2]
    keys[:, :, :L] = k
    if values is not None:
        values[:, :, :L] = v
    return keys, values
