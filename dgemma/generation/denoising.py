"""One canvas being denoised: the sampler step and stop rule that the plain loop and the engine share.

A `CanvasDenoising` holds the state of one canvas for a group of rows that draw from one
torch.Generator: all the rows of a plain `generate` call (diffusion.py), or one request's row in the
engine (engine/engine.py, which runs one decoder forward over many such groups). Every step is

    logits = decoder(decoder_input)                        the caller's forward, (B, L, V)
    pending = denoising.scan(logits)                       temperature -> scan_step -> stop rule
    stop_rows, drawn = host_read(pending.stop, pending.drawn_count)      the caller's one read
    denoising.advance(pending, stop_rows, drawn)           samples, re-noise, structured guidance

so a change to the sampler (the acceptance orders, what a stopped row keeps) is made here once. With the
step cache on (SamplingConfig.step_cache) `step_cache` says which positions the forward runs and gives the
step's logits from them (dgemma.generation.step_cache); `advance` lets positions settle. How the
step's probabilities become the next step's self-conditioning is the caller's (the plain loop passes
them to the model; the engine embeds them per row); the logits buffer holds softmax(logits / T) after
`scan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.config import SamplingConfig
from dgemma.device_sync import host_read
from dgemma.generation.step_cache import StepCache
from dgemma.sampling import adaptive_stop, new_argmax_history, random_tokens, temperature_schedule
from dgemma.sampling.sampler import ScannedStep, draw_samples, scan_logits, scan_step


@dataclass
class PendingStep:
    """A scanned step whose samples are not drawn yet: what the caller reads before `advance`."""

    scanned: ScannedStep
    probs: torch.Tensor  # (B, L, V): softmax(logits / T), in the logits buffer
    stop: torch.Tensor  # (B,) bool: the stop rule's verdict for each row
    temperature: float = 1.0  # the step's: `probs` are at it

    @property
    def drawn_count(self) -> torch.Tensor:
        """(B,) long: positions of each row that take a sample."""
        return self.scanned.drawn.sum(-1)


class CanvasDenoising:
    """The denoising state of one canvas for B rows sharing `generator`.

    frozen (B,) bool: rows with nothing to generate (finished earlier): computed, never changed;
    frozen_rows: the same on the host. fixed / fixed_tokens (B, L): the canvas template's slice for
    this canvas. answers[b]: row b's dgemma.structured ConstrainedAnswer (or None); budget: the tokens
    each row may still write in this canvas.
    """

    def __init__(self, sampling: SamplingConfig, generator: torch.Generator, batch_size: int, canvas_length: int,
                 vocab_size: int, device, *, frozen: torch.Tensor | None = None,
                 frozen_rows: list[bool] | None = None, fixed: torch.Tensor | None = None,
                 fixed_tokens: torch.Tensor | None = None, answers: list | None = None, budget: int = 0):
        shape = (batch_size, canvas_length)
        self.sampling, self.generator = sampling, generator
        self.fixed, self.fixed_tokens = fixed, fixed_tokens
        self.answers, self.budget = answers, budget
        canvas = random_tokens(shape, vocab_size, generator, device)
        if fixed is not None:
            canvas = torch.where(fixed, fixed_tokens, canvas)
        self.canvas = canvas  # (B, L) long: the next decoder input
        self.argmax = canvas  # (B, L) long: the draft (before any step: what the reference starts from)
        self.done = torch.zeros(batch_size, dtype=torch.bool, device=device) if frozen is None else frozen.clone()
        if frozen_rows is None:
            frozen_rows = [False] * batch_size if frozen is None else [bool(f) for f in host_read(frozen, "canvas start")]
        self.done_rows = list(frozen_rows)  # the same on the host
        self.steps = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) steps each row ran
        self.step_index = 0  # steps run on this canvas
        self.history = new_argmax_history(sampling.stability_threshold, *shape, device)
        self.chosen: dict[int, torch.Tensor] = {}  # constrained rows: the (L,) canvas each commits
        self.step_cache = (StepCache(sampling, batch_size, canvas_length, vocab_size, device, generator)
                           if sampling.step_cache else None)

    @property
    def decoder_positions(self) -> list[int]:
        """Per row: the canvas positions it ran through the decoder on this canvas (the whole canvas at every
        step without the step cache)."""
        if self.step_cache is not None:
            return list(self.step_cache.decoder_positions)
        return [self.canvas.shape[1] * self.step_index] * self.canvas.shape[0]

    @property
    def finished(self) -> bool:
        """Every row stopped, or the step budget is spent."""
        return all(self.done_rows) or self.step_index >= self.sampling.max_denoising_steps

    def scan(self, logits: torch.Tensor, scan=scan_logits) -> PendingStep:
        """The step's scan over the decoder's logits (B, L, V) fp32, overwritten with softmax(logits / T),
        and the stop rule. Nothing is read back to the host."""
        s = self.sampling
        self.steps += ~self.done
        temperature = temperature_schedule(self.step_index, s.max_denoising_steps, s.t_min, s.t_max)
        scanned = scan_step(logits, temperature, s.entropy_bound, self.generator, fixed=self.fixed,
                            fixed_tokens=self.fixed_tokens, scan=scan, accept_order=s.accept_order)
        # a stopped row keeps its draft
        self.argmax = scanned.argmax if not any(self.done_rows) else torch.where(self.done[:, None], self.argmax,
                                                                                  scanned.argmax)
        stop, self.history = adaptive_stop(self.history, self.argmax, scanned.entropy, s.confidence_threshold,
                                           self.fixed)
        return PendingStep(scanned, logits, stop, temperature)

    def advance(self, pending: PendingStep, stop_rows: list[int], drawn: int) -> ScannedStep:
        """Draw the samples (`drawn` positions in all, as read with `stop_rows`), re-noise the rest, let
        constrained rows' accepted positions take tokens of a valid answer, and apply the stop rule.
        Returns the step's result (its entropy and accepted mask are what drafts show)."""
        result = draw_samples(pending.scanned, drawn)
        was_done = list(self.done_rows)
        if self.answers is not None:
            for row, answer in enumerate(self.answers):
                if answer is not None and not was_done[row]:
                    result.canvas[row] = answer.guide(result.canvas[row], result.accepted[row], pending.probs[row],
                                                      self.budget, self.generator)
        self.canvas = result.canvas if not any(was_done) else torch.where(self.done[:, None], self.canvas,
                                                                           result.canvas)
        if self.step_cache is not None:
            self.step_cache.settle(pending.scanned.argmax, pending.probs, result.drawn, self.canvas, self.done,
                                   pending.temperature)
        if not self.sampling.fixed_steps:
            self.done |= pending.stop
            self.done_rows = [d or bool(s) for d, s in zip(self.done_rows, stop_rows)]
        self.step_index += 1
        if self.answers is not None:  # rows that stop here commit this step's most probable valid canvas
            last_step = self.step_index >= self.sampling.max_denoising_steps
            for row, answer in enumerate(self.answers):
                if answer is not None and not was_done[row] and (self.done_rows[row] or last_step):
                    self.chosen[row] = answer.commit(pending.probs[row], self.budget)
        return result

    def committed(self) -> torch.Tensor:
        """(B, L) long: what the canvas commits: the argmax draft, or a constrained row's chosen canvas."""
        if not self.chosen:
            return self.argmax
        out = self.argmax.clone()
        for row, tokens in self.chosen.items():
            out[row] = tokens
        return out
