"""What the engine knows about one request: inputs, sampler state, output, statistics."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from dgemma.config import SamplingConfig

if TYPE_CHECKING:
    from dgemma.engine.scoring import PromptScores


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no cache row yet
    DENOISING = "denoising"  # holds a row; a canvas is being denoised
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass
class Event:
    """What a request reports to its owner. A scoring request reports only "finished" (reason "scored"),
    its scores on the request."""

    kind: str  # "draft" | "canvas" | "round" | "finished"
    request_id: str
    canvas_index: int
    step: int = 0
    # "canvas": new tokens; "draft": the argmax canvas; "round": the positions the verifier rejected,
    # which the round that starts now (number `step`) re-noises
    tokens: list[int] = field(default_factory=list)
    entropy: list[float] | None = None  # "draft": per position
    accepted: list[bool] | None = None  # "draft": per position
    finish_reason: str | None = None  # "finished": "stop" | "length" | "cancelled" | "scored"


_ids = itertools.count()


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingConfig | None  # None for a scoring request
    seed: int
    fixed: torch.Tensor | None = None  # (W,) bool: canvas template over generated positions
    fixed_tokens: torch.Tensor | None = None  # (W,) long
    want_drafts: bool = False
    # A scoring request is not continued: its prompt's log-probabilities are computed (engine/scoring.py)
    # with this many most likely alternatives per position (at least 1: the token after the prompt).
    score_top: int | None = None
    constraint: object | None = None  # a dgemma.structured.TokenAutomaton: the answer is in its language
    # dgemma.images.ImageInputs: the images whose soft tokens fill the prompt's image tokens, in order
    # (released once the prompt is encoded)
    images: object | None = None
    on_event: Callable[[Event], None] | None = None
    # dgemma.generation.verify: tokens -> rejected positions, checked when the output is complete; a
    # rejected output is denoised again (up to max_rounds rounds) with the accepted positions kept
    verifier: Callable | None = None
    max_rounds: int = 1
    search: object | None = None  # the dgemma.engine.search.Search this request is a candidate of
    candidate: int = 0  # its index there
    adapter: int = 0  # the served LoRA adapter this request runs (dgemma.model.adapters; 0: the base model)
    # encode the final canvas too (only for the prefix cache): a conversation's next turn then starts with
    # the whole answer cached
    cache_answer: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")

    # state, owned by the engine
    status: Status = Status.WAITING
    row: int | None = None
    generator: torch.Generator | None = None
    prefilled: int | None = None  # prompt tokens in the row (cached or encoded); None until the prefill starts
    cached_tokens: int = 0  # prompt tokens the prefix cache gave
    prefill_images: object | None = None  # the images still to encode with the rest of the prompt
    canvas_index: int = 0
    step_index: int = 0
    canvas: torch.Tensor | None = None  # (L,) next decoder input
    argmax: torch.Tensor | None = None  # (L,) current draft
    argmax_tokens: list[int] | None = None  # the same on the host, as the step read it
    history: torch.Tensor | None = None  # (S, L) recent argmax canvases (stop rule)
    soft: torch.Tensor | None = None  # (L, H) self-conditioning embedding of the last step, or None
    canvas_fixed: torch.Tensor | None = None  # (L,) slice of the template for the current canvas
    canvas_fixed_tokens: torch.Tensor | None = None
    answer: object | None = None  # dgemma.structured.ConstrainedAnswer while a constrained request runs
    cancel_requested: bool = False
    round: int = 1  # verifier rounds: the one running (1-based)
    base_template: tuple | None = None  # the caller's (fixed, fixed_tokens) while later rounds replace them

    # output and statistics
    tokens: list[int] = field(default_factory=list)
    scores: "PromptScores | None" = None  # a scoring request's result
    finish_reason: str | None = None
    steps_per_canvas: list[int] = field(default_factory=list)
    forward_passes: int = 0
    committed_non_pad: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_canvas: float | None = None
    t_done: float | None = None
    accepted: bool | None = None  # the verifier's verdict on the final output (None: no verifier)
    rejected: list[int] | None = None  # positions it rejected in the last round

    def emit(self, event: Event):
        if self.on_event is not None:
            self.on_event(event)

    @property
    def scoring(self) -> bool:
        return self.score_top is not None

    @property
    def cached_prefix_tokens(self) -> int:
        """`cached_tokens` under the name the server's metrics read."""
        return self.cached_tokens

    @property
    def prefilling(self) -> bool:
        """Holds a row whose prompt is not all in it yet (chunked prefill)."""
        return self.row is not None and not self.scoring and (self.prefilled is None or
                                                              self.prefilled < len(self.prompt))

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)

    def stats(self) -> dict:
        elapsed = (self.t_done or time.perf_counter()) - self.t_submit
        generated = len(self.tokens) + (self.finish_reason == "stop")
        return {
            "canvases": len(self.steps_per_canvas),
            "steps_per_canvas": list(self.steps_per_canvas),
            "denoising_steps": sum(self.steps_per_canvas),
            "tokens_per_forward": self.committed_non_pad / self.forward_passes if self.forward_passes else 0.0,
            "time_to_first_canvas_s": (self.t_first_canvas - self.t_submit) if self.t_first_canvas else None,
            "cached_prompt_tokens": self.cached_tokens,
            "elapsed_s": elapsed,
            "tokens_per_second": generated / elapsed if elapsed > 0 else 0.0,
            **({} if self.verifier is None else {"rounds": self.round, "accepted": self.accepted}),
            **({} if self.search is None else {"search": self.search.stats()}),
        }
