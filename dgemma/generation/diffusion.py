"""The plain, readable generation loop: the reference that any faster engine must reproduce token for token.

Block diffusion, one canvas of L = `canvas_length` tokens at a time:

    encode(prompt)                                   causal pass, fills the KV cache
    for each canvas (until every row has an EOS or max_new_tokens are covered):
        canvas = L uniform random tokens
        for step in 0 .. max_denoising_steps-1:      (the reference counts these down N..1)
            logits = denoise(canvas, cache, self-conditioning = softmax of previous step's scaled logits)
            sample / accept / re-noise (dgemma.sampling.sampler_step)
            stop the row when its argmax canvas is stable and its mean entropy is low
        commit the ARGMAX canvas (tokens after the first EOS -> pad) and encode it into the cache

With a constraint (dgemma.structured), a row's accepted positions take tokens from a valid answer at
every step and it commits the most probable canvas its automaton accepts instead of the argmax
(dgemma.structured.answer says how).

Semantics follow transformers' `DiffusionGemmaForBlockDiffusion.generate`: prompts are left-padded and
positions are column indices (a padded row's tokens sit at later positions, its padding is masked out);
rows that stopped denoising are frozen but still computed with the batch; a row that produced an EOS
contributes only padding from then on. Where we differ (documented on `generate`): finished rows do not
hold the batch back, and the output is cut at `max_new_tokens` instead of at a canvas boundary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgemma.config import SamplingConfig
from dgemma.generation.canvas import columns_left, cut_at_eos, left_pad, pad_after_eos, template_slice
from dgemma.sampling import (
    adaptive_stop,
    new_argmax_history,
    random_tokens,
    sampler_step,
    temperature_schedule,
)

# on_canvas(canvas_index, new_tokens, finished): new_tokens[b] are row b's tokens committed by this canvas
# (before its first EOS, within max_new_tokens; [] for a row already finished); finished[b] says the row
# is done. Concatenating a row's new_tokens over all calls gives GenerationResult.tokens[b].
OnCanvas = Callable[[int, list[list[int]], list[bool]], None]
# on_draft(step, argmax_canvas (B, L), entropy (B, L), accepted (B, L) bool), after every denoising step
# (step counts from 0 in each canvas). Rows that already stopped keep their argmax canvas; their entropy
# and accepted mask belong to a step whose result was discarded.
OnDraft = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class CanvasTemplate:
    """Tokens forced into the output: generated position i of row b holds tokens[b, i] where fixed[b, i].

    Both are (B, W); W may be shorter or longer than a canvas (positions beyond W are free). Fixed
    positions start with their token, are never re-noised, use none of the entropy budget and are left
    out of the mean entropy of the stop rule (see dgemma.sampling).
    """

    fixed: torch.Tensor  # (B, W) bool
    tokens: torch.Tensor  # (B, W) long, ignored where not fixed


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # (B, N) long, CPU: generated tokens, pad after the first EOS; N <= max_new_tokens
    tokens: list[list[int]]  # per row: the generated tokens before the first EOS
    finish_reasons: list[str]  # per row: "stop" (an EOS was generated) or "length" (ran out of max_new_tokens)
    num_canvases: int  # canvases the batch denoised
    steps_per_canvas: list[list[int]]  # per row: denoising steps for each canvas the row was still generating
    tokens_per_forward: list[float]  # per row: the reference's metric, see `generate`
    time_to_first_canvas_s: float  # from the call until the first canvas was committed
    elapsed_s: float
    tokens_per_second: float  # generated tokens (up to and including EOS, all rows) / elapsed_s
    seed: int  # the seed the sampler's generator used
    # with a verifier, per row: {"accepted", "rounds", "candidate", "forwards" (all candidates'), "rejected"}
    search: list[dict] | None = None


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    *,
    seed: int | None = None,
    canvas_template: CanvasTemplate | None = None,
    on_canvas: OnCanvas | None = None,
    on_draft: OnDraft | None = None,
    constraint=None,
    guide_steps: bool = True,
    images=None,
    verifier=None,
    max_rounds: int = 1,
    candidates: int = 1,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to `sampling.max_new_tokens` tokens after each prompt (lists of token ids, any lengths).

    `model` follows docs/model-api.md (config.canvas_length, config.vocab_size, new_cache, encode, denoise).
    Randomness: one torch.Generator on the model's device seeded with `seed`, else `sampling.seed`, else a
    seed drawn from torch's global RNG (so torch.manual_seed makes the call reproducible); same seed,
    device and batch -> same tokens. `sampling.fixed_steps` runs exactly max_denoising_steps per canvas.
    `constraint`: a dgemma.structured.TokenAutomaton for every row, or a list with one (or None) per
    row; a constrained row's answer is in the automaton's language (or cut: finish reason "length").
    guide_steps=False constrains only the committed canvases, not the accepted samples of each step
    (for measuring what the per-step guidance does; the engine always guides).
    `images`: a dgemma.images.ImageInputs holding the images of all prompts, row by row; their soft tokens
    take the places of the prompts' image tokens (`expand_image_tokens`).
    `verifier`, `max_rounds`, `candidates`: search with a checker in the loop (dgemma.generation.verify:
    rejected positions are re-noised, the rest kept, up to max_rounds rounds; best of `candidates` seeds);
    the result's `search` says, per row, the rounds, forwards, winning candidate and whether it was accepted.
    `generator`: continue this torch.Generator instead of seeding one (the verifier's later rounds).

    tokens_per_forward, as the reference defines it, per row: the non-pad tokens among all the canvases
    it committed (the EOS counts, tokens after it do not; canvases are counted whole, before the cut at
    max_new_tokens) divided by the denoiser forward passes it was still generating in (a step counts for
    a row until its canvas has stopped; rows finished by an EOS count nothing).

    Differences from the reference:
      * the reference keeps stepping a canvas until rows that already finished (EOS in an earlier
        canvas) have converged too, although their output is all pad; here such rows never hold the
        batch back. When one of them would have been the last to converge, the reference runs more
        steps, so it draws more noise and the later tokens of the other rows differ from ours;
      * the reference returns whole canvases (ceil(max_new_tokens / L) of them); here the output is cut
        to max_new_tokens, and a row without an EOS inside that cut finishes with reason "length".
    """
    if verifier is not None:
        from dgemma.generation.verify import generate_verified

        return generate_verified(model, prompts, sampling, verifier=verifier, max_rounds=max_rounds,
                                 candidates=candidates, seed=seed, canvas_template=canvas_template,
                                 on_canvas=on_canvas, on_draft=on_draft, constraint=constraint, images=images)
    if max_rounds != 1 or candidates != 1:
        raise ValueError("max_rounds and candidates need a verifier")
    start_time = time.perf_counter()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    device = _device_of(model)
    batch_size = len(prompts)
    canvas_length = model.config.canvas_length
    max_new_tokens = sampling.max_new_tokens
    max_canvases = math.ceil(max_new_tokens / canvas_length)
    pad_id = sampling.pad_token_id
    eos_ids = torch.tensor(sampling.eos_token_ids, dtype=torch.long, device=device)
    template = _check_template(canvas_template, batch_size, model.config.vocab_size, device)
    answers = _constrained_answers(constraint, batch_size, sampling, template, guide_steps)

    if seed is None:
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(seed)

    # Prompt: left-padded to the longest; padding is masked out but still occupies its column/position.
    input_ids, attention_mask = left_pad(prompts, pad_id, device)  # (B, P) each
    cache = model.new_cache(batch_size, input_ids.shape[1] + max_canvases * canvas_length)
    pixels = {} if images is None else dict(pixel_values=images.pixel_values,
                                            image_position_ids=images.image_position_ids)
    model.encode(input_ids, cache, attention_mask=attention_mask, return_logits=False, **pixels)

    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)  # produced an EOS
    committed: list[torch.Tensor] = []  # one (B, L) canvas each, pad after EOS
    forward_passes = torch.zeros(batch_size, dtype=torch.long, device=device)
    steps_per_canvas: list[list[int]] = [[] for _ in range(batch_size)]
    tokens: list[list[int]] = [[] for _ in range(batch_size)]
    time_to_first_canvas = 0.0
    for canvas_index in range(max_canvases):
        fixed, fixed_tokens = (None, None) if template is None else template_slice(
            template.fixed, template.tokens, canvas_index, canvas_length)
        argmax, steps = denoise_canvas(
            model, cache, sampling, generator, frozen=finished, fixed=fixed, fixed_tokens=fixed_tokens,
            on_draft=on_draft, answers=answers, budget=columns_left(max_new_tokens, canvas_index, canvas_length),
        )

        # Commit: everything after a row's first EOS becomes pad; rows finished earlier get only pad.
        canvas_tokens, has_eos = pad_after_eos(argmax, eos_ids, pad_id)  # (B, L), (B,)
        canvas_tokens = canvas_tokens.masked_fill(finished[:, None], pad_id)
        was_finished = finished.tolist()
        finished = finished | has_eos
        committed.append(canvas_tokens)
        forward_passes += steps

        # Host-side bookkeeping (this also waits for the device, so the timing below is honest).
        budget = columns_left(max_new_tokens, canvas_index, canvas_length)
        new_tokens = []
        for row, (row_tokens, row_steps) in enumerate(zip(canvas_tokens[:, :budget].tolist(), steps.tolist())):
            if was_finished[row]:
                new_tokens.append([])
                continue
            steps_per_canvas[row].append(row_steps)
            new, _ = cut_at_eos(row_tokens, sampling.eos_token_ids)
            new_tokens.append(new)
            tokens[row].extend(new)
        if canvas_index == 0:
            time_to_first_canvas = time.perf_counter() - start_time
        last = canvas_index == max_canvases - 1
        if on_canvas is not None:
            done = [bool(f) or last for f in finished.tolist()]
            on_canvas(canvas_index, new_tokens, done)
        if last or bool(finished.all()):
            break
        model.encode(canvas_tokens, cache, return_logits=False)  # extend the cache by the committed canvas

    all_committed = torch.cat(committed, dim=1)  # (B, num_canvases * L)
    sequences = all_committed[:, :max_new_tokens].cpu()
    finish_reasons = ["stop" if bool(torch.isin(row, eos_ids.cpu()).any()) else "length" for row in sequences]
    non_pad = (all_committed != pad_id).sum(-1)
    tokens_per_forward = [n / f for n, f in zip(non_pad.tolist(), forward_passes.tolist())]
    elapsed = time.perf_counter() - start_time
    generated = sum(len(t) + (reason == "stop") for t, reason in zip(tokens, finish_reasons))
    return GenerationResult(
        sequences=sequences,
        tokens=tokens,
        finish_reasons=finish_reasons,
        num_canvases=len(committed),
        steps_per_canvas=steps_per_canvas,
        tokens_per_forward=tokens_per_forward,
        time_to_first_canvas_s=time_to_first_canvas,
        elapsed_s=elapsed,
        tokens_per_second=generated / elapsed if elapsed > 0 else 0.0,
        seed=seed,
    )


def denoise_canvas(
    model,
    cache,
    sampling: SamplingConfig,
    generator: torch.Generator,
    *,
    frozen: torch.Tensor,
    fixed: torch.Tensor | None = None,
    fixed_tokens: torch.Tensor | None = None,
    on_draft: OnDraft | None = None,
    answers: list | None = None,
    budget: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise one canvas at positions cache.length .. cache.length+L-1.

    frozen (B,) bool marks rows with nothing to generate (finished earlier): computed, never changed.
    answers[b] (a dgemma.structured ConstrainedAnswer, or None) constrains row b; budget = the tokens
    each row may still write. Returns (canvas to commit (B, L) long: the argmax canvas, or a constrained
    row's chosen canvas; denoising steps each row ran (B,) long).
    """
    batch_size, device = frozen.shape[0], frozen.device
    shape = (batch_size, model.config.canvas_length)
    num_steps = sampling.max_denoising_steps
    canvas = random_tokens(shape, model.config.vocab_size, generator, device)
    if fixed is not None:
        canvas = torch.where(fixed, fixed_tokens, canvas)
    argmax = canvas  # the draft before any step (what the reference starts from, too)
    done = frozen.clone()  # rows whose canvas has stopped
    steps = torch.zeros(batch_size, dtype=torch.long, device=device)
    history = new_argmax_history(sampling.stability_threshold, *shape, device)
    self_conditioning = None  # no signal at the first step
    chosen: dict[int, torch.Tensor] = {}  # constrained rows: the canvas they commit
    for step_index in range(num_steps):
        steps += ~done
        logits = model.denoise(canvas, cache, self_conditioning_probs=self_conditioning)  # (B, L, V) fp32
        self_conditioning = None  # release last step's logits: one (B, L, V) buffer alive while sampling
        temperature = temperature_schedule(step_index, num_steps, sampling.t_min, sampling.t_max)
        result = sampler_step(logits, temperature, sampling.entropy_bound, generator,
                              fixed=fixed, fixed_tokens=fixed_tokens)
        was_done = done.clone()
        if answers is not None:  # constrained rows: accepted positions take tokens of a valid answer
            for row, answer in enumerate(answers):
                if answer is not None and not was_done[row]:
                    result.canvas[row] = answer.guide(result.canvas[row], result.accepted[row], logits[row], budget,
                                                      generator)
        canvas = torch.where(done[:, None], canvas, result.canvas)
        argmax = torch.where(done[:, None], argmax, result.argmax)
        stop, history = adaptive_stop(history, argmax, result.entropy, sampling.confidence_threshold, fixed)
        if not sampling.fixed_steps:
            done |= stop
        if answers is not None:  # rows that stop here commit this step's most probable valid canvas
            last_step = step_index == num_steps - 1
            for row, answer in enumerate(answers):
                if answer is not None and not was_done[row] and (bool(done[row]) or last_step):
                    chosen[row] = answer.commit(logits[row], budget)
        self_conditioning = logits  # now softmax(logits / T), left in place by sampler_step
        if on_draft is not None:
            on_draft(step_index, argmax, result.entropy, result.accepted)
        if bool(done.all()):
            break
    for row, tokens in chosen.items():
        argmax[row] = tokens
    return argmax, steps


def _constrained_answers(constraint, batch_size: int, sampling: SamplingConfig, template, guide_steps: bool):
    if constraint is None:
        return None
    from dgemma.structured.answer import ConstrainedAnswer

    automata = constraint if isinstance(constraint, (list, tuple)) else [constraint] * batch_size
    if len(automata) != batch_size:
        raise ValueError(f"{len(automata)} constraints for {batch_size} prompts")
    if template is not None and any(a is not None for a in automata):
        raise ValueError("a canvas template and a constraint cannot be combined")
    return [None if a is None else ConstrainedAnswer(a, sampling.eos_token_ids, sampling.pad_token_id,
                                                      guide_steps=guide_steps) for a in automata]


def _device_of(model) -> torch.device:
    device = getattr(model, "device", None)
    return torch.device(device) if device is not None else next(model.parameters()).device


def _check_template(template: CanvasTemplate | None, batch_size: int, vocab_size: int, device):
    if template is None:
        return None
    fixed, fixed_tokens = template.fixed, template.tokens
    if fixed.dim() != 2 or fixed.shape[0] != batch_size or fixed.shape != fixed_tokens.shape:
        raise ValueError(f"canvas template must be two (B={batch_size}, W) tensors, got "
                         f"{tuple(fixed.shape)} and {tuple(fixed_tokens.shape)}")
    if fixed.dtype != torch.bool:
        raise ValueError("canvas template `fixed` must be a bool tensor")
    used = fixed_tokens[fixed]
    if used.numel() and (used.min() < 0 or used.max() >= vocab_size):
        raise ValueError(f"canvas template tokens must be in [0, {vocab_size})")
    return CanvasTemplate(fixed.to(device), fixed_tokens.to(device=device, dtype=torch.long))
