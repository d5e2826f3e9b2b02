"""The verifier search: a checker in the denoising loop. Generate, verify, re-noise what the checker
rejects, keep the rest. Its rules are written here once (candidate seeds, the next round's template, which
candidate wins) for the plain loop's search below (`generate_verified`, on top of diffusion.generate) and
the engine's (dgemma.engine.search).

A verifier is any function `tokens -> rejected positions`: it receives a row's generated tokens (before
the first EOS, within max_new_tokens) and returns the positions (0-based, into those tokens) it rejects;
an empty answer accepts. A sudoku rules checker, a JSON parser (the position where parsing fails and
what follows) or a unit-test runner (the lines of a failing function) all fit. The search:

    round 1: denoise as usual
    round k > 1: the tokens of round k-1 become a canvas template (the infilling path, see
                 CanvasTemplate): every position the verifier did not reject is fixed to its token, the
                 rejected ones start from noise again; the caller's own template stays fixed throughout
    stop at the first accepted round or after max_rounds

With `candidates` = n > 1, n searches run side by side with seeds candidate_seed(seed, j); the winner is
the accepted candidate that needed the fewest decoder forwards (ties: the lower index), which is the one
accepted first when they step together. When none is accepted, the candidate with the fewest rejected
positions in its last round is returned (then fewest forwards, then lower index). The engine runs the
same search (dgemma.engine.search) and stops candidates that can no longer win; this plain version runs
every candidate to its end, one after the other, so its reported total forwards can be larger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dgemma.config import SamplingConfig
from dgemma.generation.canvas import canvases_for
from dgemma.generation.diffusion import CanvasTemplate, GenerationResult, device_of, generate
from dgemma.sampling import seed_or_random

Verifier = Callable[[list[int]], Iterable[int]]

# Candidate j of a request with seed s uses seed s + j * CANDIDATE_SEED_STRIDE: candidate 0 is the plain
# request, and per-prompt seeds s, s+1, ... (an evaluation's puzzles) never collide with candidates.
CANDIDATE_SEED_STRIDE = 1_000_003


def candidate_seed(seed: int, candidate: int) -> int:
    return seed + candidate * CANDIDATE_SEED_STRIDE


def verifiers_for(verifier, batch_size: int) -> list:
    """One verifier for every row, or a list with one per row."""
    checks = list(verifier) if isinstance(verifier, (list, tuple)) else [verifier] * batch_size
    if len(checks) != batch_size:
        raise ValueError(f"{len(checks)} verifiers for {batch_size} prompts")
    return checks


def check_search(max_rounds: int, candidates: int):
    if max_rounds < 1 or candidates < 1:
        raise ValueError(f"max_rounds and candidates must be >= 1, got {max_rounds} and {candidates}")


def rejected_positions(verifier: Verifier, tokens: list[int]) -> list[int]:
    """The verifier's answer as sorted distinct positions."""
    rejected = sorted({int(p) for p in verifier(list(tokens))})
    if rejected and rejected[0] < 0:
        raise ValueError(f"a verifier returned the negative position {rejected[0]}")
    return rejected


def next_template(base_fixed: torch.Tensor | None, base_tokens: torch.Tensor | None, tokens: list[int],
                  rejected: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The template of the next round: (fixed (W,) bool, tokens (W,) long). The last round's tokens are
    kept except at rejected positions (positions past its output are free); the base template (the
    caller's, (W0,) each, or None) stays fixed whatever the verifier says."""
    width = max(len(tokens), 0 if base_fixed is None else base_fixed.shape[0])
    fixed = torch.zeros(width, dtype=torch.bool)
    values = torch.zeros(width, dtype=torch.long)
    fixed[: len(tokens)] = True
    values[: len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    fixed[[p for p in rejected if p < len(tokens)]] = False
    if base_fixed is not None:
        n = base_fixed.shape[0]
        base_fixed, base_tokens = base_fixed.cpu(), base_tokens.cpu().long()
        values[:n] = torch.where(base_fixed, base_tokens, values[:n])
        fixed[:n] |= base_fixed
    return fixed, values


def winner_key(accepted: bool, rejected: int, forwards: int, candidate: int) -> tuple:
    """Sort key of a finished candidate: the smallest wins (see the module's docstring)."""
    return (0, 0, forwards, candidate) if accepted else (1, rejected, forwards, candidate)


# -- the plain loop's search ----------------------------------------------------------------------
@dataclass
class _Outcome:  # one row of one candidate, over its rounds
    tokens: list[int] = field(default_factory=list)
    sequence: torch.Tensor | None = None
    finish_reason: str = "length"
    steps_per_canvas: list[int] = field(default_factory=list)
    non_pad: int = 0
    rounds: int = 0
    rejected: list[int] = field(default_factory=list)

    @property
    def forwards(self) -> int:
        return sum(self.steps_per_canvas)


@torch.no_grad()
def generate_verified(model, prompts: list[list[int]], sampling: SamplingConfig, verifier, *, max_rounds: int = 1,
                      candidates: int = 1, seed: int | None = None,
                      canvas_template: CanvasTemplate | None = None) -> GenerationResult:
    """`dgemma.generation.generate` with `verifier` in the loop (one for every row, or a list with one per
    row): rejected positions are re-noised, the rest kept, up to `max_rounds` rounds; best of `candidates`
    seeds (this module's docstring says how). The seed rule and the result are generate's; the result's
    `search` says, per row, the rounds, forwards, winning candidate and whether it was accepted."""
    check_search(max_rounds, candidates)
    start = time.perf_counter()
    checks = verifiers_for(verifier, len(prompts))
    seed = seed_or_random(seed, sampling.seed)
    device = device_of(model)
    runs, first_canvas_s = [], None
    for j in range(candidates):
        outcomes, ttfc = _search(model, prompts, sampling, checks, max_rounds, candidate_seed(seed, j),
                                 canvas_template, device)
        runs.append(outcomes)
        first_canvas_s = ttfc if first_canvas_s is None else first_canvas_s

    winners, search = [], []
    for row in range(len(prompts)):
        keys = [winner_key(not run[row].rejected, len(run[row].rejected), run[row].forwards, j)
                for j, run in enumerate(runs)]
        j = min(range(candidates), key=keys.__getitem__)
        o = runs[j][row]
        winners.append(o)
        search.append({"accepted": not o.rejected, "rounds": o.rounds, "candidate": j,
                       "forwards": sum(run[row].forwards for run in runs), "winner_forwards": o.forwards,
                       "rejected": o.rejected})
    width = max(o.sequence.shape[0] for o in winners)
    sequences = torch.full((len(prompts), width), sampling.pad_token_id, dtype=torch.long)
    for row, o in enumerate(winners):
        sequences[row, : o.sequence.shape[0]] = o.sequence
    elapsed = time.perf_counter() - start
    generated = sum(len(o.tokens) + (o.finish_reason == "stop") for o in winners)
    return GenerationResult(
        sequences=sequences,
        tokens=[o.tokens for o in winners],
        finish_reasons=[o.finish_reason for o in winners],
        num_canvases=canvases_for(width, model.config.canvas_length),
        steps_per_canvas=[o.steps_per_canvas for o in winners],
        tokens_per_forward=[o.non_pad / o.forwards if o.forwards else 0.0 for o in winners],
        time_to_first_canvas_s=first_canvas_s or 0.0,
        elapsed_s=elapsed,
        tokens_per_second=generated / elapsed if elapsed > 0 else 0.0,
        seed=seed,
        search=search,
    )


def _search(model, prompts, sampling, checks, max_rounds: int, seed: int, canvas_template, device):
    """One candidate for every row: rounds until each row is accepted or max_rounds; rows still searching
    share one generator (seeded once), as a batch of the plain loop does."""
    generator = torch.Generator(device=device).manual_seed(seed)
    base = [(None, None) if canvas_template is None else (canvas_template.fixed[row], canvas_template.tokens[row])
            for row in range(len(prompts))]
    templates = list(base)
    outcomes = [_Outcome() for _ in prompts]
    rows, first_canvas_s = list(range(len(prompts))), None
    for round_number in range(1, max_rounds + 1):
        template = _stack([templates[row] for row in rows])
        result = generate(model, [prompts[row] for row in rows], sampling, seed=seed, generator=generator,
                          canvas_template=None if template is None else CanvasTemplate(*template))
        if first_canvas_s is None:
            first_canvas_s = result.time_to_first_canvas_s
        still = []
        for i, row in enumerate(rows):
            o = outcomes[row]
            forwards = sum(result.steps_per_canvas[i])
            o.tokens, o.sequence, o.finish_reason = result.tokens[i], result.sequences[i], result.finish_reasons[i]
            o.steps_per_canvas += result.steps_per_canvas[i]
            o.non_pad += round(result.tokens_per_forward[i] * forwards)
            o.rounds = round_number
            o.rejected = rejected_positions(checks[row], o.tokens)
            if o.rejected and round_number < max_rounds:
                templates[row] = next_template(*base[row], o.tokens, o.rejected)
                still.append(row)
        rows = still
        if not rows:
            break
    return outcomes, first_canvas_s


def _stack(templates) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row (fixed (W_i,), tokens (W_i,)) or (None, None) -> (B, max W) each, or None if nothing is fixed."""
    width = max((f.shape[0] for f, _ in templates if f is not None), default=0)
    if width == 0:
        return None
    fixed = torch.zeros(len(templates), width, dtype=torch.bool)
    tokens = torch.zeros(len(templates), width, dtype=torch.long)
    for row, (f, t) in enumerate(templates):
        if f is not None:
            fixed[row, : f.shape[0]] = f.cpu()
            tokens[row, : t.shape[0]] = t.cpu().long()
    if not bool(fixed.any()):
        return None
    return fixed, tokens
