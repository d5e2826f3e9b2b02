"""The step cache: canvas positions that have settled stop costing decoder compute (SamplingConfig.step_cache).

Every denoising step runs the whole canvas through the decoder, even when most positions no longer change.
With the step cache a step runs only the *active* positions (`DiffusionGemma.decode_active`); a settled
position keeps its logits from the last step that computed it (the sampler, self-conditioning and the stop rule
read them as if they were new) and its keys/values in the cache's canvas slots (what the active positions
attend to).

The rule, per row and canvas position, over one canvas:
  * the first step computes every position, and so does every `cache_refresh`-th step (0: never);
  * a position settles when its argmax has been the same for `settle_steps` consecutive steps and its top
    probability is >= `settle_probability`, at the step's temperature (`settle_on` "tempered") or at the
    model's own (`settle_on` "model": a hot schedule's first steps then settle what the model is sure of);
  * a position the sampler draws a sample for (accepts) runs again when that sample is not the token it was
    last computed with: a settled one wakes, one about to settle waits. So a settled position the sampler
    keeps reads the token its logits and keys/values were made from, and at a constrained row's accepted
    positions that is the guide's token (one its automaton allows);
  * with `refresh_share` p > 0 each step also recomputes some settled positions: as many as the smallest set
    of settled positions holding a share p of the attention the last step's computed positions put on the
    settled ones (in every layer after the first, whose keys/values depend on a position's own token alone),
    chosen by `refresh_order`: the most attended ("attention", d2Cache's rule, arXiv 2509.23094), or, as
    controls at the same count, random ones ("random") or the longest kept ("oldest");
  * rows that stopped are not computed at all.
The approximation: a settled position's logits and keys/values were made with the other positions as they
were then, and with its own token as it was then: while the sampler re-noises a settled position (it is not
accepted yet), the others keep seeing the token it was computed with, not the fresh noise the cache-off path
feeds them, and its self-conditioning is its kept prediction. For a model whose logits at a position depend
only on that position's token, with every position accepted at every step, it is exact. A model fine-tuned to
read kept keys/values (`dgemma train --cache-aware`) loses less to it.

A step where every position runs (the first, a periodic refresh) runs packed as well: the packed step writes
each position's keys/values into the cache's canvas slots, where the settled ones are kept.

`decoder_positions` counts what ran through the decoder, per row.

Shapes: B rows, L canvas length, V vocabulary.
"""

from __future__ import annotations

import torch

from dgemma.config import SamplingConfig
from dgemma.device_sync import host_read, to_device
from dgemma.model.packing import PackedPositions


class StepCache:
    """One canvas's step cache for B rows (a new one per canvas). `generator`: the rows' sampler generator
    (the random refresh order draws from it)."""

    def __init__(self, sampling: SamplingConfig, batch_size: int, canvas_length: int, vocab_size: int, device,
                 generator: torch.Generator | None = None):
        self.settle_steps = sampling.settle_steps
        self.settle_probability = sampling.settle_probability
        self.settle_on = sampling.settle_on
        self.refresh = sampling.cache_refresh
        self.share, self.order, self.generator = sampling.refresh_share, sampling.refresh_order, generator
        shape = (batch_size, canvas_length)
        # each position's logits from the last step that computed it (zeros: uniform, until computed)
        self.logits = torch.zeros(*shape, vocab_size, dtype=torch.float32, device=device)
        self.computed_with = torch.full(shape, -1, dtype=torch.long, device=device)  # the token it read then
        self.computed_at = torch.zeros(shape, dtype=torch.long, device=device)  # the step that computed it last
        self.last_argmax = torch.full(shape, -1, dtype=torch.long, device=device)
        self.stable = torch.zeros(shape, dtype=torch.long, device=device)  # consecutive steps with that argmax
        self.settled = torch.zeros(shape, dtype=torch.bool, device=device)
        self.refreshing = torch.zeros(shape, dtype=torch.bool, device=device)  # settled ones the next step runs
        self.read: torch.Tensor | None = None  # (B, L) fp32: the last packed step's attention on each position
        self.kept = torch.zeros(shape, dtype=torch.bool, device=device)  # the positions the last step did not run
        self.steps = 0
        self.decoder_positions = [0] * batch_size  # per row, summed over the steps (host)

    @property
    def reads_attention(self) -> bool:
        """Whether the packed forward collects the attention on the canvas slots for this cache (`refresh_share`)."""
        return self.share > 0

    def active(self, done: torch.Tensor) -> torch.Tensor:
        """done (B,) rows that stopped -> (B, L) bool: the positions this step computes."""
        whole = self.steps == 0 or (self.refresh > 0 and self.steps % self.refresh == 0)
        active = torch.ones_like(self.settled) if whole else ~self.settled | self.refreshing
        return active & ~done[:, None]

    def logits_for(self, model, canvas: torch.Tensor, cache, done: torch.Tensor, *, self_conditioning=None,
                   rows=None) -> torch.Tensor:
        """The step's logits (B, L, V) fp32 from `model.decode_active` over the active positions, the rest as last
        computed (`packed_step`). A buffer the sampler may overwrite."""
        (active,), counts = active_counts([self], [done])

        def forward(active, counts, read):
            return model.decode_active(canvas, cache, PackedPositions.from_mask(active, counts),
                                       self_conditioning=self_conditioning, rows=rows, read=read)

        return packed_step([self], [canvas], [active], counts, forward)[0]

    def record(self, computed: torch.Tensor | None, positions: torch.Tensor, counts: list[int],
               canvas: torch.Tensor, active: torch.Tensor, read: torch.Tensor | None = None) -> torch.Tensor:
        """After a forward over this cache's `active` (B, L) positions: computed (N, V) fp32 their logits, packed
        row after row (None when N = 0), positions (N,) their canvas positions, counts each row's N, read (B, L)
        the attention they put on each position (or None) -> the step's logits (B, L, V), a buffer the sampler
        may overwrite (a copy of the kept logits, or the forward's own output when every position ran)."""
        B, L = active.shape
        # every position of every row ran (a first step, a refresh, a model that settles nothing): the packed order
        # is the canvas's, so the computed logits are the step's as they are, kept by one copy (no scatter, no clone)
        whole = computed is not None and computed.shape[0] == B * L and computed.dtype == self.logits.dtype
        if whole:
            step = computed.view(B, L, -1)
            self.logits.copy_(step)
        elif computed is not None:
            rows = torch.arange(len(counts), device=positions.device)
            row_of = torch.repeat_interleave(rows, to_device(counts, torch.long, positions.device),
                                             output_size=positions.shape[0])
            self.logits[row_of, positions] = computed
        self._computed(canvas, active, counts)
        self.read = read
        return step if whole else self.logits.clone()

    def _computed(self, canvas: torch.Tensor, active: torch.Tensor, counts: list[int]):
        self.kept = self.settled & ~active
        self.computed_with = torch.where(active, canvas, self.computed_with)
        self.computed_at.masked_fill_(active, self.steps)
        self.settled &= ~active
        self.decoder_positions = [d + c for d, c in zip(self.decoder_positions, counts)]
        self.steps += 1

    def settle(self, argmax: torch.Tensor, probs: torch.Tensor, drawn: torch.Tensor, next_canvas: torch.Tensor,
               done: torch.Tensor, temperature: float = 1.0):
        """After the step's sampler: argmax (B, L), probs (B, L, V) or (B * L, V) its probabilities at
        `temperature`, drawn (B, L) bool the positions that took a sample, next_canvas (B, L) what the next step
        reads, done (B,) rows that stopped. Then the settled positions the next step refreshes."""
        B, L = argmax.shape
        probs = probs.reshape(B, L, -1)
        top = probs.amax(dim=-1)
        if self.settle_on == "model" and temperature != 1.0:
            # p(top) at temperature 1 from the tempered ones: 1 / sum_j (p_j / p_top) ** T
            top = 1.0 / (probs / top[..., None]).pow(temperature).sum(dim=-1)
        same = argmax == self.last_argmax
        self.stable = torch.where(same, self.stable + 1, torch.ones_like(self.stable))
        self.last_argmax = argmax
        settles = (self.stable >= self.settle_steps) & (top >= self.settle_probability) & ~done[:, None]
        # a position that takes a sample other than the token it was computed with runs again (a settled one
        # wakes, and one that would settle now waits until it has been computed with its token)
        stale = drawn & (next_canvas != self.computed_with)
        self.settled = (self.settled | settles) & ~stale
        if self.share > 0 and self.read is not None:
            self.refreshing = self._to_refresh()
        else:
            self.refreshing = torch.zeros_like(self.settled)

    def _to_refresh(self) -> torch.Tensor:
        """(B, L) bool: per row, as many settled positions as the smallest set of them holding `share` of the
        attention the last step put on settled positions, chosen by `order`. On the device, no read."""
        # the read rounded to bfloat16's 8 bits: its float sums differ in their last bits with the shape of the
        # batch a row ran in, and a row must pick the same positions alone or beside others (ties: canvas order)
        read = self.read.to(torch.bfloat16).float()
        mass = torch.where(self.settled, read, torch.zeros_like(read))
        ranked = mass.sort(dim=1, descending=True).values
        before = ranked.cumsum(dim=1) - ranked  # the mass of the positions ranked above each
        count = ((before < self.share * ranked.sum(dim=1, keepdim=True)) & (ranked > 0)).sum(dim=1, keepdim=True)
        if self.order == "attention":
            key = mass
        elif self.order == "random":
            key = torch.rand(mass.shape, generator=self.generator, device=mass.device)
        else:  # "oldest": the earliest computed first (ties: canvas order)
            key = -self.computed_at.to(mass.dtype)
        key = key.masked_fill(~self.settled, float("-inf"))
        rank = key.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
        return (rank < count) & self.settled


def active_counts(caches: list[StepCache], dones: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Each cache's active positions (B_i, L) bool for this step, and every row's count, in cache order: the
    step cache's one host read a step."""
    actives = [cache.active(done) for cache, done in zip(caches, dones)]
    return actives, host_read(torch.cat(actives).sum(dim=1), "step cache: active positions")


def packed_step(caches: list[StepCache], canvases: list[torch.Tensor], actives: list[torch.Tensor],
                counts: list[int], forward) -> list[torch.Tensor]:
    """One denoising step for several step caches' rows (the plain loop: one cache of B rows; the engine: one
    cache per request) in ONE decoder forward over all their active positions, packed row after row.

    canvases[i] (B_i, L) and actives[i] (B_i, L) belong to caches[i], counts to every row (`active_counts`);
    forward(active (R, L) bool, counts, read) runs the decoder over the active positions of all R rows, in that
    order, and returns their logits (N, V) fp32 (it is not called when nothing is active), adding to `read`
    ((R, L) fp32, or None when no cache refreshes by attention) the attention each canvas position received.
    -> each cache's step logits (B_i, L, V)."""
    active = torch.cat(actives)
    total = sum(counts)
    read = None
    if any(cache.reads_attention for cache in caches):
        read = torch.zeros(active.shape, dtype=torch.float32, device=active.device)
    computed = forward(active, counts, read) if total else None
    positions = torch.nonzero_static(active, size=total)[:, 1]  # (N,): the packed order, row after row
    out, row, start = [], 0, 0
    for cache, canvas, cache_active in zip(caches, canvases, actives):
        rows = cache_active.shape[0]
        row_counts = counts[row : row + rows]
        n = sum(row_counts)
        part = computed[start : start + n] if computed is not None and n else None
        out.append(cache.record(part, positions[start : start + n], row_counts, canvas, cache_active,
                                None if read is None else read[row : row + rows]))
        row, start = row + rows, start + n
    return out
