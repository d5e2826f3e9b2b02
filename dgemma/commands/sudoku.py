"""`dgemma sudoku prepare | solve | eval`: the flagship task on the model shipped in the repo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dgemma.commands._common import (
    UsageError,
    add_compile_arguments,
    add_denoising_arguments,
    add_int8_compute_argument,
    add_revision_argument,
    apply_int8_compute,
    sampling_with_overrides,
    maybe_compile,
    plot_file,
    decoder_positions_text,
    refuse_sampler_flags_with_ar,
)
from dgemma.tasks.sudoku_models import SHIPPED, SHIPPED_AR

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
    prep.add_argument("--minimal", type=int, default=None, metavar="N",
                      help="test puzzles of the minimal bucket, 21-23 givens, which cost about 1.5 s each "
                           "(default: --per-bucket)")
    prep.add_argument("--minimal-validation", type=int, default=None, metavar="N",
                      help="validation puzzles of the minimal bucket (default: --minimal, at most --validation)")
    prep.add_argument("--low-train", type=int, default=0, metavar="N",
                      help="also N training puzzles with 22-27 givens (train_low.txt), drawn after the held-out sets")
    prep.add_argument("--low-augment", type=int, default=None, metavar="K",
                      help="symmetry-transformed copies per low-givens puzzle in train.jsonl (default: --augment)")
    prep.add_argument("--workers", type=int, default=1, help="generating processes (same files for any number)")
    prep.add_argument("--seed", type=int, default=0)
    prep.set_defaults(_action=_prepare)

    solve = sub.add_parser("solve", help="solve one puzzle, showing the grid as it denoises")
    solve.add_argument("puzzle", nargs="?", default=SAMPLE_PUZZLE,
                       help="81 characters, digits with 0 or . for blanks (default: a sample puzzle)")
    _model_arguments(solve, compile_by_default="warm")
    solve.add_argument("--no-live", action="store_true", help="print only the result")
    solve.set_defaults(_action=_solve)

    ev = sub.add_parser("eval", help="solve every puzzle of a file; per-bucket accuracy, JSON last")
    ev.add_argument("--file", required=True, help="one puzzle per line (81 chars, 0 or . blank; ',solution' ignored)")
    _model_arguments(ev, compile_by_default="warm")  # a cold compile took 570 s of an 8-puzzle eval
    ev.add_argument("--batch", type=int, default=32, help="puzzles denoised together (default 32)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N puzzles")
    ev.add_argument("--plot", type=plot_file, default=None, help="write a PNG of the order in which cells get fixed")
    ev.set_defaults(_action=_eval)


def _model_arguments(p, *, compile_by_default: bool | str):
    p.add_argument("--model", default=None,
                   help=f"model folder or Hugging Face id (default: the shipped model, {SHIPPED.name}; with "
                        f"--ar the shipped AR baseline, {SHIPPED_AR.name})")
    add_revision_argument(p)
    p.add_argument("--ar", action="store_true",
                   help="decode left to right (greedy; with --rounds/--candidates, best of rounds x candidates "
                        "samples checked by the rules)")
    p.add_argument("--rounds", type=int, default=1,
                   help="verifier rounds: cells that break a rule are denoised again, the rest kept (default 1)")
    p.add_argument("--candidates", type=int, default=1,
                   help="seeds searched side by side; the first answer the rules accept wins (default 1)")
    p.add_argument("--clamp", action="store_true", help="fix the givens through the canvas template")
    add_denoising_arguments(p.add_argument_group("sampling (defaults from the model's generation_config.json)"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    add_int8_compute_argument(p)
    add_compile_arguments(p, by_default=compile_by_default)


def run(args):
    return args._action(args)


# -- prepare ---------------------------------------------------------------------------------------
def _prepare(args):
    from dgemma.tasks.sudoku_prepare import prepare, set_sizes

    counts = (args.augment, args.per_bucket, args.validation, args.low_train,
              args.augment if args.low_augment is None else args.low_augment, args.minimal or 0,
              args.minimal_validation or 0)
    if args.train < 1 or min(counts) < 0 or args.workers < 1:
        raise UsageError("--train and --workers must be >= 1; --augment, --per-bucket, --validation, --minimal, "
                         "--low-train and --low-augment >= 0")
    sizes = set_sizes(args.per_bucket, args.validation, args.minimal, args.minimal_validation)
    print(f"generating {args.train} training puzzles (+{args.low_train} with 22-27 givens), test and validation "
          f"sets per bucket ({sizes['test']}, {sizes['validation']}) ...", file=sys.stderr)
    paths, written = prepare(args.out, train=args.train, augment=args.augment, sizes=sizes, low_train=args.low_train,
                             low_augment=args.low_augment, workers=args.workers, seed=args.seed)
    print(json.dumps({**written, **{k: str(v) for k, v in paths.items()}}))
    return 0


# -- solving with a model ----------------------------------------------------------------------------
def _load(args):
    from dgemma import devices
    from dgemma.compilation.policy import engine_shape
    from dgemma.weights.checkpoint import model_shape
    from dgemma.weights.hub import load_model

    if args.rounds < 1 or args.candidates < 1:
        raise UsageError("--rounds and --candidates must be >= 1")
    refuse_sampler_flags_with_ar(args)
    folder = Path(args.model) if args.model else (SHIPPED_AR if args.ar else SHIPPED)
    if not (folder / "config.json").is_file():
        raise UsageError(f"no sudoku model at {folder}" + ("" if args.model else
                         " (the shipped model is missing from this checkout; train one with scripts/train_sudoku.sh)"))
    width, quantize = model_shape(str(folder), args.quantize)  # the shipped models: 128 wide, so fp32
    args.dtype_choice = devices.default_dtype("cpu", width, quantize=quantize)
    model = load_model(folder, dtype=args.dtype_choice.dtype, quantize=args.quantize)
    if model.config.canvas_length != 81 or model.config.vocab_size != 16:
        raise UsageError(f"{folder} is not a sudoku model (canvas {model.config.canvas_length}, "
                         f"vocab {model.config.vocab_size}; expected 81 and 16)")
    # the engine's shape: solve runs --candidates rows, eval --batch (dgemma.tasks.sudoku_eval)
    from dgemma.tasks.sudoku_eval import MAX_LENGTH

    batch = args.batch if hasattr(args, "batch") else args.candidates
    return maybe_compile(args, apply_int8_compute(args, model), shape=engine_shape(batch, MAX_LENGTH))


def _sampling(model, args):
    from dgemma.tasks.sudoku_eval import sudoku_sampling

    return sampling_with_overrides(sudoku_sampling(model, args.seed), args)


def _solve(args):
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from dgemma.engine import Engine
    from dgemma.engine.search import Search
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import MAX_LENGTH, SudokuVerifier, answer_grid, givens_template

    try:
        puzzle = sudoku.parse_puzzle(args.puzzle)
    except ValueError as e:
        raise UsageError(f"bad puzzle: {e}") from None
    model = _load(args)
    console = Console()
    if args.ar:
        return _solve_ar(model, puzzle, args, console)
    sampling = _sampling(model, args)
    fixed, tokens = givens_template(puzzle) if args.clamp else (None, None)
    live = None if args.no_live else Live(console=console, refresh_per_second=15, transient=True)
    search = Search.start(sudoku.encode_prompt(puzzle), sampling, seed=args.seed, verifier=SudokuVerifier(puzzle),
                          max_rounds=args.rounds, candidates=args.candidates, fixed=fixed, fixed_tokens=tokens,
                          want_drafts=live is not None)

    def on_event(event, candidate):
        if event.kind == "draft" and live is not None and candidate == 0:  # the display follows candidate 0
            grid = sudoku.decode_canvas(event.tokens) or (0,) * 81
            text = Text(f"round {search.candidates[0].state.round}, step {event.step + 1}\n", style="bold")
            text.append(_grid_text(puzzle, grid, event.accepted))
            live.update(text)
        elif event.kind == "round":
            who = f"candidate {candidate}: " if len(search.candidates) > 1 else ""
            console.print(f"{who}round {event.step - 1}: {len(event.tokens)} cells rejected by the rules, "
                          f"denoised again in round {event.step} ({81 - len(event.tokens)} kept)")

    for r in search.candidates:
        r.state.on_event = lambda e, j=r.candidate: on_event(e, j)
    engine = Engine(model, max_batch=len(search.candidates), max_length=MAX_LENGTH)
    for r in search.candidates:
        engine.submit(r)
    if live is not None:
        with live:
            engine.run_until_done(search.candidates)
    else:
        engine.run_until_done(search.candidates)
    request, found = search.winner, search.stats()
    grid = answer_grid(request.tokens)
    console.print(sudoku.format_grid(grid))
    stats = request.stats()
    saved = f", {decoder_positions_text(stats)} with the step cache" if sampling.step_cache else ""
    console.print(f"{stats['denoising_steps']} denoising steps, {stats['tokens_per_forward']:.1f} cells per forward"
                  f"{saved}, {stats['elapsed_s']:.2f} s")
    if args.rounds > 1 or args.candidates > 1:
        console.print(f"search: {'accepted' if found['accepted'] else 'not accepted'} in round {found['rounds']}"
                      + (f" of candidate {found['candidate']}" if args.candidates > 1 else "")
                      + f", {found['forwards']} decoder forwards in all")
    return _verdict(console, puzzle, grid)


def _solve_ar(model, puzzle, args, console):
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import answer_grid, evaluate

    evaluation = evaluate(model, [puzzle], batch=1, seed=args.seed, rounds=args.rounds, candidates=args.candidates)
    console.print(sudoku.format_grid(answer_grid(evaluation.answers[0])))
    d = evaluation.decoding
    console.print(f"left to right: {d['samples_per_puzzle']:.0f} sample(s), {d['forwards_per_puzzle']:.0f} forwards, "
                  f"{d['seconds_per_puzzle']:.2f} s")
    return _verdict(console, puzzle, answer_grid(evaluation.answers[0]))


def _verdict(console, puzzle, grid) -> int:
    from dgemma.tasks import sudoku

    errors = sudoku.solution_errors(puzzle, grid)
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

    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import evaluate, plot_settle

    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if args.batch < 1:
        raise UsageError("--batch must be >= 1")
    examples, bad = sudoku.read_puzzle_file(path)
    for line_number, reason in bad:
        print(f"{path}:{line_number}: skipped: {reason}", file=sys.stderr)
    if args.limit is not None:
        examples = examples[: args.limit]
    if not examples:
        raise UsageError(f"{path}: no valid puzzle")
    model = _load(args)
    puzzles = [e.puzzle for e in examples]
    start = time.perf_counter()
    evaluation = evaluate(model, puzzles, batch=args.batch, sampling=None if args.ar else _sampling(model, args),
                          clamp=args.clamp, seed=args.seed, run=_run_with_progress, rounds=args.rounds,
                          candidates=args.candidates)
    result = {
        **evaluation.scores,
        "model": str(args.model or (SHIPPED_AR if args.ar else SHIPPED)),
        "mode": "ar" if args.ar else ("diffusion-clamped" if args.clamp else "diffusion"),
        "elapsed_s": round(time.perf_counter() - start, 2), "skipped_lines": len(bad),
        **evaluation.decoding,
    }
    if evaluation.settle is not None and args.plot:
        plot_settle(evaluation.settle, len(puzzles), args.plot)
    _print_table(result)
    print(json.dumps(result))
    return 0


def _print_table(result: dict):
    print(f"{'bucket':<8}{'solved':>8}{'total':>8}{'accuracy':>10}   95% Wilson")
    for name, b in result["buckets"].items():
        lo, hi = b["ci95"]
        print(f"{name:<8}{b['solved']:>8}{b['total']:>8}{b['accuracy']:>10.3f}   [{lo:.3f}, {hi:.3f}]")
    lo, hi = result["ci95"]
    print(f"{'all':<8}{result['solved']:>8}{result['total']:>8}{result['accuracy']:>10.3f}   [{lo:.3f}, {hi:.3f}]")
    print(f"cell accuracy {result['cell_accuracy']:.3f}, blank-cell accuracy {result['blank_accuracy']:.3f}, "
          f"givens kept {result['givens_kept']:.3f}")
    print(f"{result['forwards_per_puzzle']:.1f} forwards and {result['seconds_per_puzzle']:.3f} s per puzzle, "
          f"{100 * result['verifier_accepted']:.1f}% accepted by the rules checker"
          + (f", {result['mean_rounds']:.2f} rounds on average" if "mean_rounds" in result else ""))
    if "mean_denoising_steps" in result:
        print(f"{result['mean_denoising_steps']:.1f} denoising steps per puzzle, {result['tokens_per_forward']:.1f} "
              f"cells per forward, {100 * result['accepted_later_changed']:.1f}% of accepted cells later changed, "
              f"{result['decoder_positions_per_puzzle']:.0f} decoder positions per puzzle")


def _run_with_progress(engine, requests):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("solving", total=len(requests))
        while not all(r.done for r in requests):
            engine.step()
            bar.update(task, completed=sum(r.done for r in requests))
