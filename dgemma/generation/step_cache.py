"""The step cache: canvas positions that have settled stop costing decoder compute (SamplingConfig.step_cache).

Every denoising step runs the whole canvas through the decoder, even when most positions no longer change.
With the step cache a step runs only the *active* positions (`DiffusionGemma.decode_active`); a settled
position keeps its logits from the last step that computed it (the sampler, self-conditioning and the stop rule
read them as if they were new) and its keys/values in the cache's canvas slots (what the active positions
attend to).

The rule, per row and canvas position, over one canvas:
  * the first step computes every position, and so does every `cache_refresh`-th step (0: never);
  * a position settles when its argmax has been the same for `settle_steps` consecutive steps and its top
    probability at the step's temperature is >= `settle_probability`;
  * a position the sampler draws a sample for (accepts) runs again when that sample is not the token it was
    last computed with: a settled one wakes, one about to settle waits. So a settled position the sampler
    keeps reads the token its logits and keys/values were made from, and at a constrained row's accepted
    positions that is the guide's token (one its automaton allows);
  * rows that stopped are not computed at all.
The approximation: a settled position's logits and keys/values were made with the other positions as they
were then, and with its own token as it was then: while the sampler re-noises a settled position (it is not
accepted yet), the others keep seeing the token it was computed with, not the fresh noise the cache-off path
feeds them, and its self-conditioning is its kept prediction. For a model whose logits at a position depend
only on that position's token, with every position accepted at every step, it is exact.

`decoder_positions` counts what ran through the decoder, per row.

Shapes: B rows, L canvas length, V vocabulary.
"""

from __future__ import annotations

import torch

from dgemma.config import SamplingConfig
from dgemma.device_sync import host_read
from dgemma.model.packing import PackedPositions


class StepCache:
    """One canvas's step cache for B rows (a new one per canvas)."""

    def __init__(self, sampling: SamplingConfig, batch_size: int, canvas_length: int, vocab_size: int, device):
        self.settle_steps = sampling.settle_steps
        self.settle_probability = sampling.settle_probability
        self.refresh = sampling.cache_refresh
        shape = (batch_size, canvas_length)
        # each position's logits from the last step that computed it (zeros: uniform, until computed)
        self.logits = torch.zeros(*shape, vocab_size, dtype=torch.float32, device=device)
        self.computed_with = torch.full(shape, -1, dtype=torch.long, device=device)  # the token it read then
        self.last_argmax = torch.full(shape, -1, dtype=torch.long, device=device)
        self.stable = torch.zeros(shape, dtype=torch.long, device=device)  # consecutive steps with that argmax
        self.settled = torch.zeros(shape, dtype=torch.bool, device=device)
        self.steps = 0
        self.decoder_positions = [0] * batch_size  # per row, summed over the steps (host)

    def active(self, done: torch.Tensor) -> torch.Tensor:
        """done (B,) rows that stopped -> (B, L) bool: the positions this step computes."""
        whole = self.steps == 0 or (self.refresh > 0 and self.steps % self.refresh == 0)
        active = torch.ones_like(self.settled) if whole else ~self.settled
        return active & ~done[:, None]

    def logits_for(self, model, canvas: torch.Tensor, cache, done: torch.Tensor, *, self_conditioning=None,
                   rows=None) -> torch.Tensor:
        """The step's logits (B, L, V) fp32 from `model.decode_active` over the active positions (one host read:
        their counts), the rest as last computed. A new buffer, which the sampler may overwrite."""
        active = self.active(done)
        counts = host_read(active.sum(dim=1), "step cache: active positions")
        pack = PackedPositions.from_mask(active, counts)
        computed = None
        if pack.total:
            computed = model.decode_active(canvas, cache, pack, self_conditioning=self_conditioning, rows=rows)
        return self.take(computed, pack, canvas, active)

    def take(self, computed: torch.Tensor | None, pack: PackedPositions, canvas: torch.Tensor,
             active: torch.Tensor) -> torch.Tensor:
        """After a forward over `pack` (this cache's rows' `active` positions, packed): computed (N, V) fp32 their
        logits (None when N = 0) -> the step's logits (B, L, V), a new buffer the sampler may overwrite."""
        if computed is not None:
            pack.scatter(computed, self.logits)
        self.computed_with = torch.where(active, canvas, self.computed_with)
        self.settled &= ~active
        self.decoder_positions = [d + c for d, c in zip(self.decoder_positions, pack.counts)]
        self.steps += 1
        return self.logits.clone()

    def settle(self, argmax: torch.Tensor, probs: torch.Tensor, drawn: torch.Tensor, next_canvas: torch.Tensor,
               done: torch.Tensor):
        """After the step's sampler: argmax (B, L), probs (B, L, V) or (B * L, V) its tempered probabilities,
        drawn (B, L) bool the positions that took a sample, next_canvas (B, L) what the next step reads, done (B,)
        rows that stopped."""
        B, L = argmax.shape
        top = probs.reshape(B, L, -1).amax(dim=-1)
        same = argmax == self.last_argmax
        self.stable = torch.where(same, self.stable + 1, torch.ones_like(self.stable))
        self.last_argmax = argmax
        settles = (self.stable >= self.settle_steps) & (top >= self.settle_probability) & ~done[:, None]
        # a position that takes a sample other than the token it was computed with runs again (a settled one
        # wakes, and one that would settle now waits until it has been computed with its token)
        stale = drawn & (next_canvas != self.computed_with)
        self.settled = (self.settled | settles) & ~stale
