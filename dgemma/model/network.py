"""The DiffusionGemma text network, top to bottom.

One backbone, two modes, the same weights:
  encode  -- causal over new tokens, writes their keys/values into the cache (prompt, committed canvases)
  denoise -- bidirectional over a canvas, reads the cache, never writes it; input embeddings are mixed
             with a self-conditioning signal made from the previous step's logits.

Shapes: B batch, T new tokens, L canvas length, S cached slots, H hidden, V vocab, E experts.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.config import ModelConfig, SamplingConfig
from dgemma.device_sync import host_read, to_device
from dgemma.model.attention import KVCache, canvas_mask, causal_mask, image_blocks, rope_inv_freq, rope_tables
from dgemma.model.block import Block, place_after_prefix, place_in_canvas_slots
from dgemma.model.layers import GatedMLP, RMSNorm
from dgemma.model.packing import PackedPositions
from dgemma.model.vision import VisionEmbedder, VisionTower

if TYPE_CHECKING:
    from dgemma.compilation.steps import CompiledSteps
    from dgemma.model.adapters import AdapterRows
    from dgemma.quant.int8_compute import Int8Table


# The eager LM head writes its fp32 logits a block of positions at a time (see `DiffusionGemma.head`), and
# self-conditioning embeddings are made a block at a time; `vocab_chunk_rows` picks the block.
HEAD_CHUNK_ELEMENTS = 1 << 21
# one canvas: a 262k vocabulary's table (1.48 GB) read once a canvas, not four times in 64-row blocks (the 26B's
# head 0.31 s against 0.59 s, its soft embedding 0.39 against 0.78 s; 2 AMX cores), for a (256, V) bf16
# temporary of 134 MB
VOCAB_MIN_ROWS = 256
# the LM head on a CPU: each block of positions against a slice of the table at a time, so that its model-dtype
# output is a (block, slice) temporary of at most this many elements (16 MB in bf16) and not (block, V) beside the
# fp32 logits (134 MB at the 26B's canvas, at a step's peak memory); every slice is still read once a block, and
# each logit is the same dot product (bit-identical; 0.33 s against 0.35 s at the 26B's shape on 2 AMX cores)
HEAD_SLICE_ELEMENTS = 1 << 23


def vocab_chunk_rows(rows: int, vocab: int, device_type: str, free_bytes: int | None = None,
                     element_bytes: int = 2) -> int:
    """Positions per matmul against the (V, H) table, for `rows` positions: every matmul reads the whole table
    (1.48 GB at the 26B shape), and each leaves a (block, V) model-dtype temporary beside the fp32 buffer.

    On a GPU: all rows in one matmul when that temporary takes at most a quarter of the free memory
    (`free_bytes`), else the most that do. On a CPU: HEAD_CHUNK_ELEMENTS per block (a 256-position canvas of
    an 8k vocabulary in one matmul: two blocks of 128 took ~0.4 ms more per self-conditioning embedding),
    but never fewer than VOCAB_MIN_ROWS positions, so a 262k vocabulary is read once for a 256-token canvas
    (a 134 MB temporary).
    """
    if device_type == "cuda":
        if free_bytes is None:
            return rows
        return max(1, min(rows, free_bytes // 4 // (vocab * element_bytes)))
    return max(1, min(rows, max(VOCAB_MIN_ROWS, HEAD_CHUNK_ELEMENTS // vocab)))


def device_vocab_chunk_rows(rows: int, vocab: int, device: torch.device, element_bytes: int = 2) -> int:
    """`vocab_chunk_rows` for a tensor's device (asks CUDA for its free memory)."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return vocab_chunk_rows(rows, vocab, device.type, free, element_bytes)


class SelfConditioning(GatedMLP):
    """Decoder-only input block: scale-free-norm(embed(canvas) + MLP(norm(soft embedding of prev logits)))."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.intermediate_size)
        self.pre_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # first step: the signal is exactly zero and so is the MLP of zero
            return self.post_norm(embeds)
        return self.post_norm(embeds + super().forward(self.pre_norm(soft)))


@dataclass(frozen=True)
class PreviousStep:
    """What self-conditioning feeds the decoder: its prediction at the previous step on this canvas, as
    softmax(logits / T) `probs` (B, L, V), what the sampler leaves in its logits buffer, or as their expected
    embedding `embedding` (B, L, H), made with `DiffusionGemma.soft_embedding_from_probs` (an engine keeps that
    and lets the (B, L, V) buffer go). `mask` (B,) bool: rows where False get no signal (training draws it per
    row, as transformers' self_conditioning_mask)."""

    probs: torch.Tensor | None = None
    embedding: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self):
        if (self.probs is None) == (self.embedding is None):
            raise ValueError("PreviousStep holds the probabilities or their embedding: exactly one of them")

    @classmethod
    def from_logits(cls, logits: torch.Tensor, mask: torch.Tensor | None = None) -> PreviousStep:
        """From the previous step's (temperature-scaled) logits (B, L, V)."""
        return cls(probs=logits.softmax(dim=-1, dtype=torch.float32), mask=mask)


class DiffusionGemma(nn.Module):
    def __init__(self, config: ModelConfig, sampling_config: SamplingConfig | None = None):
        super().__init__()
        self.config = config
        self.sampling_config = sampling_config or SamplingConfig(
            eos_token_ids=(config.eos_token_id,), pad_token_id=config.pad_token_id
        )
        # what loading (dgemma.weights.checkpoint) records: the config.json and generation_config.json read
        # (kept for saving), the folder (its tokenizer files are saved along), every checkpoint key's fate
        self.hf_config: dict | None = None
        self.hf_generation_config: dict | None = None
        self.source_dir: str | Path | None = None
        self.load_report: dict[str, str] | None = None
        self.quantization: str | None = None  # "int8" / "int4" once swapped by dgemma.quant.quantize
        # int8 compute (dgemma.quant.int8_compute.enable): whether it is on, and the tied table's int8 codes
        # (LM head, soft embedding) when the table is large enough to repay them
        self.int8_compute_on = False
        self.int8_table: Int8Table | None = None
        # served LoRA adapters (dgemma.model.adapters.install_adapters): the adapter of each row of a forward
        self.adapter_rows: AdapterRows | None = None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        # the image path: Gemma 4's vision tower, and the map of its soft tokens into the embedding space
        self.vision_tower = self.embed_vision = None
        if config.vision is not None:
            self.vision_tower = VisionTower(config.vision)
            self.embed_vision = VisionEmbedder(config.vision, config.hidden_size)
        self._inv_freq: dict = {}
        # `decode_canvas` and `encode_tokens` under torch.compile, once dgemma.compilation.steps.compile_model
        # made them; `encode` and `denoise` call them instead of the eager ones
        self.compiled: CompiledSteps | None = None
        if self.embed_tokens.weight.device.type != "meta":
            self.reset_parameters()

    # -- setup ------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Random init: normal(0, initializer_range) for matrices, ones for norms and scales."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for p in self.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.fill_(1.0)
        for block in self.layers:
            block.layer_scalar.fill_(1.0)
            block.encoder_layer_scalar.fill_(1.0)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def cache_config(self) -> ModelConfig:
        """The config the KV cache is shaped by (a rank of a split model holds only its KV heads)."""
        return self.config

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def step_cache_refusal(self, adapter: int = 0) -> str | None:
        """Why this model cannot run the step cache's packed step (`decode_active`) for rows of LoRA adapter
        `adapter` (0: the base model), or None: the one rule the engine, the server and the commands ask. Every
        model runs it (served LoRA adapters per packed position, a split model with its attention read summed
        over the ranks); a subclass that cannot says why here."""
        return None

    def new_cache(self, batch_size: int, max_length: int, *, keep_all: bool = False, device=None, dtype=None):
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_length={max_length} exceeds the model's context of {self.config.max_position_embeddings}"
            )
        return KVCache(
            self.cache_config, batch_size, max_length, keep_all=keep_all,
            device=device or self.device, dtype=dtype or self.dtype,
        )

    def inv_freq(self, sliding: bool) -> torch.Tensor:
        key = (sliding, self.device)
        if key not in self._inv_freq:
            c = self.config
            self._inv_freq[key] = (
                rope_inv_freq(c.head_dim, c.rope_theta, 1.0, self.device)
                if sliding
                else rope_inv_freq(c.global_head_dim, c.global_rope_theta, c.global_partial_rotary_factor, self.device)
            )
        return self._inv_freq[key]

    # -- shared pieces ----------------------------------------------------------------------
    def embed_scale(self) -> torch.Tensor:
        """sqrt(H), rounded to the weights' dtype as the reference does, for token and soft embeddings."""
        return torch.tensor(math.sqrt(self.config.hidden_size), dtype=self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * self.embed_scale()

    def embed_images(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor | None) -> torch.Tensor:
        """Images as patches (N, P, 3 p^2) and their patch positions (N, P, 2), as `dgemma.images` makes them ->
        the embeddings of their soft tokens (n, H), image after image (n: all their soft tokens)."""
        if self.vision_tower is None:
            raise ValueError("image input needs a vision tower, and this model has none (no vision weights)")
        if image_position_ids is None:
            raise ValueError("pixel_values come with image_position_ids (dgemma.images makes both)")
        # checked and counted where the patches are (the host, from dgemma.images: no device read), and the
        # soft tokens kept by an index made there (a mask would make the device's output size a host read)
        counts = self.vision_tower.check(pixel_values, image_position_ids).tolist()  # (N,) soft tokens per image
        filled = to_device(counts, torch.long, self.device)
        soft, _ = self.vision_tower(pixel_values.to(self.device), image_position_ids.to(self.device), filled)
        S = soft.shape[1]
        keep = to_device([n * S + j for n, count in enumerate(counts) for j in range(count)], torch.long, self.device)
        return self.embed_vision(soft.flatten(0, 1)[keep])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, tied LM head, soft-capping: (..., H) -> (..., V) fp32.

        cap * tanh(z / cap) is evaluated as 2 cap * sigmoid(2 z / cap) - cap, in place on the one fp32
        buffer: the same function (to ~1e-6 absolute), but CPU sigmoid is ~4x faster than CPU tanh, and
        over (B, L, V) logits that is a visible share of a denoising step. (Out of place when autograd
        needs the intermediate values.) Eagerly and without autograd, the projection is written into
        the fp32 buffer a chunk of positions at a time (on a CPU also a slice of the table at a time,
        HEAD_SLICE_ELEMENTS), so that its model-dtype output is a chunk, not half a (B, L, V) fp32 buffer
        more beside the logits (with int8 codes of the table: a slice of the table at a time, each read
        once); a compiled graph plans that memory itself.
        """
        normed = self.norm(hidden)
        weight, cap = self.embed_tokens.weight, self.config.final_logit_softcapping
        if torch.is_grad_enabled():
            logits = F.linear(normed, weight).float()
            return torch.sigmoid(logits * (2.0 / cap)) * (2.0 * cap) - cap
        table = self.int8_table
        if torch.compiler.is_dynamo_compiling() or (normed.dtype == torch.float32 and table is None):
            logits = table.logits(normed) if table is not None else F.linear(normed, weight).float()
        else:
            flat = normed.reshape(-1, normed.shape[-1])
            logits = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32, device=flat.device)
            if table is not None:  # int8 codes: a slice of the table at a time, every position together
                table.logits(flat, out=logits)
            else:
                V = weight.shape[0]
                rows = device_vocab_chunk_rows(flat.shape[0], V, flat.device, flat.element_size())
                cols = V if flat.device.type == "cuda" else max(1, HEAD_SLICE_ELEMENTS // rows)
                for a in range(0, flat.shape[0], rows):
                    for b in range(0, V, cols):
                        logits[a : a + rows, b : b + cols] = F.linear(flat[a : a + rows], weight[b : b + cols])
            logits = logits.view(*normed.shape[:-1], weight.shape[0])
        return logits.mul_(2.0 / cap).sigmoid_().mul_(2.0 * cap).sub_(cap)

    def _rope(self, positions: torch.Tensor):
        return {s: rope_tables(positions, self.inv_freq(s), self.dtype) for s in (False, True)}

    # -- encoder: causal, writes the cache --------------------------------------------------
    def encode(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        attention_mask: torch.Tensor | None = None,
        *,
        rows: list[int] | torch.Tensor | None = None,
        return_logits: bool = True,
        return_hidden: bool = False,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        entries_out: list | None = None,
    ):
        """input_ids (B, T) -> logits (B, T, V) fp32 (or hidden (B, T, H)); appends to the cache.

        Row b's tokens sit at positions cache length of b, +1, ...; `rows` (B,) picks cache rows (all if
        None; a list keeps the cache's bookkeeping on the host, see KVCache). attention_mask (B, T) False
        marks padding: never attended, its position still used.
        Images: pixel_values (N, P, 3 p^2) and image_position_ids (N, P, 2) of the N images the prompts
        hold, in order (row by row); their soft tokens take the places of the `image_token_id` tokens
        (see `dgemma.images`). With use_bidirectional_attention="vision" one image's tokens see each
        other both ways.
        `entries_out`, a list, receives every layer's new cache entries (k, v or None), each (B, Hkv, T, D),
        all T tokens even where a sliding layer's ring keeps fewer (the engine's prefix cache keeps them).
        """
        B, T = input_ids.shape
        cache.check_room(T, rows)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        images = blocks = None
        if pixel_values is not None:
            is_image = (input_ids == self.config.image_token_id) & valid  # (B, T)
            soft = self.embed_images(pixel_values, image_position_ids)
            held = host_read(is_image.sum(), "image tokens")
            if held != soft.shape[0]:
                raise ValueError(f"the prompt holds {held} image tokens for the {soft.shape[0]} "
                                 f"soft tokens of {pixel_values.shape[0]} images")
            images = (is_image, soft)
            if self.config.use_bidirectional_attention == "vision":
                blocks = image_blocks(is_image)
        positions = cache.lengths(rows)[:, None] + torch.arange(T, device=input_ids.device)  # (B, T)
        key_pos = torch.where(valid, positions, torch.full_like(positions, -1))
        rope = self._rope(positions)
        masks, key_positions = {}, {}
        for sliding in (False, True):
            key_positions[sliding] = torch.cat([cache.cached_positions(sliding, rows), key_pos], dim=1)  # (B, S+T)
            window = self.config.sliding_window if sliding else None
            masks[sliding] = causal_mask(positions, key_positions[sliding], window, blocks)
        key_rope = {False: rope_tables(key_positions[False], self.inv_freq(False), self.dtype), True: None}
        prefixes = [cache.view(i, block.self_attn.sliding, rows)[:2] for i, block in enumerate(self.layers)]
        # compiled for passes without gradients; prompts with images run eagerly (rare, and a graph less to compile)
        compiled = self.compiled is not None and not torch.is_grad_enabled() and images is None
        layers = self.compiled.encode_tokens if compiled else self.encode_tokens
        x, entries = layers(input_ids, prefixes, rope, key_rope, masks, images)
        for i, (block, (k, v)) in enumerate(zip(self.layers, entries)):
            cache.write(i, block.self_attn.sliding, rows, positions, k, v)
        cache.commit_positions(rows, positions, valid, padded=attention_mask is not None)
        if entries_out is not None:
            entries_out.extend(entries)
        if return_hidden:
            return x
        return self.head(x) if return_logits else None

    def encode_tokens(self, input_ids, prefixes, rope, key_rope, masks, images=None):
        """The encoder's layers on tensors alone (its compile boundary, compiled as `self.compiled`): input_ids
        (B, T) -> hidden (B, T, H) and every layer's cache entries (k, v), each (B, Hkv, T, D), v None on full
        layers.

        prefixes[i] = layer i's cached (keys, values or None), each (B, Hkv, S, D); the new tokens attend
        to them and to each other (`masks`), and the cache is written by the caller. images: None, or
        (is_image (B, T) bool, soft token embeddings (n, H)) to put in place of the marked tokens, in order.
        """
        x = self.embed(input_ids)
        if images is not None:
            is_image, soft = images
            x = x.masked_scatter(is_image[..., None], soft.to(x.dtype))
        entries = []
        for block, (old_k, old_v) in zip(self.layers, prefixes):
            s = block.self_attn.sliding
            x, k, v = block(x, rope[s], key_rope[s], masks[s], partial(place_after_prefix, old_k, old_v),
                            encoder=True)
            entries.append((k, v))
        return x, entries

    # -- decoder: bidirectional over the canvas, reads the cache -----------------------------
    def soft_embedding_from_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """softmax(previous logits) (B, L, V), as the sampler leaves it -> expected embedding (B, L, H), scaled
        like token embeddings."""
        if self.int8_table is not None and not torch.is_grad_enabled():
            return self.int8_table.soft_embedding(probs, self.dtype) * self.embed_scale()
        return (probs.to(self.dtype) @ self.embed_tokens.weight) * self.embed_scale()

    def self_conditioning_signal(self, previous: PreviousStep | None, pack: PackedPositions | None = None):
        """What the self-conditioning block adds to the canvas's embeddings: the previous step's expected
        embedding (B, L, H), zero on the rows its mask leaves out; None at a canvas's first step (an exactly
        zero signal). With `pack`, only the packed positions: (1, N, H)."""
        if previous is None:
            return None
        if pack is None:
            soft = previous.embedding if previous.probs is None else self.soft_embedding_from_probs(previous.probs)
            row_mask = None if previous.mask is None else previous.mask[:, None, None]  # (B, 1, 1)
        else:
            soft = (pack.gather(previous.embedding) if previous.probs is None
                    else self.soft_embedding_from_probs(pack.gather(previous.probs)))[None]
            row_mask = None if previous.mask is None else previous.mask[pack.row_of][None, :, None]  # (1, N, 1)
        return soft if row_mask is None else soft * row_mask.to(soft.dtype)

    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache: KVCache,
        *,
        self_conditioning: PreviousStep | None = None,
        prefix_length: torch.Tensor | None = None,
        rows: list[int] | torch.Tensor | None = None,
        return_hidden: bool = False,
        self_conditioning_logits: torch.Tensor | None = None,
    ):
        """canvas_ids (B, L) -> logits (B, L, V) fp32, soft-capped. The cache is not modified.
        `self_conditioning`: the previous step's prediction on this canvas (`PreviousStep`); None at its first
        step, which is an exactly zero signal. `self_conditioning_logits` (B, L, V), the previous step's
        temperature-scaled logits, is the keyword of dgemma 0.1 (and transformers'): deprecated, it stands for
        `self_conditioning=PreviousStep.from_logits(logits)` and goes in dgemma 0.3."""
        if self_conditioning_logits is not None:
            if self_conditioning is not None:
                raise TypeError("denoise takes self_conditioning or self_conditioning_logits, not both")
            warnings.warn("denoise(self_conditioning_logits=logits) is deprecated: pass "
                          "self_conditioning=dgemma.PreviousStep.from_logits(logits); the old keyword goes in dgemma 0.3",
                          DeprecationWarning, stacklevel=2)
            self_conditioning = PreviousStep.from_logits(self_conditioning_logits)
        B, L = canvas_ids.shape
        if prefix_length is None:  # generation: the same tables for every step of a canvas
            rope, key_rope, masks = cache.tables_for_positions(
                ("canvas", L), rows, lambda: self._canvas_tables(cache, cache.lengths(rows), L, rows, True))
        else:
            rope, key_rope, masks = self._canvas_tables(cache, prefix_length, L, rows)

        soft = self.self_conditioning_signal(self_conditioning)  # (B, L, H) or None
        if cache.canvas_slots == L and not torch.is_grad_enabled():
            # generation: the canvas goes into the cache's reserved slots, through the compiled step once
            # there is one. A zero signal gives exactly what no signal gives (the MLP of zero is zero), and
            # one graph fewer.
            if soft is None:
                soft = torch.zeros(B, L, self.config.hidden_size, dtype=self.dtype, device=self.device)
            decode = self.decode_canvas if self.compiled is None else self.compiled.decode_canvas
            return decode(canvas_ids, soft, cache.canvas_buffers(rows), rope, key_rope, masks, return_hidden)
        # training (keep_all cache) or gradients: the canvas's entries concatenated before the prefix
        x = self.self_conditioning(self.embed(canvas_ids), soft)
        for i, block in enumerate(self.layers):
            s = block.self_attn.sliding
            x, _, _ = block(x, rope[s], key_rope[s], masks[s], partial(cache.place_before_prefix, i, s, rows),
                            encoder=False)
        return x if return_hidden else self.head(x)

    def decode_canvas(self, canvas_ids, soft, buffers, rope, key_rope, masks, return_hidden: bool = False):
        """The decoder from canvas ids to logits (B, L, V) fp32, or the hidden states (B, L, H), on tensors
        alone: the compile boundary (`dgemma.compilation.steps.compile_model` compiles it as `self.compiled`).

        buffers[i] = (keys, values or None), each (B, Hkv, L + S, D) [canvas | prefix] for layer i: the
        canvas's own entries are written into the first L slots, then the layer attends to all of it.
        """
        x = self.self_conditioning(self.embed(canvas_ids), soft)  # (B, L, H)
        for block, (keys, values) in zip(self.layers, buffers):
            s = block.self_attn.sliding
            x, _, _ = block(x, rope[s], key_rope[s], masks[s], partial(place_in_canvas_slots, keys, values), encoder=False)
        return x if return_hidden else self.head(x)

    def decode_active(self, canvas_ids: torch.Tensor, cache: KVCache, pack: PackedPositions, *,
                      self_conditioning: PreviousStep | None = None, rows=None, return_hidden: bool = False,
                      read: torch.Tensor | None = None):
        """The step cache's decoder step: only the packed positions `pack` of the canvases canvas_ids (n, L)
        run through the layers, the experts and the LM head -> their logits (N, V) fp32 (or hidden (N, H)).

        Each active position attends to its row's [canvas slots | cached prefix]: the canvas slots hold every
        position's keys/values from the last step that computed it, and this step's active positions write
        theirs there first (`KVCache.place_active_in_slots`), so settled positions are seen as they were when
        they were last computed. With every position active this is `denoise` (the same numbers, up to the
        order of float sums). Eager only (a compiled model runs this eagerly); not on every model
        (`step_cache_refusal`).
        `read` (n, L) fp32: the attention weight the packed positions put on each canvas slot in every layer
        after the first is added to it (summed over heads and positions; the first layer's keys/values depend
        on a position's own token alone, so a settled one's are never stale). The step cache's
        attention-targeted refresh reads it.
        """
        adapted = self.adapter_rows is not None and self.adapter_rows.ids is not None  # rows of adapters in this forward
        refusal = self.step_cache_refusal(int(adapted))
        if refusal is not None:
            raise ValueError(refusal)
        n, L = canvas_ids.shape
        if cache.canvas_slots != L:
            raise ValueError("decode_active needs a generation cache (one with canvas slots)")
        rope, key_rope, masks = cache.tables_for_positions(
            ("canvas", L), rows, lambda: self._canvas_tables(cache, cache.lengths(rows), L, rows, True))
        packed_rope = {s: tuple(t[pack.row_of, pack.index][None] for t in rope[s]) for s in rope}  # (1, N, 1, D)
        soft = self.self_conditioning_signal(self_conditioning, pack)  # (1, N, H) or None
        adapters = self.adapter_rows
        packed = adapters.packed(pack.row_of) if adapters is not None else contextlib.nullcontext()
        with packed:  # served LoRA adapters: each packed position takes its row's
            x = self.self_conditioning(self.embed(pack.gather(canvas_ids)[None]), soft)  # (1, N, H)
            for i, block in enumerate(self.layers):
                s = block.self_attn.sliding
                x, _, _ = block(x, packed_rope[s], key_rope[s], masks[s],
                                partial(cache.place_active_in_slots, i, rows, pack), encoder=False, pack=pack,
                                read=read if i else None)
        if read is not None:
            self.gather_read(read)
        return x[0] if return_hidden else self.head(x[0])

    def gather_read(self, read: torch.Tensor):
        """`decode_active`'s attention read (n, L), in place: whole here (a split model sums its ranks' heads)."""
        return None

    def _canvas_tables(self, cache: KVCache, prefix_length: torch.Tensor, L: int, rows, at_cache_lengths=False):
        """For a canvas at prefix_length (B,) .. + L - 1, per layer kind: RoPE tables of the canvas, of
        every key in [canvas | cached slots] order (full layers), and the masks; a mask is None when every
        key is visible (attention then skips reading one). For a canvas right after the rows' prefixes
        (`at_cache_lengths`) the cache decides that on the host; otherwise one host read tells."""
        positions = prefix_length[:, None] + torch.arange(L, device=prefix_length.device)  # (B, L)
        window = self.config.sliding_window
        masks = {s: canvas_mask(cache.cached_positions(s, rows), prefix_length, L, window if s else None)
                 for s in (False, True)}
        visible = {s: cache.prefix_visible(s, rows) if at_cache_lengths else None for s in masks}
        unknown = [s for s in masks if visible[s] is None]
        if unknown:
            visible.update(zip(unknown, host_read(torch.stack([masks[s].all() for s in unknown]), "canvas masks")))
        masks = {s: None if visible[s] else mask for s, mask in masks.items()}
        full_keys = torch.cat([positions, cache.cached_positions(False, rows)], dim=1)  # (B, L + S)
        key_rope = {False: rope_tables(full_keys, self.inv_freq(False), self.dtype), True: None}
        return self._rope(positions), key_rope, masks

