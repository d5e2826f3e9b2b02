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
        """The step's logits (B, L, V) fp32 from `model.decode_active` over the active positions, the rest as last
        computed (`packed_step`). A new buffer, which the sampler may overwrite."""
        def forward(active, counts):
            return model.decode_active(canvas, cache, PackedPositions.from_mask(active, counts),
                                       self_conditioning=self_conditioning, rows=rows)

        return packed_step([self], [canvas], [done], forward)[0][0]

    def record(self, computed: torch.Tensor | None, positions: torch.Tensor, counts: list[int],
               canvas: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """After a forward over this cache's `active` (B, L) positions: computed (N, V) fp32 their logits, packed
        row after row (None when N = 0), positions (N,) their canvas positions, counts each row's N -> the
        step's logits (B, L, V), a new buffer the sampler may overwrite."""
        if computed is not None:
            row_of = torch.repeat_interleave(torch.arange(len(counts), device=positions.device),
                                             torch.tensor(counts, device=positions.device))
            self.logits[row_of, positions] = computed
        self.computed_with = torch.where(active, canvas, self.computed_with)
        self.settled &= ~active
        self.decoder_positions = [d + c for d, c in zip(self.decoder_positions, counts)]
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


def packed_step(caches: list[StepCache], canvases: list[torch.Tensor], dones: list[torch.Tensor], forward):
    """One denoising step for several step caches' rows (the plain loop: one cache of B rows; the engine: one
    cache per request) in ONE decoder forward over all their active positions, packed row after row.

    canvases[i] (B_i, L) and dones[i] (B_i,) belong to caches[i]; forward(active (R, L) bool, counts) runs the
    decoder over the active positions of all R rows, in that order, and returns their logits (N, V) fp32 (it
    is not called when nothing is active). One host read: how many positions each row has. -> each cache's
    step logits (B_i, L, V), and each row's count of positions run."""
    actives = [cache.active(done) for cache, done in zip(caches, dones)]
    active = torch.cat(actives)
    counts = host_read(active.sum(dim=1), "step cache: active positions")
    computed = forward(active, counts) if sum(counts) else None
    positions = active.nonzero(as_tuple=True)[1]  # (N,): the packed order, row after row
    out, row, start = [], 0, 0
    for cache, canvas, cache_active in zip(caches, canvases, actives):
        row_counts = counts[row : row + cache_active.shape[0]]
        n = sum(row_counts)
        part = computed[start : start + n] if computed is not None and n else None
        out.append(cache.record(part, positions[start : start + n], row_counts, canvas, cache_active))
        row, start = row + cache_active.shape[0], start + n
    return out, counts
