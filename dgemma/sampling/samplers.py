"""The three samplers behind one interface: what a canvas's denoising step asks of its sampler.

`SamplingConfig.sampler` picks one; each keeps one canvas's state for B rows and turns every decoder forward's
logits (B, L, V) fp32 into the next canvas, as pure tensor work (no model, no host reads):

  entropy-bound      the model's own sampler (sampler.py): temperature annealed t_max -> t_min, the lowest-entropy
                     positions accepted under the bound, every other position re-noised; commits the argmax draft
  block-refinement   commit the most confident predictions, an even share of the canvas per step, optionally
                     editing committed tokens (block_refinement.py); commits the canvas
  ddim               ancestral steps from the uniform process's exact posterior, optionally with corrector sweeps
                     (ddim.py); commits the canvas

A forward is either a *predictor* step (it moves the canvas down the noise schedule, its probabilities are the next
forward's self-conditioning, and the stop rule reads its argmax and entropy) or a DDIM *corrector* sweep (it
redraws a few positions of the canvas; the self-conditioning and the stop rule stay with the last predictor
step). The entropy bound and block refinement run predictor steps only. As diffusers' DiffusionGemmaPipeline
feeds them: the entropy bound self-conditions on its tempered distribution, the other two on the model's own
(temperature 1); their `temperature` only shapes what they draw.

`scan` does the step's work; `finish` draws what the host had to count first (the entropy bound's samples at
its accepted positions; the others have drawn everything in `scan`).
"""

from __future__ import annotations

import torch

from dgemma.sampling.block_refinement import refinement_step
from dgemma.sampling.ddim import corrector_sweep, ddim_step, forward_budget
from dgemma.sampling.sampler import (
    ScannedStep,
    draw_samples,
    sample_tempered,
    scan_logits,
    scan_positions,
    scan_step,
    temperature_schedule,
)


class EntropyBoundSampler:
    """The entropy bound (sampler.py) with its temperature schedule; every forward is a predictor step."""

    commits_argmax = True

    def __init__(self, sampling, batch_size: int, canvas_length: int, vocab_size: int, device, *, fixed=None,
                 fixed_tokens=None):
        self.sampling, self.fixed, self.fixed_tokens = sampling, fixed, fixed_tokens

    def is_predictor(self, forward_index: int) -> bool:
        return True

    def scan(self, logits: torch.Tensor, canvas: torch.Tensor, forward_index: int, generator,
             scan=scan_logits) -> ScannedStep:
        s = self.sampling
        temperature = temperature_schedule(forward_index, s.max_denoising_steps, s.t_min, s.t_max)
        return scan_step(logits, temperature, s.entropy_bound, generator, fixed=self.fixed,
                         fixed_tokens=self.fixed_tokens, scan=scan, accept_order=s.accept_order)

    def finish(self, scanned: ScannedStep, drawn: int | None) -> ScannedStep:
        return draw_samples(scanned, drawn)


class _PredictionSampler:
    """What block refinement and DDIM share: the scan at temperature 1 and the prediction drawn from it."""

    commits_argmax = False

    def __init__(self, sampling, batch_size: int, canvas_length: int, vocab_size: int, device, *, fixed=None,
                 fixed_tokens=None):
        self.sampling, self.vocab_size, self.fixed, self.fixed_tokens = sampling, vocab_size, fixed, fixed_tokens
        self.no_positions = torch.zeros(batch_size, canvas_length, dtype=torch.bool, device=device)

    def predict(self, logits: torch.Tensor, generator, scan):
        """logits (B, L, V), overwritten with softmax(logits) -> (probs (B * L, V), argmax, entropy, predicted
        token and its probability at `sampling.temperature`, each (B, L); a template's positions hold their
        tokens, at entropy 0 and probability 1)."""
        B, L, _ = logits.shape
        probs, argmax, entropy, _ = scan_positions(logits, 1.0, scan=scan)
        predicted, confidence = sample_tempered(probs, self.sampling.temperature, generator)
        predicted, confidence = predicted.view(B, L), confidence.view(B, L)
        if self.fixed is not None:
            argmax = torch.where(self.fixed, self.fixed_tokens, argmax)
            predicted = torch.where(self.fixed, self.fixed_tokens, predicted)
            entropy = entropy.masked_fill(self.fixed, 0.0)
            confidence = confidence.masked_fill(self.fixed, 1.0)
        return probs, argmax, entropy, predicted, confidence

    def finish(self, scanned: ScannedStep, drawn: int | None) -> ScannedStep:
        return scanned


class BlockRefinementSampler(_PredictionSampler):
    """Block refinement (block_refinement.py): the committed positions are the canvas's state."""

    def __init__(self, sampling, batch_size: int, canvas_length: int, vocab_size: int, device, *, fixed=None,
                 fixed_tokens=None):
        super().__init__(sampling, batch_size, canvas_length, vocab_size, device, fixed=fixed,
                         fixed_tokens=fixed_tokens)
        self.committed = self.no_positions if fixed is None else fixed.clone()  # (B, L) bool

    def is_predictor(self, forward_index: int) -> bool:
        return True

    def scan(self, logits: torch.Tensor, canvas: torch.Tensor, forward_index: int, generator,
             scan=scan_logits) -> ScannedStep:
        s = self.sampling
        probs, argmax, entropy, predicted, confidence = self.predict(logits, generator, scan)
        step = refinement_step(canvas, self.committed, predicted, confidence, forward_index, s.max_denoising_steps,
                               generator, self.vocab_size, commit_threshold=s.commit_threshold,
                               editing_threshold=s.editing_threshold, fixed=self.fixed,
                               fixed_tokens=self.fixed_tokens)
        self.committed = step.committed
        return ScannedStep(probs, None, step.canvas, argmax, entropy, accepted=step.committed,
                           drawn=step.transfer | step.edited, edited=step.edited)


class DDIMSampler(_PredictionSampler):
    """Discrete DDIM (ddim.py): the canvas's forwards are predictor steps and, after the first few of them,
    corrector sweeps (`forward_budget`)."""

    def __init__(self, sampling, batch_size: int, canvas_length: int, vocab_size: int, device, *, fixed=None,
                 fixed_tokens=None):
        super().__init__(sampling, batch_size, canvas_length, vocab_size, device, fixed=fixed,
                         fixed_tokens=fixed_tokens)
        sweeps = sampling.corrector_steps
        self.predictor_steps, corrected = forward_budget(sampling.max_denoising_steps, sweeps)
        # forward index -> (predictor step index, whether the forward is a corrector sweep after it)
        self.schedule = []
        for step in range(self.predictor_steps):
            self.schedule.append((step, False))
            self.schedule += [(step, True)] * (sweeps if step < corrected else 0)
        self.x0 = None  # (B, L) long: the last predictor step's predicted clean tokens

    def is_predictor(self, forward_index: int) -> bool:
        return not self.schedule[forward_index][1]

    def scan(self, logits: torch.Tensor, canvas: torch.Tensor, forward_index: int, generator,
             scan=scan_logits) -> ScannedStep:
        s = self.sampling
        step_index, sweep = self.schedule[forward_index]
        if sweep:
            swept = corrector_sweep(logits, canvas, step_index, self.predictor_steps, generator, k=s.corrector_k,
                                    selection=s.corrector_selection, tau=s.corrector_selection_tau, fixed=self.fixed)
            return ScannedStep(None, None, swept.canvas, swept.argmax, swept.entropy,
                               accepted=swept.canvas == self.x0, drawn=self.no_positions,
                               corrected=swept.corrected, predictor=False)
        probs, argmax, entropy, self.x0, _ = self.predict(logits, generator, scan)
        step = ddim_step(canvas, self.x0, step_index, self.predictor_steps, generator, self.vocab_size,
                         fixed=self.fixed, fixed_tokens=self.fixed_tokens)
        return ScannedStep(probs, None, step.canvas, argmax, entropy, accepted=step.canvas == self.x0,
                           drawn=step.clean)


SAMPLER_CLASSES = {"entropy-bound": EntropyBoundSampler, "block-refinement": BlockRefinementSampler,
                   "ddim": DDIMSampler}


def canvas_sampler(sampling, batch_size: int, canvas_length: int, vocab_size: int, device, *, fixed=None,
                   fixed_tokens=None):
    """`sampling.sampler`'s state for one canvas of B rows (a template's `fixed` / `fixed_tokens` (B, L) or None)."""
    return SAMPLER_CLASSES[sampling.sampler](sampling, batch_size, canvas_length, vocab_size, device, fixed=fixed,
                                             fixed_tokens=fixed_tokens)
