"""`dgemma sudoku prepare | solve | eval`: the flagship task on the model shipped in the repo."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from dgemma.commands._common import add_denoising_arguments, add_revision_argument, denoising_overrides

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "sudoku"
# An easy puzzle (43 givens) generated for the demo with its own seed (2026), not one of the held-out
# test or validation puzzles.
SAMPLE_PUZZLE = "308150070907342000512086930070600420605408009024070563701060090003200050296000000"


def add_arguments(p):
    sub = p.add_subparsers(dest="sudoku_command", metavar="ACTION", required=True)

    prep = sub.add_parser("prepare", help="write a training set (JSONL, augmented) and per-bucket test sets")
    prep.add_argument("--out", required=True, help="folder for train.jsonl, train.txt and test_<bucket>.txt")
    prep.add_argument("--train", type=int, default=20000, help="distinct training puzzles (default 20000)")
    prep.add_argument("--augment", type=int, default=4, help="symmetry-transformed copies per puzzle (default 4)")
    prep.add_argument("--per-bucket", type=int, default=300, help="test puzzles per difficulty bucket")
    prep.add_argument("--validation", type=int, default=0,
                      help="also write val_<bucket>.txt with this many puzzles per bucket, for tuning decoding")
    prep.add_argument("--seed", type=int, default=0)
    prep.set_defaults(_action=_prepare)

    solve = sub.add_parser("solve", help="solve one puzzle, showing the grid as it denoises")
    solve.add_argument("puzzle", nargs="?", default=SAMPLE_PUZZLE,
                       help="81 characters, digits with 0 or . for blanks (default: a sample puzzle)")
    _model_arguments(solve)
    solve.add_argument("--no-live", action="store_true", help="print only the result")
    solve.set_defaults(_action=_solve)

    ev = sub.add_parser("eval", help="solve every puzzle of a file; per-bucket accuracy, JSON last")
    ev.add_argument("--file", required=True, help="one puzzle per line (81 chars, 0 or . blank; ',solution' ignored)")
    _model_arguments(ev)
    ev.add_argument("--ar", action="store_true", help="decode with the AR baseline (left to right)")
    ev.add_argument("--batch", type=int, default=32, help="puzzles denoised together (default 32)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N puzzles")
    ev.add_argument("--plot", default=None, help="write a PNG of the order in which cells get fixed")
    ev.set_defaults(_action=_eval)


def _model_arguments(p):
    p.add_argument("--model", default=None,
                   help=f"model folder or Hugging Face id (default: the shipped model, {SHIPPED.name})")
    add_revision_argument(p)
    p.add_argument("--clamp", action="store_true", help="fix the givens through the canvas template")
    add_denoising_arguments(p.add_argument_group("sampling (defaults from the model's generation_config.json)"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)


def run(args):
    return args._action(args)


# -- prepare ---------------------------------------------------------------------------------------
def _prepare(args):
    from dgemma.cli import UsageError
    from dgemma.tasks import sudoku as S
    from dgemma.tasks.sudoku_grid import random_transform

    if args.train < 1 or args.augment < 0 or args.per_bucket < 0 or args.validation < 0:
        raise UsageError("--train must be >= 1; --augment, --per-bucket and --validation >= 0")
    out = Path(args.out)
    print(f"generating {args.train} training puzzles, {args.per_bucket} per bucket for testing and "
          f"{args.validation} per bucket for validation ...", file=sys.stderr)
    paths = S.write_split(out, n_train=args.train, n_test=0, seed=args.seed, per_bucket=args.per_bucket,
                          validation_per_bucket=args.validation)
    train, _ = S.read_puzzle_file(paths["train"])
    rng = random.Random(args.seed)
    lines = 0
    with open(out / "train.jsonl.tmp", "w") as f:
        for ex in train:
            variants = [(ex.puzzle, ex.solution)]
            for _ in range(args.augment):  # the same transform on puzzle and solution keeps them a pair
                t = random_transform(rng)
                variants.append((t.apply(ex.puzzle), t.apply(ex.solution)))
            for puzzle, solution in variants:
                f.write(json.dumps({"prompt_ids": S.encode_prompt(puzzle),
                                    "response_ids": S.encode_solution(solution)}) + "\n")
                lines += 1
    (out / "train.jsonl.tmp").rename(out / "train.jsonl")
    print(json.dumps({"train_puzzles": len(train), "train_lines": lines,
                      **{k: str(v) for k, v in paths.items()}}))
    return 0


# -- solving with a model ----------------------------------------------------------------------------
def _load(args):
    import torch

    from dgemma.cli import UsageError
    from dgemma.model import load_model

    folder = Path(args.model) if args.model else SHIPPED
    if not (folder / "config.json").is_file():
        raise UsageError(f"no sudoku model at {folder}" + ("" if args.model else
                         " (the shipped model is missing from this checkout; train one with scripts/train_sudoku.sh)"))
    model = load_model(folder, dtype=torch.float32, quantize=args.quantize)
    if model.config.canvas_length != 81 or model.config.vocab_size != 16:
        raise UsageError(f"{folder} is not a sudoku model (canvas {model.config.canvas_length}, "
                         f"vocab {model.config.vocab_size}; expected 81 and 16)")
    return model


def _sampling(model, args):
    from dgemma.tasks.sudoku import SudokuVocab

    # One canvas is the whole answer, so no EOS ends it early: a cell the model fills with a non-digit
    # token is simply a wrong cell (and the givens of a clamped run stay in place).
    return model.sampling_config.replace(max_new_tokens=81, seed=args.seed, eos_token_ids=(),
                                         pad_token_id=SudokuVocab.PAD, **denoising_overrides(args))


def _template(puzzle):
    """Givens fixed through the canvas template: (fixed (81,) bool, tokens (81,) long)."""
    import torch

    from dgemma.tasks.sudoku import encode_solution

    filled = [v if v else 1 for v in puzzle]  # blanks get a placeholder that the mask ignores
    return torch.tensor([v != 0 for v in puzzle]), torch.tensor(encode_solution(filled))


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
        for cell in range(81):
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
            for cell in range(81):
                if accepted[cell]:
                    total += 1
                    changed += tokens[cell] != final[cell]
        return changed, total


def _solve(args):
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from dgemma.cli import UsageError
    from dgemma.engine import Engine, Request
    from dgemma.tasks import sudoku as S

    try:
        puzzle = S.parse_puzzle(args.puzzle)
    except ValueError as e:
        raise UsageError(f"bad puzzle: {e}") from None
    model = _load(args)
    sampling = _sampling(model, args)
    fixed, tokens = _template(puzzle) if args.clamp else (None, None)
    console = Console()
    live = None if args.no_live else Live(console=console, refresh_per_second=15, transient=True)

    def on_event(event):
        if event.kind == "draft" and live is not None:
            grid = S.decode_canvas(event.tokens) or (0,) * 81
            text = Text(f"step {event.step + 1}\n", style="bold")
            text.append(_grid_text(puzzle, grid, event.accepted))
            live.update(text)

    request = Request(prompt=S.encode_prompt(puzzle), sampling=sampling, seed=args.seed, fixed=fixed,
                      fixed_tokens=tokens, want_drafts=live is not None, on_event=on_event)
    engine = Engine(model, max_batch=1, max_length=82 + 81)
    engine.submit(request)
    if live is not None:
        with live:
            engine.run_until_done([request])
    else:
        engine.run_until_done([request])
    grid = S.decode_canvas(request.tokens + [S.SudokuVocab.PAD] * (81 - len(request.tokens)))
    errors = S.solution_errors(puzzle, grid)
    console.print(S.format_grid(grid))
    stats = request.stats()
    console.print(f"{stats['denoising_steps']} denoising steps, {stats['tokens_per_forward']:.1f} cells per forward, "
                  f"{stats['elapsed_s']:.2f} s")
    if errors:
        console.print(f"[bold red]INVALID[/]: {'; '.join(errors[:3])}")
        return 1
    console.print("[bold green]solved[/]: every row, column and box holds 1-9 and the givens are kept")
    return 0


def _grid_text(puzzle, grid, accepted):
    from rich.text import Text

    text = Text()
    for r in range(9):
        if r in (3, 6):
            text.append("------+-------+------\n", style="dim")
        for c in range(9):
            if c in (3, 6):
                text.append("| ", style="dim")
            i = 9 * r + c
            value = str(grid[i]) if grid[i] else "·"
            style = "bold" if puzzle[i] else ("green" if accepted[i] else "yellow")
            text.append(value + " ", style=style)
        text.append("\n")
    return text


def _eval(args):
    import time

    from dgemma.cli import UsageError
    from dgemma.engine import Engine, Request
    from dgemma.tasks import sudoku as S

    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if args.batch < 1:
        raise UsageError("--batch must be >= 1")
    examples, bad = S.read_puzzle_file(path)
    for line_number, reason in bad:
        print(f"{path}:{line_number}: skipped: {reason}", file=sys.stderr)
    if args.limit is not None:
        examples = examples[: args.limit]
    if not examples:
        raise UsageError(f"{path}: no valid puzzle")
    model = _load(args)
    puzzles = [e.puzzle for e in examples]
    start = time.perf_counter()
    steps = forwards_tokens = corrections = accepted_total = 0
    settle, blank_count = [0.0] * 81, [0] * 81  # summed over the puzzles where the cell is blank
    if args.ar:
        from dgemma.ar import generate_ar

        canvases = []
        for i in range(0, len(puzzles), args.batch):
            chunk = puzzles[i : i + args.batch]
            canvases += generate_ar(model, [S.encode_prompt(p) for p in chunk], 81,
                                    eos_token_ids=())  # exactly 81 cells, as the diffusion canvas
    else:
        sampling = _sampling(model, args)
        engine = Engine(model, max_batch=args.batch, max_length=82 + 81, max_queue=len(puzzles))
        trackers = [SettleTracker() for _ in puzzles]
        requests = []
        for i, p in enumerate(puzzles):
            fixed, tokens = _template(p) if args.clamp else (None, None)
            requests.append(Request(prompt=S.encode_prompt(p), sampling=sampling, seed=args.seed + i, fixed=fixed,
                                    fixed_tokens=tokens, want_drafts=True,
                                    on_event=lambda e, t=trackers[i]: t.add(e) if e.kind == "draft" else None))
        for r in requests:
            engine.submit(r)
        _run_with_progress(engine, requests)
        canvases = [r.tokens for r in requests]
        for r, t in zip(requests, trackers):
            steps += sum(r.steps_per_canvas)
            forwards_tokens += r.committed_non_pad
            changed, total = t.corrections()
            corrections += changed
            accepted_total += total
            for cell, s in enumerate(t.settle_steps()):
                if r.prompt[1 + cell] == S.SudokuVocab.BLANK:
                    settle[cell] += s
                    blank_count[cell] += 1
        settle = [s / n if n else float("nan") for s, n in zip(settle, blank_count)]
    elapsed = time.perf_counter() - start
    grids = [S.decode_canvas(list(c) + [S.SudokuVocab.PAD] * (81 - len(c))) for c in canvases]
    result = S.score(puzzles, grids)
    result.update({
        "model": str(args.model or SHIPPED), "mode": "ar" if args.ar else ("diffusion-clamped" if args.clamp else "diffusion"),
        "elapsed_s": round(elapsed, 2), "skipped_lines": len(bad),
    })
    if not args.ar:
        result.update({
            "mean_denoising_steps": steps / len(puzzles),
            "tokens_per_forward": forwards_tokens / steps if steps else 0.0,
            "accepted_later_changed": corrections / accepted_total if accepted_total else 0.0,
            "mean_fix_step_of_blank_cells": [round(s, 2) for s in settle],
        })
        if args.plot:
            _plot_settle(settle, puzzles, args.plot)
    print(f"{'bucket':<8}{'solved':>8}{'total':>8}{'accuracy':>10}   95% Wilson")
    for name, b in result["buckets"].items():
        lo, hi = b["ci95"]
        print(f"{name:<8}{b['solved']:>8}{b['total']:>8}{b['accuracy']:>10.3f}   [{lo:.3f}, {hi:.3f}]")
    lo, hi = result["ci95"]
    print(f"{'all':<8}{result['solved']:>8}{result['total']:>8}{result['accuracy']:>10.3f}   [{lo:.3f}, {hi:.3f}]")
    print(f"cell accuracy {result['cell_accuracy']:.3f}, blank-cell accuracy {result['blank_accuracy']:.3f}, "
          f"givens kept {result['givens_kept']:.3f}")
    if not args.ar:
        print(f"{result['mean_denoising_steps']:.1f} denoising steps per puzzle, {result['tokens_per_forward']:.1f} "
              f"cells per forward, {100 * result['accepted_later_changed']:.1f}% of accepted cells later changed")
    print(json.dumps(result))
    return 0


def _run_with_progress(engine, requests):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("solving", total=len(requests))
        while not all(r.done for r in requests):
            engine.step()
            bar.update(task, completed=sum(r.done for r in requests))


def _plot_settle(settle, puzzles, path):
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
                 f"(accepted with its final digit; {len(puzzles)} puzzles)", fontsize=10)
    fig.colorbar(im, ax=ax, label="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
