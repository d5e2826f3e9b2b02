"""A request to the engine: its inputs (frozen), and the state the engine keeps for it (`request.state`)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from dgemma.config import SamplingConfig

if TYPE_CHECKING:
    from dgemma.generation.denoising import CanvasDenoising
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
    # "canvas": new tokens; "draft": the step's draft (the argmax canvas; with block refinement and DDIM the
    # tokens the canvas holds where it holds a prediction); "round": the positions the verifier rejected,
    # which the round that starts now (number `step`) re-noises
    tokens: list[int] = field(default_factory=list)
    entropy: list[float] | None = None  # "draft": per position
    accepted: list[bool] | None = None  # "draft": per position, whether it holds the model's prediction
    edited: list[bool] | None = None  # "draft": per position, a committed token block refinement replaced
    corrected: list[bool] | None = None  # "draft": per position, redrawn by a DDIM corrector sweep
    phase: str = "predictor"  # "draft": "predictor" (a denoising step) or "corrector" (a DDIM corrector sweep)
    settled: list[bool] | None = None  # "draft", with the step cache: positions this step kept instead of running
    finish_reason: str | None = None  # "finished": "stop" | "length" | "cancelled" | "scored"


_ids = itertools.count()


@dataclass(eq=False)
class RequestState:
    """What the engine tracks for any request, owned by it: where the request is, and what it reports."""

    on_event: Callable[[Event], None] | None = None
    status: Status = Status.WAITING
    row: int | None = None  # the cache row it holds
    cancel_requested: bool = False
    cached_tokens: int = 0  # prompt tokens the prefix cache gave
    finish_reason: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_done: float | None = None

    def emit(self, event: Event):
        if self.on_event is not None:
            self.on_event(event)


@dataclass(eq=False)
class GenerationState(RequestState):
    """A generating request's progress: its prompt in its row, the canvas being denoised, the output."""

    images: object | None = None  # the request's ImageInputs until its prompt is encoded (then None)
    generator: torch.Generator | None = None  # the request's own draws (seeded when admitted)
    prefilled: int | None = None  # prompt tokens in the row (cached or encoded); None until the prefill starts
    prefill_images: object | None = None  # the images still to encode with the rest of the prompt
    answer: object | None = None  # dgemma.structured.ConstrainedAnswer while a constrained request runs
    canvas_index: int = 0
    denoising: CanvasDenoising | None = None  # the canvas being denoised (made by the engine's _start_canvas)
    soft: torch.Tensor | None = None  # (L, H) self-conditioning embedding of the last step, or None
    argmax_tokens: list[int] | None = None  # the draft on the host, as the last step read it
    # the verifier search: the round running (1-based), the template it runs with (the request's own in
    # the first round, then the accepted positions of the last output), the verdict on the final output
    # (None: no verifier) and the positions the last round rejected
    round: int = 1
    fixed: torch.Tensor | None = None
    fixed_tokens: torch.Tensor | None = None
    verdict: bool | None = None
    rejected: list[int] | None = None
    # output and statistics
    tokens: list[int] = field(default_factory=list)
    steps_per_canvas: list[int] = field(default_factory=list)
    forward_passes: int = 0
    decoder_positions: int = 0  # canvas positions run through the decoder (fewer with the step cache)
    whole_canvas_positions: int = 0  # what whole canvases at every step would have run (decoder_positions' bar)
    committed_non_pad: int = 0
    t_first_canvas: float | None = None


@dataclass(eq=False)
class ScoreState(RequestState):
    scores: "PromptScores | None" = None  # the result


class _Outcome:
    """What callers read of any request's outcome, from its `state`."""

    state: RequestState

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def cached_tokens(self) -> int:
        return self.state.cached_tokens

    @property
    def done(self) -> bool:
        return self.state.status in (Status.FINISHED, Status.CANCELLED)


@dataclass(frozen=True, eq=False)
class Request(_Outcome):
    """A generation request's inputs (frozen); what the engine does with it is in `state`."""

    prompt: list[int]
    sampling: SamplingConfig
    seed: int
    fixed: torch.Tensor | None = None  # (W,) bool: canvas template over generated positions
    fixed_tokens: torch.Tensor | None = None  # (W,) long
    want_drafts: bool = False
    constraint: object | None = None  # a dgemma.structured.TokenAutomaton: the answer is in its language
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
    # dgemma.images.ImageInputs: the images whose soft tokens fill the prompt's image tokens, in order
    # (kept in the state, released once the prompt is encoded)
    images: InitVar[object | None] = None
    on_event: InitVar[Callable[[Event], None] | None] = None
    state: GenerationState = field(init=False, repr=False)

    def __post_init__(self, images, on_event):
        object.__setattr__(self, "state", GenerationState(on_event=on_event, images=images, fixed=self.fixed,
                                                          fixed_tokens=self.fixed_tokens))

    scoring = False

    # what callers read of the outcome
    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    @property
    def steps_per_canvas(self) -> list[int]:
        return self.state.steps_per_canvas

    @property
    def prefilling(self) -> bool:
        """Holds a row whose prompt is not all in it yet (chunked prefill)."""
        st = self.state
        return st.row is not None and (st.prefilled is None or st.prefilled < len(self.prompt))

    def stats(self) -> dict:
        st = self.state
        elapsed = (st.t_done or time.perf_counter()) - st.t_submit
        generated = len(st.tokens) + (st.finish_reason == "stop")
        return {
            "canvases": len(st.steps_per_canvas),
            "steps_per_canvas": list(st.steps_per_canvas),
            "denoising_steps": sum(st.steps_per_canvas),
            "tokens_per_forward": st.committed_non_pad / st.forward_passes if st.forward_passes else 0.0,
            "decoder_positions": st.decoder_positions,
            "whole_canvas_positions": st.whole_canvas_positions,
            "time_to_first_canvas_s": (st.t_first_canvas - st.t_submit) if st.t_first_canvas else None,
            "cached_prompt_tokens": st.cached_tokens,
            "elapsed_s": elapsed,
            "tokens_per_second": generated / elapsed if elapsed > 0 else 0.0,
            **({} if self.verifier is None else {"rounds": st.round, "accepted": st.verdict}),
            **({} if self.search is None else {"search": self.search.stats()}),
        }


@dataclass(frozen=True, eq=False)
class ScoreRequest(_Outcome):
    """A prompt to score, not continue: its log-probabilities with `top` most likely alternatives per
    position (at least 1: the token after the prompt), computed by the causal encoder (engine/scoring.py)."""

    prompt: list[int]
    top: int = 1
    adapter: int = 0
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    state: ScoreState = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "state", ScoreState())

    scoring = True
    prefilling = False

    @property
    def scores(self) -> "PromptScores | None":
        return self.state.scores
