"""The plain, readable generation loop: the reference that any faster engine must reproduce token for token.

Block diffusion, one canvas of L = `canvas_length` tokens at a time:

    encode(prompt)                                   causal pass, fills the KV cache
    for each canvas (until every row has an EOS or max_new_tokens are covered):
        canvas = L uniform random tokens
        for step in 0 .. max_denoising_steps-1:      (the reference counts these down N..1)
            logits = denoise(canvas, cache, self-conditioning = softmax of previous step's scaled logits)
            sample / accept (in sampling.accept_order) / re-noise (dgemma.generation.denoising: one step)
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

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgemma.config import SamplingConfig
from dgemma.device_sync import host_read, to_device
from dgemma.generation.canvas import (
    canvases_for,
    columns_left,
    cut_at_eos,
    left_pad,
    pad_after_eos,
    template_slice,
)
from dgemma.generation.denoising import CanvasDenoising
from dgemma.model.network import PreviousStep
from dgemma.sampling import seed_or_random

# on_canvas(canvas_index, new_tokens, finished): new_tokens[b] are row b's tokens committed by this canvas
# (before its first EOS, within max_new_tokens; [] for a row already finished); finished[b] says the row
# is done. Concatenating a row's new_tokens over all calls gives GenerationResult.tokens[b].
OnCanvas = Callable[[int, list[list[int]], list[bool]], None]
# on_draft(step, draft (B, L), entropy (B, L), accepted (B, L) bool), after every decoder forward (step counts
# from 0 in each canvas; a DDIM corrector sweep counts as one): the draft is the argmax canvas, or with block
# refinement and DDIM the tokens the canvas holds where it holds a prediction (accepted) and the argmax elsewhere.
# Rows that already stopped keep their draft; their entropy and accepted mask belong to a step whose result was
# discarded.
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
    # per row: canvas positions run through the decoder, summed over its steps (fewer with the step cache)
    decoder_positions: list[int] | None = None
    # with a verifier (dgemma.generation.verify), per row: {"accepted", "rounds", "candidate",
    # "forwards" (all candidates'), "winner_forwards", "rejected"}
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
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to `sampling.max_new_tokens` tokens after each prompt (lists of token ids, any lengths).

    `model` follows docs/model-api.md (config.canvas_length, config.vocab_size, new_cache, encode, denoise).
    Randomness: one torch.Generator on the model's device seeded with `seed`, else `sampling.seed`, else a
    seed drawn from torch's global RNG (dgemma.sampling.seed_or_random: torch.manual_seed makes the call
    reproducible); same seed, device and batch -> same tokens. `sampling.fixed_steps` runs exactly
    max_denoising_steps per canvas.
    `constraint`: a dgemma.structured.TokenAutomaton for every row, or a list with one (or None) per
    row; a constrained row's answer is in the automaton's language (or cut: finish reason "length").
    guide_steps=False constrains only the committed canvases, not the accepted samples of each step
    (for measuring what the per-step guidance does; the engine always guides).
    `images`: a dgemma.images.ImageInputs holding the images of all prompts, row by row; their soft tokens
    take the places of the prompts' image tokens (`expand_image_tokens`).
    `generator`: continue this torch.Generator instead of seeding one (the verifier search's later rounds,
    dgemma.generation.verify.generate_verified, which runs this loop with a checker in it).

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
    start_time = time.perf_counter()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    device = device_of(model)
    batch_size, canvas_length, pad_id = len(prompts), model.config.canvas_length, sampling.pad_token_id
    max_new_tokens = sampling.max_new_tokens
    max_canvases = canvases_for(max_new_tokens, canvas_length)
    eos_ids = to_device(list(sampling.eos_token_ids), torch.long, device)
    template = _check_template(canvas_template, batch_size, model.config.vocab_size, device)
    answers = _constrained_answers(constraint, batch_size, sampling, template, guide_steps)
    seed = seed_or_random(seed, sampling.seed)
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = _encode_prompts(model, prompts, pad_id, max_canvases * canvas_length, images, device)

    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)  # produced an EOS
    rows = _Rows.empty(batch_size)  # the same on the host, and each row's tokens and steps
    committed: list[torch.Tensor] = []  # one (B, L) canvas each, pad after EOS
    forward_passes = torch.zeros(batch_size, dtype=torch.long, device=device)
    decoder_positions = [0] * batch_size
    time_to_first_canvas = 0.0
    for canvas_index in range(max_canvases):
        budget = columns_left(max_new_tokens, canvas_index, canvas_length)  # the tokens a row may still write
        fixed, fixed_tokens = (None, None) if template is None else template_slice(
            template.fixed, template.tokens, canvas_index, canvas_length)
        argmax, steps = denoise_canvas(
            model, cache, sampling, generator, frozen=finished, frozen_rows=rows.finished, fixed=fixed,
            fixed_tokens=fixed_tokens, on_draft=on_draft, answers=answers, budget=budget,
            decoder_positions=decoder_positions,
        )

        # Commit: everything after a row's first EOS becomes pad; rows finished earlier get only pad.
        canvas_tokens, has_eos = pad_after_eos(argmax, eos_ids, pad_id)  # (B, L), (B,)
        canvas_tokens = canvas_tokens.masked_fill(finished[:, None], pad_id)
        finished = finished | has_eos
        committed.append(canvas_tokens)
        forward_passes += steps

        # Host-side bookkeeping from one read per canvas: per row its tokens within the budget, its steps
        # and whether it has an EOS (this also waits for the device, so the timing below is honest).
        read = host_read(torch.cat([canvas_tokens[:, :budget], steps[:, None], has_eos[:, None].long()], 1), "canvas")
        new_tokens = rows.commit(read, sampling.eos_token_ids)
        if canvas_index == 0:
            time_to_first_canvas = time.perf_counter() - start_time
        last = canvas_index == max_canvases - 1
        if on_canvas is not None:
            on_canvas(canvas_index, new_tokens, [f or last for f in rows.finished])
        if last or all(rows.finished):
            break
        model.encode(canvas_tokens, cache, return_logits=False)  # extend the cache by the committed canvas
    result = rows.result(committed, forward_passes, sampling, seed, start_time, time_to_first_canvas)
    result.decoder_positions = decoder_positions
    return result


def _encode_prompts(model, prompts: list[list[int]], pad_id: int, output_positions: int, images, device):
    """A cache for the prompts and `output_positions` more columns, with the prompts encoded into it."""
    # Prompt: left-padded to the longest; padding is masked out but still occupies its column/position.
    input_ids, attention_mask = left_pad(prompts, pad_id, device)  # (B, P) each
    cache = model.new_cache(len(prompts), input_ids.shape[1] + output_positions)
    pixels = {} if images is None else dict(pixel_values=images.pixel_values,
                                            image_position_ids=images.image_position_ids)
    # prompts of one length need no mask (the cache then knows on the host that its rows hold no padding)
    same_length = all(len(p) == len(prompts[0]) for p in prompts)
    model.encode(input_ids, cache, attention_mask=None if same_length else attention_mask, return_logits=False,
                 **pixels)
    return cache


@dataclass
class _Rows:
    """The host's view of the batch, row by row, kept from one device read per canvas."""

    finished: list[bool]  # produced an EOS
    stopped: list[bool]  # an EOS within max_new_tokens
    tokens: list[list[int]]  # generated before the first EOS, within max_new_tokens
    steps_per_canvas: list[list[int]]

    @classmethod
    def empty(cls, batch_size: int) -> _Rows:
        return cls([False] * batch_size, [False] * batch_size, [[] for _ in range(batch_size)],
                   [[] for _ in range(batch_size)])

    def commit(self, read: list[list[int]], eos_ids) -> list[list[int]]:
        """Take in one canvas: read[b] = row b's tokens within the budget, then its steps and has-EOS flag.
        Returns each row's new tokens ([] for a row finished earlier)."""
        new_tokens = []
        for row, (*row_tokens, row_steps, row_eos) in enumerate(read):
            if self.finished[row]:
                new_tokens.append([])
                continue
            self.finished[row] = bool(row_eos)
            self.steps_per_canvas[row].append(row_steps)
            new, self.stopped[row] = cut_at_eos(row_tokens, eos_ids)
            new_tokens.append(new)
            self.tokens[row].extend(new)
        return new_tokens

    def result(self, committed: list[torch.Tensor], forward_passes: torch.Tensor, sampling: SamplingConfig,
               seed: int, start_time: float, time_to_first_canvas: float) -> GenerationResult:
        """committed: the (B, L) canvases as committed; forward_passes (B,) long: each row's denoiser passes."""
        all_committed = torch.cat(committed, dim=1)  # (B, num_canvases * L)
        sequences = all_committed[:, : sampling.max_new_tokens].cpu()
        finish_reasons = ["stop" if s else "length" for s in self.stopped]
        non_pad, passes = host_read(torch.stack([(all_committed != sampling.pad_token_id).sum(-1), forward_passes]),
                                    "result")
        elapsed = time.perf_counter() - start_time
        generated = sum(len(t) + (reason == "stop") for t, reason in zip(self.tokens, finish_reasons))
        return GenerationResult(
            sequences=sequences,
            tokens=self.tokens,
            finish_reasons=finish_reasons,
            num_canvases=len(committed),
            steps_per_canvas=self.steps_per_canvas,
            tokens_per_forward=[n / f for n, f in zip(non_pad, passes)],
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
    frozen_rows: list[bool] | None = None,
    fixed: torch.Tensor | None = None,
    fixed_tokens: torch.Tensor | None = None,
    on_draft: OnDraft | None = None,
    answers: list | None = None,
    budget: int = 0,
    decoder_positions: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise one canvas at positions cache.length .. cache.length+L-1.

    frozen (B,) bool marks rows with nothing to generate (finished earlier): computed, never changed;
    frozen_rows: the same on the host (read from `frozen` when not given).
    answers[b] (a dgemma.structured ConstrainedAnswer, or None) constrains row b; budget = the tokens
    each row may still write. decoder_positions[b] is increased by the canvas positions row b ran through
    the decoder (the whole canvas each step, or the step cache's active ones). Returns (canvas to commit (B, L) long: the argmax canvas, or a constrained
    row's chosen canvas; denoising steps each row ran (B,) long).

    The host reads once per step: the rows' stop flags and how many positions take a sample.
    """
    denoising = CanvasDenoising(sampling, generator, frozen.shape[0], model.config.canvas_length,
                                model.config.vocab_size, frozen.device, frozen=frozen, frozen_rows=frozen_rows,
                                fixed=fixed, fixed_tokens=fixed_tokens, answers=answers, budget=budget)
    self_conditioning = None  # no signal at the first step
    while not denoising.finished:
        if denoising.step_cache is None:
            logits = model.denoise(denoising.canvas, cache, self_conditioning=self_conditioning)  # (B, L, V) fp32
        else:  # only the active positions run; stopped rows not at all
            logits = denoising.step_cache.logits_for(model, denoising.canvas, cache, denoising.done,
                                                     self_conditioning=self_conditioning)
        predicting = denoising.predicting  # else a DDIM corrector sweep: the next forward reads this signal too
        if predicting:
            self_conditioning = None  # release last step's logits: one (B, L, V) buffer alive while sampling
        pending = denoising.scan(logits)
        *stop_rows, drawn = host_read(torch.cat([pending.stop.long(), pending.drawn_count.sum().view(1)]), "step")
        result = denoising.advance(pending, stop_rows, drawn)
        if on_draft is not None:
            on_draft(denoising.step_index - 1, pending.draft, result.entropy, result.accepted)
        if predicting and not denoising.finished:
            # the next forward's signal: softmax(logits / T), left in place by the sampler. Over the whole canvas
            # it is embedded now and the (B, L, V) buffer goes, so that the next forward's logits are the only
            # such buffer alive at its LM head (a step's peak); the step cache embeds only the positions it runs
            self_conditioning = (PreviousStep(probs=logits) if denoising.step_cache is not None
                                 else PreviousStep(embedding=model.soft_embedding_from_probs(logits)))
        del logits, pending, result
    if decoder_positions is not None:
        decoder_positions[:] = [d + c for d, c in zip(decoder_positions, denoising.decoder_positions)]
    return denoising.committed(), denoising.steps


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


def device_of(model) -> torch.device:
    """The device of a model's weights (its `device` attribute when it has one)."""
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
