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
from dgemma.sampling import adaptive_stop, new_argmax_history, random_tokens
from dgemma.sampling.sampler import ScannedStep, scan_logits, temperature_schedule
from dgemma.sampling.samplers import canvas_sampler


@dataclass
class PendingStep:
    """A scanned step whose samples are not drawn yet: what the caller reads before `advance`."""

    scanned: ScannedStep
    probs: torch.Tensor  # (B, L, V): softmax(logits / T), in the logits buffer (a corrector sweep: its logits)
    stop: torch.Tensor  # (B,) bool: the stop rule's verdict for each row
    # (B, L) long: what the step shows: the argmax canvas, or (block refinement, DDIM) the tokens the canvas holds
    # where it holds a prediction and the argmax elsewhere; a stopped row: its draft when it stopped
    draft: torch.Tensor
    candidate: torch.Tensor  # (B, L) long: what the canvas commits if it ends with this step
    temperature: float = 1.0  # the entropy-bound sampler's step temperature: `probs` are at it

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
        self.sampler = canvas_sampler(sampling, batch_size, canvas_length, vocab_size, device, fixed=fixed,
                                      fixed_tokens=fixed_tokens)

    @property
    def predicting(self) -> bool:
        """The next forward is a predictor step (its probabilities become the next self-conditioning), not a
        DDIM corrector sweep (whose forward reads the last predictor step's)."""
        return self.sampler.is_predictor(self.step_index)

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
        scanned = self.sampler.scan(logits, self.canvas, self.step_index, self.generator, scan=scan)
        # a stopped row keeps its draft
        argmax = scanned.argmax if not any(self.done_rows) else torch.where(self.done[:, None], self.argmax,
                                                                             scanned.argmax)
        draft = argmax
        if not self.sampler.commits_argmax:  # what the canvas holds where it holds a prediction, the argmax elsewhere
            held = torch.where(scanned.accepted, scanned.canvas, scanned.argmax)
            draft = held if not any(self.done_rows) else torch.where(self.done[:, None], self.argmax, held)
        if not scanned.predictor:  # a corrector sweep: the stop rule waits for the next predictor step
            return PendingStep(scanned, logits, torch.zeros_like(self.done), draft, self.committed_now())
        self.argmax = argmax
        stop, self.history = adaptive_stop(self.history, self.argmax, scanned.entropy, s.confidence_threshold,
                                           self.fixed)
        if self.sampler.commits_argmax:
            candidate = self.argmax
        else:  # the canvas, or the draft where the stop rule ends it (a stopped row: what it committed)
            ends = stop & ~self.done if not s.fixed_steps else torch.zeros_like(stop)
            candidate = torch.where(self.done[:, None], self.canvas,
                                    torch.where(ends[:, None], self.argmax, scanned.canvas))
        temperature = (temperature_schedule(self.step_index, s.max_denoising_steps, s.t_min, s.t_max)
                       if s.sampler == "entropy-bound" else 1.0)
        return PendingStep(scanned, logits, stop, draft, candidate, temperature)

    def advance(self, pending: PendingStep, stop_rows: list[int], drawn: int) -> ScannedStep:
        """Draw the samples (`drawn` positions in all, as read with `stop_rows`), re-noise the rest, let
        constrained rows' accepted positions take tokens of a valid answer, and apply the stop rule.
        Returns the step's result (its entropy and accepted mask are what drafts show)."""
        result = self.sampler.finish(pending.scanned, drawn)
        was_done = list(self.done_rows)
        if self.answers is not None and result.predictor:
            for row, answer in enumerate(self.answers):
                if answer is not None and not was_done[row]:
                    result.canvas[row] = answer.guide(result.canvas[row], result.drawn[row], pending.probs[row],
                                                      self.budget, self.generator)
        self.canvas = result.canvas if not any(was_done) else torch.where(self.done[:, None], self.canvas,
                                                                           result.canvas)
        self.step_index += 1
        if not result.predictor:
            return result
        if self.step_cache is not None:
            self.step_cache.settle(pending.scanned.argmax, pending.probs, result.drawn, self.canvas, self.done,
                                   pending.temperature)
        if not self.sampling.fixed_steps:
            if not self.sampler.commits_argmax:  # a row the stop rule ends commits its draft, as its canvas
                self.canvas = torch.where((pending.stop & ~self.done)[:, None], self.argmax, self.canvas)
            self.done |= pending.stop
            self.done_rows = [d or bool(s) for d, s in zip(self.done_rows, stop_rows)]
        if self.answers is not None:  # rows that stop here commit this step's most probable valid canvas
            last_step = self.step_index >= self.sampling.max_denoising_steps
            for row, answer in enumerate(self.answers):
                if answer is not None and not was_done[row] and (self.done_rows[row] or last_step):
                    self.chosen[row] = answer.commit(pending.probs[row], self.budget)
        return result

    def committed(self) -> torch.Tensor:
        """(B, L) long: what the canvas commits: the argmax draft (the entropy bound) or the canvas (the others;
        a row the stop rule ended holds its draft), or a constrained row's chosen canvas."""
        base = self.committed_now()
        if not self.chosen:
            return base
        out = base.clone()
        for row, tokens in self.chosen.items():
            out[row] = tokens
        return out

    def committed_now(self) -> torch.Tensor:
        """(B, L) long: what the canvas would commit now, constraints aside."""
        return self.argmax if self.sampler.commits_argmax else self.canvas
