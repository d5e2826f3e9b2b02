"""The entropy-bound denoising sampler as pure tensor functions (no model import)."""

from dgemma.sampling.sampler import (
    ACCEPT_ORDERS,
    CHUNK_ELEMENTS,
    acceptance_uncertainty,
    chunk_rows,
    entropy_bound_accept,
    random_tokens,
    sample_from_probs,
    draw_samples,
    scan_step,
    temperature_schedule,
    token_entropy,
)
from dgemma.sampling.seeds import seed_or_random
from dgemma.sampling.stopping import adaptive_stop, mean_entropy, new_argmax_history

__all__ = [
    "ACCEPT_ORDERS",
    "CHUNK_ELEMENTS",
    "acceptance_uncertainty",
    "adaptive_stop",
    "chunk_rows",
    "draw_samples",
    "entropy_bound_accept",
    "mean_entropy",
    "new_argmax_history",
    "random_tokens",
    "sample_from_probs",
    "scan_step",
    "seed_or_random",
    "temperature_schedule",
    "token_entropy",
]
