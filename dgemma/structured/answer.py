"""One constrained answer inside the denoising loop: where it stands in its automaton, and the two
things the loop asks of it (dgemma.generation and dgemma.engine call the same methods in the same order,
so a constrained request's tokens are the same through either).

How the constraint shapes a canvas:
  * every denoising step (`guide`): the positions the entropy bound accepts take their token from a
    string drawn from the step's distributions restricted to the language (constrained_sample), in
    place of their unconstrained samples. The model then reads, at every accepted position, tokens that
    belong to a valid answer, and refines the rest around them; re-noised positions stay uniform noise.
    Which positions are accepted, and the stop rule (stable argmax, low mean entropy), are left as the
    unconstrained sampler decides them: the entropies describe the model's own certainty.
  * commit (`commit`): instead of the argmax canvas, the most probable canvas the automaton accepts
    under the committing step's distributions (constrained_canvas), and the automaton state after it
    carries to the next canvas. EOS only where the language may end; the answer always fits the budget.
"""

from __future__ import annotations

import torch

from dgemma.structured.automaton import TokenAutomaton
from dgemma.structured.decode import ENDED, constrained_canvas, constrained_sample


class ConstrainedAnswer:
    def __init__(self, automaton: TokenAutomaton, eos_token_ids, pad_token_id: int, *, guide_steps: bool = True):
        self.automaton = automaton
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), pad_token_id
        self.guide_steps = guide_steps
        self.state = automaton.initial
        self.cut = False  # a canvas had to commit a prefix no budget could complete

    @property
    def ended(self) -> bool:
        return self.state == ENDED

    def guide(self, canvas: torch.Tensor, accepted: torch.Tensor, probs: torch.Tensor, budget: int,
              generator: torch.Generator) -> torch.Tensor:
        """canvas (L,) with accepted (L,) positions replaced by a constrained sample from probs (L, V)."""
        if not self.guide_steps or self.ended or not bool(accepted.any()):
            return canvas
        drawn = constrained_sample(self.automaton, probs, self.state, budget=budget, eos_token_ids=self.eos_token_ids,
                                   pad_token_id=self.pad_token_id, generator=generator)
        return torch.where(accepted, drawn, canvas)

    def commit(self, probs: torch.Tensor, budget: int) -> torch.Tensor:
        """The canvas (L,) to commit under probs (L, V); the answer's state moves past it."""
        choice = constrained_canvas(self.automaton, probs, self.state, budget=budget, eos_token_ids=self.eos_token_ids,
                                    pad_token_id=self.pad_token_id)
        self.state = choice.state
        self.cut = self.cut or choice.cut
        return choice.tokens
