"""Solving sudoku puzzles with a model and scoring the answers: what `dgemma sudoku solve | eval` run.

Diffusion decoding goes through the engine, one search per puzzle with its own seed (seed + i): the
rules checker (SudokuVerifier) sends the cells that break a rule back to the denoiser, up to `rounds`
rounds, with `candidates` seeds side by side; the drafts record when each cell settled and how often an
accepted cell was changed later. The AR baseline decodes left to right (best of n samples under the
same checker). Either way an answer is exactly one canvas of 81 cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dgemma.tasks import sudoku

CELLS = sudoku.SudokuVocab.canvas_length
MAX_LENGTH = 1 + CELLS + CELLS  # BOS and the puzzle, then the answer canvas


def sudoku_sampling(model, seed: int, **overrides):
    """The model's sampler settings for one 81-cell answer; `overrides` are SamplingConfig fields (None
    keeps the model's value)."""
    # One canvas is the whole answer, so no EOS ends it early: a cell the model fills with a non-digit
    # token is simply a wrong cell (and the givens of a clamped run stay in place).
    return model.sampling_config.replace(max_new_tokens=CELLS, seed=seed, eos_token_ids=(),
                                         pad_token_id=sudoku.SudokuVocab.PAD, **overrides)


def givens_template(puzzle) -> tuple[torch.Tensor, torch.Tensor]:
    """Givens fixed through the canvas template: (fixed (81,) bool, tokens (81,) long)."""
    filled = [v if v else 1 for v in puzzle]  # blanks get a placeholder that the mask ignores
    return torch.tensor([v != 0 for v in puzzle]), torch.tensor(sudoku.encode_solution(filled))


class SudokuVerifier:
    """The verifier of the denoising search (dgemma.generation.verify) for one puzzle: an answer's tokens ->
    the cells to denoise again. Rules only, no solving: sudoku_grid.rule_violations finds the cells that
    break a rule (no digit, a clash in a row, column or box, a changed given). With scope "units" (the
    default) every non-given cell of a row, column or box holding such a cell is rejected with it: a
    clash is often caused by a wrong cell elsewhere in its unit, which "cells" would keep fixed."""

    SCOPES = ("units", "cells")

    def __init__(self, puzzle, scope: str = "units"):
        if scope not in self.SCOPES:
            raise ValueError(f"scope must be one of {self.SCOPES}, got {scope!r}")
        self.puzzle, self.scope = tuple(puzzle), scope

    def __call__(self, tokens: list[int]) -> list[int]:
        grid = answer_grid(tokens) or (0,) * CELLS
        bad = sudoku.rule_violations(self.puzzle, grid)
        if self.scope == "cells" or not bad:
            return bad
        broken, wide = set(bad), set(bad)
        for unit in sudoku.UNITS:
            if broken.intersection(unit):
                wide.update(i for i in unit if not self.puzzle[i])
        return sorted(wide)


def answer_grid(tokens: list[int]):
    """The grid an answer's tokens spell (cells it did not reach are blank)."""
    return sudoku.decode_canvas(list(tokens) + [sudoku.SudokuVocab.PAD] * (CELLS - len(tokens)))


class SettleTracker:
    """Per puzzle, from the draft events: when each cell's argmax reached its final value for good, and
    how often an accepted token was later replaced (self-correction)."""

    def __init__(self):
        self.history: list[list[int]] = []  # argmax canvas per step
        self.accepted: list[list[bool]] = []

    def add(self, event):
        self.history.append(event.tokens)
        self.accepted.append(event.accepted)

    def settle_steps(self) -> list[int]:
        """Per cell, the 1-based step from which it stayed accepted with its final token: when it got fixed.
        (Nothing is locked for good in a uniform-state sampler, so "fixed" means "never changed again".)"""
        final = self.history[-1]
        steps = []
        for cell in range(CELLS):
            step = len(self.history)
            while step > 0 and self.accepted[step - 1][cell] and self.history[step - 1][cell] == final[cell]:
                step -= 1
            steps.append(step + 1)
        return steps

    def corrections(self) -> tuple[int, int]:
        """(accepted cells whose token differs from the committed one, accepted cells): over all steps."""
        final = self.history[-1]
        changed = total = 0
        for tokens, accepted in zip(self.history, self.accepted):
            for cell in range(CELLS):
                if accepted[cell]:
                    total += 1
                    changed += tokens[cell] != final[cell]
        return changed, total


@dataclass
class Evaluation:
    scores: dict  # sudoku.score: solved per bucket and overall with 95% intervals, cell accuracies
    decoding: dict = field(default_factory=dict)  # diffusion only: steps, cells per forward, corrections
    settle: list[float] | None = None  # diffusion only: mean step at which each blank cell got fixed
    answers: list[list[int]] = field(default_factory=list)  # per puzzle: the answer's tokens


def evaluate(model, puzzles, *, batch: int, sampling=None, clamp: bool = False, seed: int = 0, run=None,
             rounds: int = 1, candidates: int = 1) -> Evaluation:
    """Solve every puzzle and score the answers. `sampling` (see `sudoku_sampling`) decodes by diffusion
    through the engine, `batch` rows at a time; None decodes with the AR baseline. `rounds` and
    `candidates`: the verifier search (SudokuVerifier, dgemma.generation.verify); for AR, best of
    rounds x candidates samples (the first greedy) checked by the same verifier.
    `run(engine, requests)` steps the engine until the requests are done (default: without a display)."""
    import time

    start = time.perf_counter()
    if sampling is None:
        evaluation = _evaluate_ar(model, puzzles, batch, rounds * candidates, seed)
    else:
        evaluation = _evaluate_diffusion(model, puzzles, batch, sampling, clamp, seed, run, rounds, candidates)
    evaluation.decoding["seconds_per_puzzle"] = (time.perf_counter() - start) / len(puzzles)
    return evaluation


def _evaluate_diffusion(model, puzzles, batch, sampling, clamp, seed, run, rounds, candidates) -> Evaluation:
    from dgemma.engine import Engine
    from dgemma.engine.search import Search

    engine = Engine(model, max_batch=batch, max_length=MAX_LENGTH, max_queue=len(puzzles) * candidates)
    searches, trackers = [], {}
    for i, p in enumerate(puzzles):
        fixed, tokens = givens_template(p) if clamp else (None, None)
        search = Search.start(sudoku.encode_prompt(p), sampling, seed=seed + i, verifier=SudokuVerifier(p),
                              max_rounds=rounds, candidates=candidates, fixed=fixed, fixed_tokens=tokens,
                              want_drafts=True)
        for r in search.candidates:
            trackers[r.request_id] = t = SettleTracker()
            r.state.on_event = lambda e, t=t: t.add(e) if e.kind == "draft" else (t.__init__() if e.kind == "round" else None)
        searches.append(search)
    requests = [r for s in searches for r in s.candidates]
    for r in requests:
        engine.submit(r)
    (run or Engine.run_until_done)(engine, requests)

    steps = forwards_tokens = corrections = accepted_total = 0
    settle, blank_count = [0.0] * CELLS, [0] * CELLS  # summed over the puzzles where the cell is blank
    winners = [s.winner for s in searches]
    for r in winners:
        t = trackers[r.request_id]  # the drafts of the winner's last round
        steps += sum(r.steps_per_canvas)
        forwards_tokens += r.state.committed_non_pad
        changed, total = t.corrections()
        corrections += changed
        accepted_total += total
        for cell, s in enumerate(t.settle_steps()):
            if r.prompt[1 + cell] == sudoku.SudokuVocab.BLANK:
                settle[cell] += s
                blank_count[cell] += 1
    settle = [s / n if n else float("nan") for s, n in zip(settle, blank_count)]
    scores = sudoku.score(puzzles, [answer_grid(r.tokens) for r in winners])
    stats = [s.stats() for s in searches]
    decoding = {
        "rounds": rounds, "candidates": candidates,
        "forwards_per_puzzle": sum(s["forwards"] for s in stats) / len(puzzles),
        # canvas positions run through the decoder, every candidate's (fewer with the step cache)
        "decoder_positions_per_puzzle": sum(r.state.decoder_positions for r in requests) / len(puzzles),
        "mean_rounds": sum(s["rounds"] for s in stats) / len(puzzles),
        "rounds_needed": _histogram(s["rounds"] for s in stats if s["accepted"]),
        "winning_candidates": _histogram(s["candidate"] for s in stats if s["accepted"]),
        "verifier_accepted": sum(s["accepted"] for s in stats) / len(puzzles),
        "mean_denoising_steps": steps / len(puzzles),
        "tokens_per_forward": forwards_tokens / steps if steps else 0.0,
        "accepted_later_changed": corrections / accepted_total if accepted_total else 0.0,
        "mean_fix_step_of_blank_cells": [round(s, 2) for s in settle],
    }
    return Evaluation(scores, decoding, settle, [r.tokens for r in winners])


def _histogram(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in sorted(values):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def _evaluate_ar(model, puzzles, batch: int, samples: int, seed: int) -> Evaluation:
    """Greedy left to right; with samples > 1, puzzles whose answer the verifier rejects are sampled again
    (temperature 1, seeded) until one is accepted or `samples` answers were drawn."""
    from dgemma.generation import generate_ar
    from dgemma.generation.verify import candidate_seed

    answers: list[list[int]] = [[] for _ in puzzles]
    drawn = [0] * len(puzzles)
    pending = list(range(len(puzzles)))
    for k in range(samples):
        for a in range(0, len(pending), batch):
            chunk = pending[a : a + batch]
            outs = generate_ar(model, [sudoku.encode_prompt(puzzles[i]) for i in chunk], CELLS, eos_token_ids=(),
                               temperature=0.0 if k == 0 else 1.0, seed=candidate_seed(seed + a, k))
            for i, out in zip(chunk, outs):  # exactly 81 cells, as the diffusion canvas
                answers[i] = out
                drawn[i] += 1
        pending = [i for i in pending if SudokuVerifier(puzzles[i])(answers[i])]
        if not pending:
            break
    accepted = len(puzzles) - len(pending)
    decoding = {"rounds": 1, "candidates": samples, "forwards_per_puzzle": CELLS * sum(drawn) / len(puzzles),
                "samples_per_puzzle": sum(drawn) / len(puzzles), "verifier_accepted": accepted / len(puzzles)}
    return Evaluation(sudoku.score(puzzles, [answer_grid(a) for a in answers]), decoding, answers=answers)


def plot_settle(settle: list[float], num_puzzles: int, path):
    """A 9x9 heat map of the mean step at which each blank cell got fixed for good, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array(settle).reshape(9, 9)
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    im = ax.imshow(grid, cmap="viridis")
    for r in range(9):
        for c in range(9):
            ax.text(c, r, f"{grid[r, c]:.1f}", ha="center", va="center", fontsize=7, color="w")
    for k in (2.5, 5.5):
        ax.axhline(k, color="w", lw=1.5)
        ax.axvline(k, color="w", lw=1.5)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"Mean step at which a blank cell is fixed for good\n"
                 f"(accepted with its final digit; {num_puzzles} puzzles)", fontsize=10)
    fig.colorbar(im, ax=ax, label="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
