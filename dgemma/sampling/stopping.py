"""Adaptive stopping of a canvas's denoising: stable AND confident.

As transformers' `StableAndConfidentStoppingCriteria` decides it:
  * stable: the argmax canvas of this step equals the argmax canvases of each of the previous
    `stability_threshold` steps of this canvas (at every position). The history starts filled with -1,
    so with threshold 1 the earliest possible stop is the second step.
  * confident: the mean over the canvas positions of the entropy of softmax(logits / T) (the
    temperature-scaled logits of this step) is below `confidence_threshold` (strictly).
With a canvas template, fixed positions (entropy 0 by construction) are left out of that mean, so
they neither dilute it nor make stopping easier; they are constant and never break stability.

The state is a plain tensor passed in and returned, so the functions stay pure.
"""

from __future__ import annotations

import torch


def new_argmax_history(stability_threshold: int, batch_size: int, canvas_length: int,
                       device: torch.device | str) -> torch.Tensor:
    """Empty history (S, B, L) long of the last S = stability_threshold argmax canvases, filled with -1
    (never a token, so nothing is stable before S earlier steps exist)."""
    return torch.full((stability_threshold, batch_size, canvas_length), -1, dtype=torch.long, device=device)


def mean_entropy(entropy: torch.Tensor, fixed: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy (B,) over the free positions of entropy (B, L). A row with no free position has 0."""
    if fixed is None:
        return entropy.mean(-1)
    free_count = (~fixed).sum(-1).clamp(min=1)
    return entropy.masked_fill(fixed, 0.0).sum(-1) / free_count


def adaptive_stop(
    history: torch.Tensor,
    argmax_canvas: torch.Tensor,
    entropy: torch.Tensor,
    confidence_threshold: float,
    fixed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the stop rule.

    history (S, B, L) long, argmax_canvas (B, L) long, entropy (B, L) fp32, fixed (B, L) bool or None
    -> (stop (B,) bool, new history (S, B, L) with this step's argmax canvas as its newest entry).
    With S = 0 every row counts as stable (the reference's stability_threshold=0).
    """
    stable = (history == argmax_canvas[None]).all(dim=-1).all(dim=0)  # (B,)
    confident = mean_entropy(entropy, fixed) < confidence_threshold  # (B,)
    if history.shape[0] > 0:  # drop the oldest canvas, append this one
        history = torch.cat([history[1:], argmax_canvas[None].to(history.dtype)])
    return stable & confident, history
