"""Discrete DDIM: ancestral sampling from the exact posterior of the uniform corruption process, with an optional
predictor-corrector, as pure tensor functions.

The sampler of diffusers' `DiscreteDDIMScheduler` (D3PM, arXiv 2107.03006; the corrector: arXiv 2605.22765).
The forward process keeps a clean token with probability alpha(t) = 1 - t and otherwise replaces it by a uniform
random one of the V tokens; a canvas of N steps walks the linear grid alpha = 0, 1/N, ..., 1. Step i goes from
alpha_t = i / N to alpha_s = (i + 1) / N: with x0 the model's predicted clean token, x_t the canvas token, a =
alpha_t / alpha_s (survival from s to t) and b = alpha_s, the posterior q(x_s | x_t, x0) splits into three routes

    clean (take x0):       b (1 - a) / V + a b [x_t = x0]
    stay (keep x_t):       a (1 - b) / V
    noise (uniform token): (1 - a)(1 - b) / V

(their sum over the V tokens each reaches is exactly the posterior). At the first step a = 0, so a position
takes x0 with probability 1 / N and noise otherwise; at the last b = 1 and every position takes x0.

The corrector (`corrector_steps` > 0) runs Gibbs sweeps at alpha_s after a predictor step, each on a fresh
forward of the canvas: the leave-one-out denoiser (the model's prediction with the evidence of the position's
own token removed: its logit lowered by log(1 + V alpha / (1 - alpha))) gives the one-position conditional
Cat(alpha x0_loo + (1 - alpha) / V); the `corrector_k` least confident positions (by `corrector_selection`,
Gumbel-top-k at temperature `corrector_selection_tau`) are drawn from it, the rest held. A sweep leaves the
marginal at alpha_s unchanged, so it refines the canvas without training. The sweeps come out of the step
budget: of N forwards, the first (N - 1) // (1 + C) predictor steps each run C sweeps (`forward_budget`).

Shapes: B rows, L canvas positions, V vocabulary. Randomness from the generator passed in, in a fixed order: a
predictor step draws (B * L) route uniforms, then (B, L) noise tokens (x0's draws are the caller's, before); a
sweep draws (B, L) selection uniforms, then one float64 uniform per resampled position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgemma.config import CORRECTOR_SELECTIONS
from dgemma.sampling.sampler import CHUNK_ELEMENTS, chunk_rows, random_tokens, sample_from_probs


def forward_budget(num_forwards: int, corrector_steps: int) -> tuple[int, int]:
    """A canvas's decoder forwards split between the predictor and the corrector: -> (predictor steps,
    corrected steps), where each of the first `corrected steps` predictor steps runs `corrector_steps` sweeps
    and predictor + corrected * corrector_steps == num_forwards. The last forward is always a predictor's."""
    if corrector_steps <= 0:
        return num_forwards, 0
    corrected = (num_forwards - 1) // (1 + corrector_steps)
    return num_forwards - corrected * corrector_steps, corrected


@dataclass
class DDIMStep:
    canvas: torch.Tensor  # (B, L) long: the next decoder input
    clean: torch.Tensor  # (B, L) bool: positions that took the predicted token x0


def ddim_step(canvas: torch.Tensor, x0: torch.Tensor, step_index: int, num_steps: int,
              generator: torch.Generator | None, vocab_size: int, *, fixed: torch.Tensor | None = None,
              fixed_tokens: torch.Tensor | None = None) -> DDIMStep:
    """One predictor step: canvas (B, L) long x_t, x0 (B, L) long the predicted clean tokens -> x_s, each
    position's route drawn from the posterior (module docstring). A template's `fixed` positions keep their
    `fixed_tokens`."""
    B, L = canvas.shape
    b = (step_index + 1) / num_steps
    a = step_index / (step_index + 1)
    # per route, its mass times V; a position whose token is already x0 adds a b V to the clean route
    clean_mass, stay_mass, noise_mass = b * (1 - a), a * (1 - b), (1 - a) * (1 - b)
    same = canvas == x0
    total = torch.where(same, clean_mass + stay_mass + noise_mass + a * b * vocab_size,
                        clean_mass + stay_mass + noise_mass)
    p_clean = torch.where(same, clean_mass + a * b * vocab_size, clean_mass) / total
    p_stay = stay_mass / total
    uniforms = torch.rand(B * L, device=canvas.device, generator=generator).view(B, L)
    noise = random_tokens((B, L), vocab_size, generator, canvas.device)
    clean = uniforms < p_clean
    stay = ~clean & (uniforms < p_clean + p_stay)
    next_canvas = torch.where(clean, x0, torch.where(stay, canvas, noise))
    if fixed is not None:
        next_canvas = torch.where(fixed, fixed_tokens, next_canvas)
        clean &= ~fixed
    return DDIMStep(next_canvas, clean)


@dataclass
class CorrectorSweep:
    canvas: torch.Tensor  # (B, L) long: the canvas after the sweep
    corrected: torch.Tensor  # (B, L) bool: the positions it drew again
    argmax: torch.Tensor  # (B, L) long: the forward's prediction (for drafts)
    entropy: torch.Tensor  # (B, L) fp32: of softmax(logits) (for drafts)


def leave_one_out_shift(alpha: float, vocab_size: int) -> float:
    """How much the leave-one-out denoiser lowers the logit of a position's own token at alpha (arXiv
    2605.22765, eq. 13): log(1 + V alpha / (1 - alpha)); 0 outside (0, 1)."""
    return math.log1p(vocab_size * alpha / (1 - alpha)) if 0 < alpha < 1 else 0.0


def _position_statistics(logits: torch.Tensor, canvas: torch.Tensor, chunk_elements: int):
    """logits (B, L, V), canvas (B, L) -> per position, float64: log-normaliser, the canvas token's logit, the
    largest other logit; and argmax (long), entropy (fp32). In float64 (the conditional reaches ~log V below
    the logits), a chunk of positions at a time."""
    B, L, V = logits.shape
    flat, tokens = logits.reshape(B * L, V), canvas.reshape(B * L, 1)
    out = {name: torch.empty(B * L, dtype=torch.float64, device=logits.device)
           for name in ("lse", "current", "other", "entropy")}
    argmax = torch.empty(B * L, dtype=torch.long, device=logits.device)
    step = chunk_rows(V, chunk_elements)
    for start in range(0, B * L, step):
        rows = slice(start, start + step)
        x = flat[rows].double()
        lse = x.logsumexp(-1)
        top = x.topk(min(2, V), dim=-1)
        current = x.gather(-1, tokens[rows])[:, 0]
        second = top.values[:, -1]
        out["lse"][rows], out["current"][rows] = lse, current
        out["other"][rows] = torch.where(top.indices[:, 0] == tokens[rows, 0], second, top.values[:, 0])
        argmax[rows] = x.argmax(-1)
        out["entropy"][rows] = lse - (torch.exp(x - lse[:, None]) * x).sum(-1)
    stats = {k: v.view(B, L) for k, v in out.items()}
    return stats, argmax.view(B, L)


def corrector_scores(stats: dict, alpha: float, vocab_size: int, selection: str) -> torch.Tensor:
    """(B, L) float64: how unsure each position is under the one-position conditional
    Cat(alpha x0_loo + (1 - alpha) / V) at alpha (higher: resampled first)."""
    delta = leave_one_out_shift(alpha, vocab_size)
    log_current = stats["current"] - stats["lse"]
    # the leave-one-out softmax renormalises over the lowered logit: log(1 - p + p e^-delta)
    log_norm = torch.log1p(torch.exp(log_current) * math.expm1(-delta))
    loo_current = log_current - delta - log_norm
    loo_other = stats["other"] - stats["lse"] - log_norm
    log_uniform = math.log1p(-alpha) - math.log(vocab_size)

    def conditional(log_p):  # log(alpha p + (1 - alpha) / V)
        return torch.logaddexp(math.log(alpha) + log_p, torch.full_like(log_p, log_uniform))

    if selection == "lowest_log_margin":
        return conditional(loo_other) - conditional(loo_current)
    if selection == "lowest_maxprob":
        return -conditional(torch.maximum(loo_current, loo_other))
    if selection == "lowest_current_prob":
        return -conditional(loo_current)
    raise ValueError(f"corrector selection must be one of {', '.join(CORRECTOR_SELECTIONS)}, not {selection!r}")


def corrector_sweep(logits: torch.Tensor, canvas: torch.Tensor, step_index: int, num_steps: int,
                    generator: torch.Generator | None, *, k: int, selection: str, tau: float,
                    fixed: torch.Tensor | None = None, chunk_elements: int = CHUNK_ELEMENTS // 4) -> CorrectorSweep:
    """One Gibbs sweep after predictor step `step_index` of `num_steps` (at alpha_s = (step_index + 1) / N):
    logits (B, L, V) fp32 the decoder's output on `canvas` (B, L) long (left unchanged) -> the canvas with the
    `k` least confident positions of each row drawn again from their leave-one-out conditional. A template's
    `fixed` positions are never chosen."""
    B, L, V = logits.shape
    alpha = (step_index + 1) / num_steps
    stats, argmax = _position_statistics(logits, canvas, chunk_elements)
    k = min(max(1, k), L)
    if selection == "random":
        keys = torch.rand(B, L, device=canvas.device, generator=generator).double()
    else:
        uniforms = torch.rand(B, L, device=canvas.device, generator=generator).clamp_(1e-12, 1.0 - 1e-12)
        gumbel = -torch.log(-torch.log(uniforms))
        keys = corrector_scores(stats, alpha, V, selection) / tau + gumbel
    if fixed is not None:
        keys = keys.masked_fill(fixed, float("-inf"))
    positions = keys.topk(k, dim=-1).indices  # (B, k), the least confident first
    rows = torch.arange(B, device=canvas.device)[:, None].expand(B, k)
    # the chosen positions' conditionals in full, float64: Cat(alpha softmax(loo logits) + (1 - alpha) / V)
    chosen = logits[rows, positions].double()  # (B, k, V)
    own = canvas[rows, positions]
    chosen.scatter_add_(-1, own[..., None], torch.full((B, k, 1), -leave_one_out_shift(alpha, V),
                                                       dtype=chosen.dtype, device=chosen.device))
    log_uniform = math.log1p(-alpha) - math.log(V)
    probs = torch.logaddexp(math.log(alpha) + chosen.log_softmax(-1), torch.tensor(log_uniform, dtype=chosen.dtype,
                                                                                  device=chosen.device)).exp()
    drawn = sample_from_probs(probs.view(B * k, V), generator).view(B, k)
    corrected = torch.zeros(B, L, dtype=torch.bool, device=canvas.device)
    corrected[rows, positions] = True
    if fixed is not None:
        corrected &= ~fixed
    next_canvas = canvas.clone()
    next_canvas[rows, positions] = drawn
    next_canvas = torch.where(corrected, next_canvas, canvas)
    return CorrectorSweep(next_canvas, corrected, argmax, stats["entropy"].float())
