"""Block refinement: commit the most confident predictions, an even share of the canvas per step, as pure
tensor functions.

The sampler of diffusers' `BlockRefinementScheduler` in its uniform-corruption mode (no [MASK] token: a
position not committed yet holds a uniform random token). Per step, given the model's prediction at every
position (a token and its probability, the *confidence*):
  1. quota: after step i of N, ceil((i + 1) * F / N) of the F free positions are committed, so the canvas
     is committed evenly and wholly by the last step; the step commits what is still owed, the most
     confident uncommitted positions first, and also every uncommitted position whose confidence exceeds
     `commit_threshold`;
  2. editing (optional, `editing_threshold` > 0): a committed position whose prediction is now another
     token with confidence above the threshold takes that token;
  3. every position still uncommitted is re-noised with a fresh uniform random token.
Committed positions keep their token (unless edited) to the end of the canvas: unlike the entropy bound,
which draws every accepted position anew at every step, a commitment here is final but for edits.

Shapes: B rows, L canvas positions, V vocabulary. Randomness: one (B, L) draw of re-noising tokens per
step, from the generator passed in (the predictions' own draws are the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.sampling.sampler import random_tokens


def commit_target(step_index: int, num_steps: int, free: torch.Tensor) -> torch.Tensor:
    """How many of a row's `free` (B,) long positions are committed once step `step_index` (0-based) of
    `num_steps` is done: ceil((step_index + 1) * free / num_steps) -> (B,) long; all of them at the last step."""
    return ((step_index + 1) * free + num_steps - 1) // num_steps


@dataclass
class RefinementStep:
    canvas: torch.Tensor  # (B, L) long: the next decoder input (committed tokens, noise elsewhere)
    committed: torch.Tensor  # (B, L) bool: committed after this step (fixed positions included)
    transfer: torch.Tensor  # (B, L) bool: newly committed by this step
    edited: torch.Tensor  # (B, L) bool: committed earlier, given a new token by this step


def refinement_step(
    canvas: torch.Tensor,
    committed: torch.Tensor,
    predicted: torch.Tensor,
    confidence: torch.Tensor,
    step_index: int,
    num_steps: int,
    generator: torch.Generator | None,
    vocab_size: int,
    *,
    commit_threshold: float,
    editing_threshold: float = 0.0,
    fixed: torch.Tensor | None = None,
    fixed_tokens: torch.Tensor | None = None,
) -> RefinementStep:
    """One block-refinement step. canvas (B, L) long: this step's decoder input; committed (B, L) bool: the
    positions committed before it (all False at a canvas's first step, but for fixed ones); predicted (B, L)
    long and confidence (B, L) fp32: the model's token at each position and its probability.

    `fixed` / `fixed_tokens` (B, L): a canvas template's positions, committed from the start to their
    tokens, never edited and outside the quota (which spreads the free positions over the steps)."""
    B, L = canvas.shape
    free = torch.full((B,), L, device=canvas.device) if fixed is None else (~fixed).sum(-1)
    owed = commit_target(step_index, num_steps, free)
    done = committed.sum(-1) if fixed is None else (committed & ~fixed).sum(-1)
    needed = (owed - done).clamp(min=0)  # (B,)
    # rank of each uncommitted position by confidence, most confident 0 (committed ones rank last)
    order = confidence.masked_fill(committed, float("-inf")).argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)
    transfer = ~committed & ((rank < needed[:, None]) | (confidence > commit_threshold))
    edited = torch.zeros_like(transfer)
    if editing_threshold > 0:
        edited = committed & (predicted != canvas) & (confidence > editing_threshold)
        if fixed is not None:
            edited &= ~fixed
    next_committed = committed | transfer
    noise = random_tokens(canvas.shape, vocab_size, generator, canvas.device)
    kept = torch.where(transfer | edited, predicted, canvas)
    next_canvas = torch.where(next_committed, kept, noise)
    if fixed is not None:
        next_canvas = torch.where(fixed, fixed_tokens, next_canvas)
    return RefinementStep(next_canvas, next_committed, transfer, edited)
