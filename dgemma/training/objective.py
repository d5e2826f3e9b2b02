"""The training objective: uniform-state corruption, the diffusion loss and the encoder's next-token loss.

Per example (facts sheet 3.2 / 3.3 / 3.6):
  1. t ~ U(eps, 1); pick one canvas j of the response uniformly.
  2. encoder (causal) over the clean [prompt ; response ; EOS fill]  -> KV cache + hidden states.
  3. x_t = canvas j with each token replaced, with probability t, by a uniform vocabulary token (no mask
     token; a replacement may equal the clean token).
  4. decoder pass 1 on x_t, no self-conditioning, no gradient -> logits_1;
     with probability 1/2 (per example) logits_1 feed pass 2 as self-conditioning, otherwise zeros.
  5. L_diff = mean cross-entropy over all L positions of canvas j (corrupted or not, no t-weighting).
  6. L_AR   = mean next-token cross-entropy of the encoder over the response.
  7. loss = L_diff + w * L_AR (w = 1.0), averaged over examples.
One t per example is the same as one t per canvas here, since only one canvas is scored.

The cache-aware variant (`--cache-aware P`, off by default) trains the model to read the step cache's kept
keys/values (dgemma.generation.step_cache). With probability P an example with self-conditioning gets an
earlier, noisier canvas x_e (every position corrupted in x_t, with fresh noise, and each other one with
probability u ~ U(0, 1)), run through the decoder twice without gradient as generation would (no signal, then
self-conditioned on the first). Its confident positions (top probability >= `--cache-aware-settle`) are the
ones the step cache would have settled: in pass 2 the other positions read, for them, the keys/values of every
layer as the x_e pass computed them (detached), which is what generation hands over, and the loss of such an
example is the mean over the positions it would compute (the settled ones' logits are kept, not computed).
Cost: two more decoder forwards without gradient per step while P > 0 (`benchmarks/README.md`).
The decoder reads the cache through `prefix_length = prompt_len + j * L`: it sees the clean prompt and
the clean earlier canvases and nothing after, exactly what generation sees.

The autoregressive baseline trains the same network with L_AR alone.

Noise is drawn per example from a generator seeded by (run seed, the example's stream position), so the
losses of a global batch do not depend on how it is split over processes and micro-batches, and a
resumed run draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dgemma.device_sync import to_device
from dgemma.model.network import PreviousStep
from dgemma.training.data import Batch


@dataclass
class Noise:
    """Everything random about one micro-batch's diffusion loss (CPU tensors)."""

    t: torch.Tensor  # (B,) float, corruption probability
    canvas_index: torch.Tensor  # (B,) long, which canvas of the response is scored
    replace: torch.Tensor  # (B, L) bool, positions to corrupt
    random_tokens: torch.Tensor  # (B, L) long, their replacements
    self_condition: torch.Tensor  # (B,) bool, feed pass-1 logits to pass 2
    # the cache-aware variant (None without it): rows whose pass 2 reads an earlier canvas's keys/values, and
    # that canvas: the positions corrupted there (B, L) bool and their tokens (B, L) long
    stale: torch.Tensor | None = None
    earlier_replace: torch.Tensor | None = None
    earlier_tokens: torch.Tensor | None = None


def example_seed(run_seed: int, stream_position: int) -> int:
    return (run_seed * 0x9E3779B1 + stream_position * 0x85EBCA77 + 1) % (1 << 63)


def draw_noise(batch: Batch, *, run_seed: int, canvas_length: int, vocab_size: int,
               eps: float, self_cond_prob: float, cache_aware: float = 0.0) -> Noise:
    """One micro-batch's noise, each example's from its own generator. The cache-aware draws come after
    the others, so turning the variant on changes no other draw."""
    rows = []
    for position, canvases in zip(batch.stream_position.tolist(), batch.num_canvases.tolist()):
        gen = torch.Generator().manual_seed(example_seed(run_seed, position))
        t = eps + (1.0 - eps) * torch.rand((), generator=gen)
        canvas = torch.randint(canvases, (), generator=gen)
        replace = torch.rand(canvas_length, generator=gen) < t
        tokens = torch.randint(vocab_size, (canvas_length,), generator=gen)
        coin = torch.rand((), generator=gen) < self_cond_prob
        row = (t, canvas, replace, tokens, coin)
        if cache_aware > 0:
            stale = coin & (torch.rand((), generator=gen) < cache_aware)
            more = torch.rand(canvas_length, generator=gen) < torch.rand((), generator=gen)  # u ~ U(0, 1)
            row += (stale, replace | more, torch.randint(vocab_size, (canvas_length,), generator=gen))
        rows.append(row)
    return Noise(*(torch.stack(column) for column in zip(*rows)))


def corrupt(clean: torch.Tensor, replace: torch.Tensor, random_tokens: torch.Tensor) -> torch.Tensor:
    """Uniform-state corruption: clean (B, L) -> x_t (B, L)."""
    return torch.where(replace, random_tokens, clean)


def scored_canvas(input_ids: torch.Tensor, start: torch.Tensor, canvas_length: int) -> torch.Tensor:
    """input_ids (B, N), start (B,) -> the clean canvas input_ids[b, start_b : start_b + L], (B, L)."""
    columns = start[:, None] + torch.arange(canvas_length, device=input_ids.device)
    return input_ids.gather(1, columns)


def next_token_loss(model, hidden: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Encoder hidden (B, N, H) -> per-example mean next-token CE over target positions, (B,).

    Only the rows that predict a target go through the LM head: (n, H) -> (n, V), not (B, N, V).
    """
    predicts = targets[:, 1:]  # (B, N-1): position k predicts token k+1
    logits = model.head(hidden[:, :-1][predicts])  # (n, V) fp32
    ce = F.cross_entropy(logits, input_ids[:, 1:][predicts], reduction="none")  # (n,)
    row = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(predicts)[predicts]
    per_row = torch.zeros(input_ids.shape[0], device=ce.device).index_add_(0, row, ce)
    return per_row / predicts.sum(1).clamp(min=1)


@dataclass
class Losses:
    """Per-example losses, (B,) each; `total` is what is minimised."""

    total: torch.Tensor
    diffusion: torch.Tensor
    ar: torch.Tensor


class CanvasEntries:
    """A training cache (keep_all KVCache) as one decoder pass sees it: `place_before_prefix`, which every layer calls
    with the canvas's own entries, either records them (detached; `kept` None) or hands the kept ones over, as
    the step cache does in generation: kept[layer] holds the entries of the rows `rows` (n,) and `stale` (n, L)
    bool says which of their positions read them. Everything else is the cache's."""

    def __init__(self, cache, kept: list | None = None, rows: torch.Tensor | None = None,
                 stale: torch.Tensor | None = None):
        self.cache, self.kept, self.rows, self.stale = cache, kept, rows, stale
        self.recorded: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def place_before_prefix(self, layer: int, sliding: bool, rows, k: torch.Tensor, v: torch.Tensor | None):
        """k, v (B, Hkv, L, D; v None on full layers) -> the layer's keys/values over [canvas | prefix]."""
        if self.kept is None:
            self.recorded.append((k.detach(), None if v is None else v.detach()))
        else:
            k, v = (None if new is None else self._hand_over(new, old) for new, old in zip((k, v), self.kept[layer]))
        return self.cache.place_before_prefix(layer, sliding, rows, k, v)

    def _hand_over(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """new (B, Hkv, L, D) with the kept rows' stale positions taken from old (n, Hkv, L, D), detached;
        gradients flow through the rest."""
        where = torch.zeros(new.shape[0], new.shape[2], dtype=torch.bool, device=new.device)  # (B, L)
        where[self.rows] = self.stale
        full = torch.zeros_like(new, requires_grad=False)
        full[self.rows] = old.to(new.dtype)
        return torch.where(where[:, None, :, None], full, new)


def earlier_entries(model, cache, noise: Noise, clean: torch.Tensor, start: torch.Tensor, settle: float,
                    rows: list[int]):
    """The cache-aware variant's earlier canvas x_e of the rows `rows` (n of them), denoised as generation would (no
    signal, then self-conditioned on that), without gradient -> (every layer's canvas entries of those rows from
    the second pass, each (n, Hkv, L, D), and (n, L) bool the positions it is sure of: top probability >= settle)."""
    device = clean.device
    index = to_device(rows, torch.long, device)
    earlier = torch.where(noise.earlier_replace.to(device), noise.earlier_tokens.to(device), clean)[index]
    with torch.no_grad():
        first = model.denoise(earlier, cache, prefix_length=start[index], rows=rows)
        recorder = CanvasEntries(cache)
        logits = model.denoise(earlier, recorder, self_conditioning=PreviousStep.from_logits(first),
                               prefix_length=start[index], rows=rows)
    return recorder.recorded, logits.softmax(dim=-1).amax(dim=-1) >= settle


def diffusion_losses(model, batch: Batch, noise: Noise, *, encoder_loss_weight: float = 1.0,
                     cache_dtype: torch.dtype | None = None, lockstep: bool = False,
                     cache_aware_settle: float = 0.9) -> Losses:
    """The DiffusionGemma objective on one micro-batch (tensors already on the model's device); with
    `noise.stale` the cache-aware variant (module docstring), its settled positions at `cache_aware_settle`.

    `lockstep`: always run the same passes whatever the data says, as FSDP needs (every pass gathers the
    weights collectively, so a process that skipped one would leave the others waiting).
    """
    B, N = batch.input_ids.shape
    L = model.config.canvas_length
    device = batch.input_ids.device
    start = batch.prompt_length + noise.canvas_index.to(device) * L  # (B,) first position of the canvas
    if encoder_loss_weight != 0:
        cache = model.new_cache(B, N, keep_all=True, dtype=cache_dtype)
        hidden = model.encode(batch.input_ids, cache, batch.attention_mask, return_hidden=True)  # (B, N, H)
        ar = next_token_loss(model, hidden, batch.input_ids, batch.ar_targets)
    else:  # no next-token loss: encode only the columns some decoder reads (< its prefix_length)
        width = max(1, int(start.max()))
        cache = model.new_cache(B, width, keep_all=True, dtype=cache_dtype)
        model.encode(batch.input_ids[:, :width], cache, batch.attention_mask[:, :width], return_logits=False)
        ar = torch.zeros(B, device=device)

    clean = scored_canvas(batch.input_ids, start, L)  # (B, L)
    noisy = corrupt(clean, noise.replace.to(device), noise.random_tokens.to(device))
    use_sc = noise.self_condition.to(device)
    if lockstep or use_sc.any():
        with torch.no_grad():
            first = model.denoise(noisy, cache, prefix_length=start)  # pass 1: no SC, no gradient
    else:  # every coin says "zeros": pass 1 would be masked out anyway
        first = torch.zeros(B, L, model.config.vocab_size, device=device)
    previous = PreviousStep.from_logits(first, mask=use_sc)
    decoder_cache, computed = cache, None
    if noise.stale is not None and (lockstep or noise.stale.any()):
        # the rows that read kept entries (every row in lockstep, each process running the same passes)
        rows = list(range(B)) if lockstep else noise.stale.nonzero().squeeze(1).tolist()  # a host tensor
        kept, sure = earlier_entries(model, cache, noise, clean, start, cache_aware_settle, rows)
        index = to_device(rows, torch.long, device)
        stale = sure & noise.stale.to(device)[index][:, None]  # (n, L)
        decoder_cache = CanvasEntries(cache, kept, index, stale)
        computed = torch.ones(B, L, dtype=torch.bool, device=device)
        computed[index] = ~stale
    logits = model.denoise(noisy, decoder_cache, self_conditioning=previous, prefix_length=start)  # (B, L, V)
    ce = F.cross_entropy(logits.transpose(1, 2), clean, reduction="none")  # (B, L)
    if computed is None:
        diffusion = ce.mean(1)  # (B,)
    else:  # the positions generation would compute (a row none of whose positions settled: all of them)
        diffusion = (ce * computed).sum(1) / computed.sum(1).clamp(min=1)
    return Losses(diffusion + encoder_loss_weight * ar, diffusion, ar)


def ar_losses(model, batch: Batch, *, cache_dtype: torch.dtype | None = None) -> Losses:
    """The autoregressive baseline: the encoder and the LM head with next-token loss only."""
    B, N = batch.input_ids.shape
    cache = model.new_cache(B, N, dtype=cache_dtype)
    hidden = model.encode(batch.input_ids, cache, batch.attention_mask, return_hidden=True)
    ar = next_token_loss(model, hidden, batch.input_ids, batch.ar_targets)
    return Losses(ar, torch.zeros_like(ar), ar)
