"""One denoising step of the entropy-bound sampler, as pure tensor functions.

Shapes: B = batch rows, L = canvas length, V = vocabulary. Logits are the decoder's (B, L, V) fp32 output.

A step (the reference is transformers' `generation_diffusion_gemma.py`; see docs in each function):
  1. scale the logits by the step's temperature T (linear schedule t_max -> t_min);
  2. per position: entropy of softmax(logits / T), its argmax, and a sample from it (inverse CDF);
  3. accept the lowest-entropy positions while the entropy they add stays within the bound
     (Ben-Hamu et al., arXiv 2505.24857); every other position is re-noised to a uniform random token.
     The acceptance order is a choice (`ACCEPT_ORDERS`, `acceptance_uncertainty`): entropy, the
     reference's, or the top-2 probability margin or the top-1 probability, each under the same bound.
The reference feeds the temperature-scaled logits back as self-conditioning, and the model only ever
uses their softmax; `scan_step` leaves exactly that softmax in the logits buffer (in place), so the
next step's signal costs no second (B, L, V) buffer and no second softmax.

Randomness comes only from the `torch.Generator` passed in, in a fixed order per step: one uniform per
position, then one (B, L) draw of re-noising tokens. The same seed, device and shapes give the same tokens.

Cost: the vocabulary-sized work is the main non-matmul cost of a denoising step, so every pass over
(B, L, V) memory counts: one scan computes argmax, entropy and probabilities together, and the sample
(a cumulative sum over V) is only drawn where it is kept, at the accepted positions (see `scan_step`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from dgemma.config import ACCEPT_ORDERS

# Positions are processed in chunks of about this many logits, so that the temporaries of a step
# (log-probabilities, probabilities, noise) are a few (chunk, V) buffers instead of more (B, L, V) ones.
# It is also part of the random stream: a CPU generator fills tensors sequentially, so there the chunk
# size does not change the samples (tested), but other devices may draw differently per call.
CHUNK_ELEMENTS = 1 << 24
# The eager scan on a CPU goes a few rows at a time instead (2 of the 26B's 262,144-entry rows): its passes over
# a chunk then stay in the cores' caches, where over 64 rows each would go to memory (with its one-pass max and
# index, one 26B canvas's scan 315 -> 125 ms on 2 cores: benchmarks/sampler_scan.py)
EAGER_CPU_CHUNK_ELEMENTS = 1 << 19


def chunk_rows(vocab_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """How many positions (rows of V logits) one chunk holds."""
    return max(1, chunk_elements // vocab_size)


def temperature_schedule(step_index: int, num_steps: int, t_min: float, t_max: float) -> float:
    """Temperature of denoising step `step_index` (0-based: 0 .. num_steps-1) of a canvas.

    The reference counts steps down, n = num_steps .. 1, and uses T_n = t_min + (t_max - t_min) * n / N:
    t_max at the first step, t_min + (t_max - t_min) / N at the last (t_min itself is never reached).
    It evaluates this in float32 on a 0-d tensor; we round the same way so that logits / T is
    bit-identical.
    """
    # float32 arithmetic in Python: each operation on float32 values, computed in double and rounded
    # once to float32, is the correctly rounded float32 result torch's CPU kernels give (tested); no
    # tensor, so nothing is read back from one in the engine's step
    fraction = _f32(_f32(num_steps - step_index) / _f32(num_steps))  # n / N
    return _f32(_f32(t_min) + _f32(_f32(t_max - t_min) * fraction))


def _f32(x: float) -> float:
    """x rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def token_entropy(scaled_logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax over the last dim: (..., V) -> (...), in the reference's own form.

    Written as torch.distributions.Categorical computes it (normalise to log-probabilities, softmax of
    those, clamp -inf), so it is bit-identical to the reference's entropies. `scan_step` computes the
    same quantity in fewer passes over memory (within 1e-5 nats, tested).
    """
    log_probs = scaled_logits - scaled_logits.logsumexp(-1, keepdim=True)
    probs = torch.softmax(log_probs, dim=-1)
    # -inf logits (masked tokens) would give 0 * -inf = nan; Categorical clamps the same way
    return -(log_probs.clamp(min=torch.finfo(log_probs.dtype).min) * probs).sum(-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (N, V), rows summing to 1 or not -> (N,) long, by inverse CDF.

    One uniform u per row and the first token whose cumulative probability exceeds u * total: exact
    categorical sampling that draws N random numbers instead of the N * V a Gumbel-max race needs
    (random generation was the largest part of the sampler on CPU). A zero-probability token adds
    nothing to the cumulative sum, so it can never be the first to exceed the target.
    """
    u = torch.rand(probs.shape[0], dtype=probs.dtype, device=probs.device, generator=generator)
    return inverse_cdf(probs, u)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights (N, V) >= 0 and uniforms u (N,) in [0, 1) -> (N,) indices: the first index whose
    cumulative weight exceeds u * total."""
    cdf = torch.cumsum(weights, dim=-1)
    index = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return index.clamp_(max=weights.shape[-1] - 1)[:, 0]  # u * total rounding up to total: the last token


def random_tokens(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator | None,
                  device: torch.device | str) -> torch.Tensor:
    """Uniform random token ids over the whole vocabulary (the canvas noise; there is no [MASK])."""
    return torch.randint(0, vocab_size, shape, generator=generator, device=device)


def acceptance_uncertainty(probs: torch.Tensor, entropy: torch.Tensor, order: str) -> torch.Tensor:
    """Per position, how uncertain its distribution is under an acceptance order: probs (n, V) (rows
    summing to 1), entropy (n,) -> (n,) >= 0, what `entropy_bound_accept` orders and sums.

      entropy      H(p) in nats (the reference; `probs` is not read)
      margin       1 - (p_1 - p_2), with p_1 >= p_2 the two largest probabilities (Kim et al., arXiv
                   2502.06768, commit where the top-2 margin is widest): 0 for a one-hot row, 1 for a tie
      confidence   1 - p_1: 0 for a one-hot row, 1 - 1/V for a uniform one

    Each order uses the entropy bound's rule on its own uncertainty u: sort a row's u ascending and accept
    the largest prefix whose sum minus its largest member stays within the bound, so the most certain
    position is always accepted and certain positions (u near 0) are accepted in numbers. The bound (the
    sampler's `entropy_bound`) is then in u's units, not nats: for a confident position u and H are of the
    same size (p_1 = 0.95: 1 - p_1 = 0.05, H >= 0.19 nats), so one bound serves every order. The margin
    and the top-1 probability cost one more pass over each row's V probabilities (a top-2 or a max).
    """
    if order == "entropy":
        return entropy
    if order == "confidence":
        return 1.0 - probs.amax(-1)
    if order == "margin":
        top = probs.topk(min(2, probs.shape[-1]), dim=-1).values  # (n, 2)
        second = top[:, 1] if top.shape[1] > 1 else torch.zeros_like(top[:, 0])
        return 1.0 - (top[:, 0] - second)
    raise ValueError(f"accept order must be one of {', '.join(ACCEPT_ORDERS)}, not {order!r}")


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Which positions to accept this step: entropy (B, L) -> accepted (B, L) bool, per row. Any
    uncertainty may take the entropy's place (`acceptance_uncertainty`); the rule is the same.

    Sort a row's entropies ascending, H_(1) <= H_(2) <= ...; position (k) is accepted when
        sum_{i<=k} H_(i) - max_{i<=k} H_(i) = sum_{i<k} H_(i) <= bound,
    i.e. the largest prefix whose entropy, minus its largest member, stays within the bound (that sum
    bounds the mutual information between the accepted tokens). The lowest-entropy position always
    passes (its left side is 0). Evaluated element-wise as cumsum - sorted, exactly as the reference,
    and ties are ordered by torch.sort's default (unstable) sort, as in the reference, so both pick
    the same positions when tied entropies straddle the bound.
    """
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    accepted_sorted = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bound
    return torch.zeros_like(accepted_sorted).scatter(-1, order, accepted_sorted)


def scan_logits(x: torch.Tensor, temperature: torch.Tensor):
    """One chunk of logits x (n, V), overwritten with softmax(x / T) -> argmax (n,), entropy (n,).

    With s = x / T (bit-identical to the reference's scaled logits) and m = max(s): e = exp(s - m),
    Z = sum(e), entropy = log Z - sum(e * (s - m)) / Z (the same number as -sum(p log p), without a
    log-probability buffer). The elementwise part of the sampler, kept apart so that it can be compiled
    into a couple of fused loops (`torch.compile(scan_logits)`).
    """
    x = x.div_(temperature)
    compiling = torch.compiler.is_dynamo_compiling()
    eager_on_cpu = not compiling and x.device.type == "cpu"
    if eager_on_cpu:
        # torch's max along a dimension gives the max and the first index holding it in one pass, ~2.5x faster
        # on a CPU than its argmax alone (which returns the same index, ties included)
        top, argmax = x.max(-1, keepdim=True)
        argmax = argmax[:, 0]
    else:
        top = x.amax(-1, keepdim=True)
        # compiled, the argmax is the first index holding the max, found as a max of countdown values (V at
        # index 0 .. 1 at the last): inductor's CPU argmax reduction is ~4x slower than its max (~1 ms of a
        # bench-20m step)
        argmax = _first_index_of(x, top) if compiling else x.argmax(-1)
    # s - m <= 0; -inf logits (masked tokens) become a finite floor (eagerly on a CPU, its cutoff) so that 0 * x
    # stays 0 below
    floor = torch.finfo(x.dtype).min
    if compiling:
        # Out of place, and the probabilities exp'd again in the loop that writes them: were e reused,
        # inductor would store it as an (n, V) buffer between its reduction loop and the writing loop,
        # one more pass over V-sized memory. exp(s - m) without the floor is the same number (exp of
        # -inf is 0 too), and being a different expression it is not merged with e.
        shifted = x.sub_(top)
        floored = shifted.clamp(min=floor)
        e = torch.exp(floored)
        z = e.sum(-1)
        expected_shift = torch.linalg.vecdot(e, floored) / z  # E_p[s - m], fused into the loop over V
        probs = torch.exp(shifted)
    elif eager_on_cpu:
        # torch's CPU exp leaves its fast path where the result would underflow (arguments below ~-87: ~15x
        # slower there), and logits 35 apart reach that at temperature 0.4. So the tokens whose probability would
        # be below the smallest normal float even over a whole vocabulary's sum (s - m < log(tiny * V), ~-75 for
        # 262k entries: probabilities under ~1e-32) get exactly 0, as masked tokens do, and exp sees nothing lower
        cutoff = math.log(torch.finfo(x.dtype).tiny * x.shape[-1])
        x.sub_(top).clamp_(min=cutoff)
        # exp of the clamped entries (and of any within 0.1% of them) -> 0, with a margin over exp's rounding
        e = probs = torch.nn.functional.threshold_(torch.exp(x), 1.001 * math.exp(cutoff), 0.0)
        z = e.sum(-1)
        # vecdot's (n, V) product buffer is a chunk's (`scan_positions`); a batched matmul, the alternative
        # without one, is ~20x slower on so few long rows
        expected_shift = torch.linalg.vecdot(e, x) / z
    else:
        x.sub_(top).clamp_(min=floor)
        e = probs = torch.exp(x)
        z = e.sum(-1)
        # a device's 64 MB chunk: a batched matmul makes no (n, V) product buffer
        expected_shift = (e[:, None, :] @ x[:, :, None])[:, 0, 0] / z
    entropy = (z.log() - expected_shift).clamp_(min=0.0)
    torch.div(probs, z[:, None], out=x)  # the buffer now holds the probabilities
    return argmax, entropy


def _first_index_of(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """x (n, V), its row maxima top (n, 1) -> (n,) the first index where each row reaches its max: what
    argmax returns for finite rows, ties included. (A row holding NaN has a NaN max that no entry equals;
    it gets index 0 where argmax would point at the NaN. Such logits carry no usable token either way.)"""
    V = x.shape[-1]
    countdown = torch.arange(V, 0, -1, dtype=torch.float32, device=x.device)  # exact up to V = 2^24
    return V - torch.where(x == top, countdown, 0).amax(-1).long()


def scan_positions(logits: torch.Tensor, temperature: float, *, scan=scan_logits,
                   chunk_elements: int = CHUNK_ELEMENTS, accept_order: str = "entropy"):
    """The scan of a step over logits (B, L, V) fp32, chunk by chunk, overwriting them IN PLACE with
    softmax(logits / T) -> (probs (B * L, V), a view of the buffer; argmax (B, L) long; entropy (B, L);
    uncertainty (B, L): `accept_order`'s, the entropy itself for "entropy"). No random numbers are drawn."""
    B, L, V = logits.shape
    flat = logits.view(B * L, V)  # a view: everything below writes into `logits`
    entropy = torch.empty(B * L, dtype=logits.dtype, device=logits.device)
    argmax = torch.empty(B * L, dtype=torch.long, device=logits.device)
    uncertainty = entropy if accept_order == "entropy" else torch.empty_like(entropy)
    # a tensor, not a float: one compiled scan serves every temperature of the schedule (made by a fill,
    # not copied from the host: `torch.tensor(t, device=...)` would wait for the device)
    scale = torch.full((), temperature, dtype=logits.dtype, device=logits.device)
    eager_on_cpu = scan is scan_logits and logits.device.type == "cpu"
    step = chunk_rows(V, min(chunk_elements, EAGER_CPU_CHUNK_ELEMENTS) if eager_on_cpu else chunk_elements)
    for start in range(0, B * L, step):
        rows = slice(start, start + step)
        argmax[rows], entropy[rows] = scan(flat[rows], scale)
        if accept_order != "entropy":  # the chunk's probabilities, while they are in cache
            uncertainty[rows] = acceptance_uncertainty(flat[rows], entropy[rows], accept_order)
    return flat, argmax.view(B, L), entropy.view(B, L), uncertainty.view(B, L)


def sample_tempered(probs: torch.Tensor, temperature: float, generator: torch.Generator | None,
                    chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of probs (N, V) (softmax of the logits at temperature 1) at another temperature:
    -> (tokens (N,) long, their probabilities (N,) under the distribution drawn from).

    temperature 0 is greedy: the argmax and its probability, no random number drawn. Otherwise one uniform
    per row (drawn at once, so the stream is the same as a one-call categorical draw over every row) and
    the inverse CDF of softmax(logits / t) = probs ** (1 / t), normalised, a chunk of rows at a time."""
    if temperature == 0:
        tokens = probs.argmax(-1)
        return tokens, probs.gather(-1, tokens[:, None])[:, 0]
    N, V = probs.shape
    uniforms = torch.rand(N, dtype=probs.dtype, device=probs.device, generator=generator)
    tokens = torch.empty(N, dtype=torch.long, device=probs.device)
    chosen = torch.empty(N, dtype=probs.dtype, device=probs.device)
    step = chunk_rows(V, chunk_elements)
    for start in range(0, N, step):
        rows = slice(start, start + step)
        weights = probs[rows] if temperature == 1 else probs[rows].pow(1.0 / temperature)
        tokens[rows] = inverse_cdf(weights, uniforms[rows])
        chosen[rows] = weights.gather(-1, tokens[rows, None])[:, 0] / weights.sum(-1)
    return tokens, chosen


@dataclass
class ScannedStep:
    """A sampler step: `scan_step` knows everything but the samples, `draw_samples` puts them in the canvas.
    The other samplers (samplers.py) fill in the same fields, and what only they do."""

    # (B * L, V): softmax(logits / T), in the logits buffer (None for a DDIM corrector sweep, which leaves it)
    probs: torch.Tensor | None
    uniforms: torch.Tensor | None  # (B * L,): one per position, for the inverse-CDF draw (the entropy bound's)
    # (B, L) long: the next decoder input: the re-noised canvas (fixed tokens in place), the accepted
    # positions' samples put in by `draw_samples`
    canvas: torch.Tensor
    argmax: torch.Tensor  # (B, L) long
    entropy: torch.Tensor  # (B, L) fp32
    accepted: torch.Tensor  # (B, L) bool: the positions holding the model's prediction in the next canvas
    drawn: torch.Tensor  # (B, L) bool: the positions that take a new prediction (accepted, not fixed)
    edited: torch.Tensor | None = None  # (B, L) bool: committed tokens block refinement replaced
    corrected: torch.Tensor | None = None  # (B, L) bool: positions a DDIM corrector sweep drew again
    predictor: bool = True  # False for a corrector sweep: no stop rule, its logits are no one's self-conditioning


def scan_step(
    logits: torch.Tensor,
    temperature: float,
    entropy_bound: float,
    generator: torch.Generator | None,
    *,
    fixed: torch.Tensor | None = None,
    fixed_tokens: torch.Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    scan=scan_logits,
    accept_order: str = "entropy",
) -> ScannedStep:
    """The first half of a sampler step, without reading anything back to the host: the scan, the
    step's random numbers and the acceptance. logits (B, L, V) fp32 is overwritten IN PLACE with
    softmax(logits / T), the probabilities the next step's self-conditioning embeds.

    Per chunk of positions: `scan` (argmax, entropy and the probabilities, see `scan_logits`; a
    compiled copy of it may be passed). Then the acceptance; the samples come in `draw_samples`: a
    position that is not accepted is re-noised, so its sample would be thrown away, and the inverse-CDF
    draw (a cumulative sum over V) runs on the accepted rows alone; early in a canvas that is a handful of
    its positions. Every position still gets its uniform, so the random stream, and with it every token,
    is the same as sampling everywhere (as the reference does). Only (chunk, V) temporaries are allocated.
    Two halves let a caller that reads values back once per step learn the number of drawn positions in
    that read instead of waiting for `nonzero`.

    Canvas templates: `fixed` (B, L) bool marks positions that must hold `fixed_tokens` (B, L) long.
    They are known, so their entropy counts as 0: they use none of the entropy budget, are always
    "accepted", are never re-noised, and their argmax/sample is the fixed token. (The
    self-conditioning probabilities there stay the model's own.)
    `accept_order`: which uncertainty the bound accepts by (`acceptance_uncertainty`); the entropy the
    result carries (for the stop rule and drafts) is the entropy whatever the order."""
    B, L, V = logits.shape
    flat, argmax, entropy, uncertainty = scan_positions(logits, temperature, scan=scan, chunk_elements=chunk_elements,
                                                        accept_order=accept_order)
    uniforms = torch.rand(B * L, dtype=logits.dtype, device=logits.device, generator=generator)
    noise = random_tokens((B, L), V, generator, logits.device)  # drawn for every position, as the reference

    if fixed is not None:
        entropy = entropy.masked_fill(fixed, 0.0)
        uncertainty = entropy if accept_order == "entropy" else uncertainty.masked_fill(fixed, 0.0)
        argmax = torch.where(fixed, fixed_tokens, argmax)
    accepted = entropy_bound_accept(uncertainty, entropy_bound)
    drawn = accepted if fixed is None else accepted & ~fixed
    canvas = noise if fixed is None else torch.where(fixed, fixed_tokens, noise)  # samples go in below
    return ScannedStep(flat, uniforms, canvas, argmax, entropy, accepted, drawn)


def draw_samples(scanned: ScannedStep, count: int | None = None,
                 chunk_elements: int = CHUNK_ELEMENTS) -> ScannedStep:
    """The second half of a sampler step: the samples of the drawn positions go into the canvas (in
    place); returns the step. `count`: how many positions are drawn (`scanned.drawn.sum()`), when the caller has read it
    already; without it, finding them waits for the device (`nonzero`)."""
    drawn = scanned.drawn.view(-1)
    # flat positions that keep their sample; with the count known, nonzero_static does not wait
    where = (drawn.nonzero() if count is None else torch.nonzero_static(drawn, size=count))[:, 0]
    step = chunk_rows(scanned.probs.shape[1], chunk_elements)
    for start in range(0, where.shape[0], step):
        index = where[start : start + step]
        scanned.canvas.view(-1)[index] = inverse_cdf(scanned.probs[index], scanned.uniforms[index])
    return scanned
