"""The seed of a generation: the first one given, else a fresh one.

Every entry point (the plain loop, the engine, `dgemma generate`, the HTTP server) takes its seed here, so
"random when none is given" means the same thing everywhere: a draw from torch's global RNG, which a fresh
process seeds from the OS (different every run) and torch.manual_seed makes reproducible.
"""

from __future__ import annotations

import torch

# Seeds drawn here stay below 2**62, so a request's per-row or per-choice seeds (seed + i) stay below 2**63.
RANDOM_SEED_BOUND = 2**62


def seed_or_random(*seeds: int | None) -> int:
    """The first of `seeds` that is not None (e.g. a call's seed, then the sampling config's), else a
    fresh seed in [0, RANDOM_SEED_BOUND) drawn from torch's global RNG."""
    for seed in seeds:
        if seed is not None:
            return seed
    return int(torch.randint(0, RANDOM_SEED_BOUND, ()).item())
