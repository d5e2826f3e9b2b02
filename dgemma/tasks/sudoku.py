"""The sudoku task, independent of any model: data sets, text I/O, tokenisation and scoring.

Grid logic (solver, generator, singles, validity, symmetry, canonical form) lives in
`sudoku_grid` (symmetries: `sudoku_symmetry`) and is re-exported here. A grid is a tuple of 81 ints, row-major, 0 = blank.

Token layout for the model (vocabulary of 16):
  prompt = [BOS] + 81 cell tokens (digit token, or BLANK for an empty cell)   -> 82 tokens
  canvas = 81 digit tokens, the full solution in reading order                 -> canvas_length 81
The canvas carries no EOS: every answer is exactly 81 cells, so a fixed-length canvas of 81 says
everything and an EOS slot would only be one more position to denoise. Generate exactly one canvas
(max_new_tokens = 81); `decode_canvas` tolerates EOS/PAD a sampler may append after it.
No row separators: with a fixed 81-position layout, row, column and box are functions of the
position, which the model reads from its rotary position encoding.

Data sets are deterministic in their seed, unique-solution, and deduplicated up to symmetry (the
exact `canonical_form`), within and across sets: no test puzzle is any symmetry of a train puzzle.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from dgemma.tasks.sudoku_grid import (
    UNIT_NAMES,
    UNITS,
    Grid,
    as_grid,
    count_givens,
    count_solutions,
    generate_minimal_puzzle,
    generate_puzzle,
    has_unique_solution,
    is_singles_solvable,
    is_valid_solution,
    propagate_singles,
    random_solution,
    rule_violations,
    solution_errors,
    solve,
)
from dgemma.tasks.sudoku_symmetry import Transform, are_equivalent, canonical_form, random_transform, transpose

__all__ = [
    "Grid", "Example", "Split", "SudokuVocab", "Transform", "BUCKETS", "BUCKET_GIVENS",
    "as_grid", "count_givens", "bucket_of", "solve", "count_solutions", "has_unique_solution",
    "is_valid_solution", "rule_violations", "solution_errors", "propagate_singles", "is_singles_solvable",
    "generate_puzzle", "generate_minimal_puzzle", "random_solution", "random_transform", "transpose", "canonical_form",
    "are_equivalent", "parse_puzzle", "read_puzzle_file", "write_examples", "format_grid",
    "grid_to_string", "encode_prompt", "encode_solution", "decode_prompt", "decode_canvas",
    "random_symmetry_ids", "wilson_interval",
    "score", "generate_examples", "make_split", "make_bucket_test_sets", "write_split",
]

# -- difficulty buckets ------------------------------------------------------------------------

BUCKETS = ("easy", "medium", "hard", "minimal")
# Givens ranges used to *generate* bucket test sets; bucket_of() is the open-ended rule.
# Random cell removal reaches 24 cheaply (~35 puzzles/s); below that `generate_minimal_puzzle` climbs,
# at 0.4-3 s a puzzle for 23-21 givens and 20 s or more for 20, so the minimal sets stop at 21.
BUCKET_GIVENS = {"easy": (40, 45), "medium": (30, 39), "hard": (24, 29), "minimal": (21, 23)}
MINIMAL_BELOW = 24  # targets below this use generate_minimal_puzzle
LOW_GIVENS = (22, 27)  # the extra training puzzles of `write_split(low_train=...)` (21 costs 3 s a puzzle)


def bucket_of(puzzle: Sequence[int] | int) -> str:
    """easy: >= 40 givens, medium: 30-39, hard: 24-29, minimal: < 24. Accepts a puzzle or a givens count."""
    givens = puzzle if isinstance(puzzle, int) else count_givens(puzzle)
    return "easy" if givens >= 40 else "medium" if givens >= 30 else "hard" if givens >= MINIMAL_BELOW else "minimal"


@dataclass(frozen=True)
class Example:
    puzzle: Grid
    solution: Grid | None = None

    @property
    def givens(self) -> int:
        return count_givens(self.puzzle)

    @property
    def bucket(self) -> str:
        return bucket_of(self.puzzle)


@dataclass(frozen=True)
class Split:
    train: list[Example]
    test: list[Example]


# -- text I/O ----------------------------------------------------------------------------------


def _unit_clash(grid: Sequence[int]) -> str | None:
    for name, unit in zip(UNIT_NAMES, UNITS):
        digits = [grid[i] for i in unit if grid[i]]
        if len(digits) != len(set(digits)):
            dupes = sorted({d for d in digits if digits.count(d) > 1})
            return f"{name} repeats {', '.join(map(str, dupes))}"
    return None


def parse_puzzle(line: str) -> Grid:
    """81 cells, digits 1-9, '0' or '.' for blanks; surrounding whitespace (CRLF included) is
    ignored. Raises ValueError with the reason, also for givens that clash with each other."""
    text = line.strip()
    if len(text) != 81:
        raise ValueError(f"expected 81 cells, got {len(text)}")
    for column, char in enumerate(text, start=1):
        if char not in "0123456789.":
            raise ValueError(f"invalid character {char!r} at position {column}")
    grid = tuple(0 if char == "." else int(char) for char in text)
    clash = _unit_clash(grid)
    if clash:
        raise ValueError(f"givens clash: {clash}")
    return grid


def read_puzzle_file(path: str | Path) -> tuple[list[Example], list[tuple[int, str]]]:
    """Read one puzzle per line, either `puzzle` or `puzzle,solution` (the solution must solve the
    puzzle). Returns the good examples and (line_number, reason) for each malformed line; bad
    lines are reported, not fatal. Blank lines and '#' comments are skipped, and so is a first
    line without any digit (a header such as Kaggle's `quizzes,solutions`)."""
    examples, errors = [], []
    with open(path, encoding="utf-8", errors="replace") as f:  # universal newlines: CRLF is fine
        for number, line in enumerate(f, start=1):
            text = line.strip()
            if not text or text.startswith("#") or (number == 1 and not any(c.isdigit() for c in text)):
                continue
            fields = text.split(",")
            if len(fields) > 2:
                errors.append((number, f"expected 'puzzle' or 'puzzle,solution', got {len(fields)} fields"))
                continue
            try:
                puzzle = parse_puzzle(fields[0])
            except ValueError as error:
                errors.append((number, f"puzzle: {error}"))
                continue
            solution = None
            if len(fields) == 2:
                try:
                    solution = parse_puzzle(fields[1])
                except ValueError as error:
                    errors.append((number, f"solution: {error}"))
                    continue
                problems = solution_errors(puzzle, solution)
                if problems:
                    errors.append((number, f"solution does not solve the puzzle: {'; '.join(problems)}"))
                    continue
            examples.append(Example(puzzle, solution))
    return examples, errors


def grid_to_string(grid: Sequence[int], blank: str = "0") -> str:
    """The 81-character form, e.g. for files (`blank='0'`) or display (`blank='.'`)."""
    return "".join(str(v) if v else blank for v in grid)


def write_examples(path: str | Path, examples: Iterable[Example]) -> None:
    """One `puzzle,solution` line per example (just `puzzle` if it has no solution)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for ex in examples:
            f.write(grid_to_string(ex.puzzle) + ("," + grid_to_string(ex.solution) if ex.solution else "") + "\n")


def format_grid(grid: Sequence[int], blank: str = "·") -> str:
    """A box-drawn 9x9 grid for the terminal (13 lines, no trailing newline)."""
    rule = "───────"
    lines = ["┌" + "┬".join([rule] * 3) + "┐"]
    for r in range(9):
        if r in (3, 6):
            lines.append("├" + "┼".join([rule] * 3) + "┤")
        stacks = [" ".join(str(v) if v else blank for v in grid[r * 9 + s * 3 : r * 9 + s * 3 + 3]) for s in range(3)]
        lines.append("│ " + " │ ".join(stacks) + " │")
    lines.append("└" + "┴".join([rule] * 3) + "┘")
    return "\n".join(lines)


# -- tokenisation ------------------------------------------------------------------------------


class SudokuVocab:
    """Token ids. PAD/EOS/BOS are fixed at 0/1/2 by DiffusionGemma's config conventions; digit d
    is id 3 + d; 13-15 are unused, padding vocab_size to 16 (a round embedding table)."""

    PAD = 0
    EOS = 1
    BOS = 2
    BLANK = 3
    DIGIT_IDS = tuple(range(4, 13))  # digits 1..9
    vocab_size = 16
    prompt_length = 82
    canvas_length = 81

    @staticmethod
    def digit_id(digit: int) -> int:
        if not 1 <= digit <= 9:
            raise ValueError(f"not a digit 1-9: {digit}")
        return 3 + digit

    @staticmethod
    def token_names() -> list[str]:
        return ["<pad>", "<eos>", "<bos>", "<blank>", *map(str, range(1, 10)), "<unused13>", "<unused14>", "<unused15>"]


def encode_prompt(puzzle: Sequence[int]) -> list[int]:
    """[BOS] + one token per cell (digit token or BLANK): 82 ids."""
    return [SudokuVocab.BOS] + [SudokuVocab.digit_id(v) if v else SudokuVocab.BLANK for v in as_grid(puzzle)]


def encode_solution(grid: Sequence[int]) -> list[int]:
    """The canvas target: 81 digit tokens. The grid must be complete."""
    grid = as_grid(grid)
    if 0 in grid:
        raise ValueError("a solution canvas needs all 81 cells filled")
    return [SudokuVocab.digit_id(v) for v in grid]


def decode_prompt(tokens: Sequence[int]) -> Grid | None:
    """The inverse of `encode_prompt`; None unless it is [BOS] + 81 cell tokens."""
    ids = [int(t) for t in tokens]
    if len(ids) != 82 or ids[0] != SudokuVocab.BOS:
        return None
    if any(t != SudokuVocab.BLANK and t not in SudokuVocab.DIGIT_IDS for t in ids[1:]):
        return None
    return tuple(0 if t == SudokuVocab.BLANK else t - 3 for t in ids[1:])


def random_symmetry_ids(prompt: Sequence[int], response: Sequence[int],
                        rng: random.Random) -> tuple[list[int], list[int]]:
    """Training augmentation on token ids: one uniformly random symmetry applied to puzzle and solution.

    A symmetry maps a unique-solution puzzle to one (with the image of the solution), and its orbit is
    what the train/test split is deduplicated by, so no draw can reproduce a held-out puzzle.
    """
    puzzle, solution = decode_prompt(prompt), decode_canvas(response)
    if puzzle is None or solution is None or 0 in solution:
        raise ValueError("not a sudoku example ([BOS] + 81 cells prompt, 81-digit answer)")
    t = random_transform(rng)
    return encode_prompt(t.apply(puzzle)), encode_solution(t.apply(solution))


def decode_canvas(tokens: Iterable[int]) -> Grid | None:
    """Tokens of one canvas -> grid. Trailing EOS/PAD are dropped; if 81 tokens do not remain,
    returns None. A cell holding anything but a digit token decodes to 0 (blank): the grid then
    fails `is_valid_solution` as incomplete but still counts in cell accuracy."""
    ids = [int(t) for t in tokens]
    while ids and ids[-1] in (SudokuVocab.EOS, SudokuVocab.PAD) and len(ids) > 81:
        ids.pop()
    if len(ids) != 81:
        return None
    return tuple(t - 3 if t in SudokuVocab.DIGIT_IDS else 0 for t in ids)


# -- scoring -----------------------------------------------------------------------------------


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (95% by default); (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def _rate(solved: int, total: int) -> dict:
    accuracy = solved / total if total else 0.0
    return {"solved": solved, "total": total, "accuracy": accuracy, "ci95": wilson_interval(solved, total)}


def score(
    puzzles: Sequence[Example | Sequence[int]],
    predictions: Sequence[Sequence[int] | None],
    solutions: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Score predicted grids (None = nothing decodable) against puzzles, without any model.

    'Solved' is checked by `is_valid_solution` alone. Cell-level figures compare with the
    reference solution: `solutions` if given, else the Example's, else the solver's (the unique
    one for a proper puzzle). Returns solved/total/accuracy/ci95 overall and per bucket, plus
    cell_accuracy (all 81 cells), blank_accuracy (cells blank in the puzzle) and givens_kept.
    """
    if len(puzzles) != len(predictions) or (solutions is not None and len(solutions) != len(puzzles)):
        raise ValueError("puzzles, predictions (and solutions) must have the same length")
    solved_by_bucket = {b: [0, 0] for b in BUCKETS}
    solved = cells_right = blanks = blanks_right = givens = givens_kept = 0
    for n, (item, prediction) in enumerate(zip(puzzles, predictions)):
        example = item if isinstance(item, Example) else Example(as_grid(item))
        puzzle = example.puzzle
        reference = solutions[n] if solutions is not None else example.solution or solve(puzzle)
        if reference is None:
            raise ValueError(f"puzzle {n} has no solution")
        ok = is_valid_solution(puzzle, prediction)
        solved += ok
        bucket = solved_by_bucket[bucket_of(puzzle)]
        bucket[0] += ok
        bucket[1] += 1
        guess = tuple(prediction) if prediction is not None and len(prediction) == 81 else (0,) * 81
        for i in range(81):
            right = guess[i] == reference[i]
            cells_right += right
            if puzzle[i]:
                givens += 1
                givens_kept += guess[i] == puzzle[i]
            else:
                blanks += 1
                blanks_right += right
    total = len(puzzles)
    return {
        **_rate(solved, total),
        "cell_accuracy": cells_right / (81 * total) if total else 0.0,
        "blank_accuracy": blanks_right / blanks if blanks else 0.0,
        "givens_kept": givens_kept / givens if givens else 0.0,
        "buckets": {b: _rate(*counts) for b, counts in solved_by_bucket.items()},
    }


# -- data sets ---------------------------------------------------------------------------------


def _canonical_key(puzzle: Sequence[int]) -> bytes:
    return bytes(canonical_form(puzzle))


def _candidate(job: tuple[int, str, int, int, int]) -> tuple[Grid, Grid, bytes]:
    """Puzzle `index` of a stream, its solution and canonical key: a pure function of the job."""
    seed, stream, index, low, high = job
    rng = random.Random(f"dgemma-sudoku:{seed}:{stream}:{index}")  # str seeds hash stably
    givens = rng.randint(low, high)
    make = generate_puzzle if givens >= MINIMAL_BELOW else generate_minimal_puzzle
    puzzle, solution = make(rng, givens)
    return puzzle, solution, _canonical_key(puzzle)


def _unique_examples(n: int, givens: tuple[int, int], seed: int, stream: str, seen: set[bytes],
                     workers: int = 1) -> list[Example]:
    """`n` puzzles from one seeded stream, skipping any equivalent (under symmetry) to a key in
    `seen`, which collects the keys of those taken. Puzzle i of a stream depends only on
    (seed, stream, i), so a longer request extends a shorter one and streams never interact.
    `workers` > 1 generates candidates in that many processes; they are taken in index order, so the
    result is the same as with one."""
    low, high = givens
    if not 17 <= low <= high <= 81:
        raise ValueError(f"bad givens range {givens}")
    examples: list[Example] = []
    index = 0
    pool = None
    if workers > 1 and n > 0:
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers)
    try:
        while len(examples) < n:
            block = min(n - len(examples), 64 if pool is None else 8 * workers)
            jobs = [(seed, stream, index + k, low, high) for k in range(block)]
            index += block
            for puzzle, solution, key in (map if pool is None else pool.map)(_candidate, jobs):
                if key not in seen and len(examples) < n:
                    seen.add(key)
                    examples.append(Example(puzzle, solution))
    finally:
        if pool is not None:
            pool.shutdown()
    return examples


def generate_examples(n: int, givens: tuple[int, int] = (28, 45), seed: int = 0) -> list[Example]:
    """`n` unique-solution puzzles, pairwise inequivalent under symmetry, givens uniform in range."""
    return _unique_examples(n, givens, seed, "examples", set())


def _make_split(n_train, n_test, seed, train_givens, test_givens) -> tuple[Split, set[bytes]]:
    seen: set[bytes] = set()
    # The test set comes first, so it does not change when the train set grows.
    test = _unique_examples(n_test, test_givens, seed, "test", seen)
    train = _unique_examples(n_train, train_givens, seed, "train", seen)
    return Split(train, test), seen


def make_split(
    n_train: int,
    n_test: int,
    seed: int = 0,
    train_givens: tuple[int, int] = (28, 45),
    test_givens: tuple[int, int] = (28, 45),
) -> Split:
    """Deterministic train/test puzzles; no two puzzles in either set, or across them, are
    related by any symmetry (checked with the exact canonical form, ~1 ms per puzzle)."""
    return _make_split(n_train, n_test, seed, train_givens, test_givens)[0]


def _bucket_sets(per_bucket: int | dict, seed: int, seen: set[bytes], buckets: dict,
                 stream: str = "bucket", workers: int = 1) -> dict[str, list[Example]]:
    """One set per bucket, in the buckets' order; `per_bucket` is a count or {bucket: count}."""
    sizes = per_bucket if isinstance(per_bucket, dict) else dict.fromkeys(buckets, per_bucket)
    return {name: _unique_examples(sizes.get(name, 0), tuple(r), seed, f"{stream}-{name}", seen, workers)
            for name, r in buckets.items()}


def make_bucket_test_sets(
    per_bucket: int | dict = 300, seed: int = 0, exclude: Iterable[Example | Sequence[int]] = (),
    buckets: dict | None = None, workers: int = 1,
) -> dict[str, list[Example]]:
    """One test set per difficulty bucket (givens ranges in BUCKET_GIVENS by default), disjoint
    up to symmetry from each other and from `exclude` (e.g. a training set)."""
    seen = {_canonical_key(e.puzzle if isinstance(e, Example) else e) for e in exclude}
    return _bucket_sets(per_bucket, seed, seen, buckets or BUCKET_GIVENS, workers=workers)


def write_split(
    directory: str | Path,
    n_train: int,
    n_test: int,
    seed: int = 0,
    train_givens: tuple[int, int] = (28, 45),
    test_givens: tuple[int, int] = (28, 45),
    per_bucket: int | dict = 0,
    buckets: dict | None = None,
    validation_per_bucket: int | dict = 0,
    low_train: int = 0,
    low_givens: tuple[int, int] = LOW_GIVENS,
    workers: int = 1,
) -> dict[str, Path]:
    """Write train.txt and test.txt (the same sets `make_split` returns for these arguments),
    test_<bucket>.txt when `per_bucket` > 0 (the sets `make_bucket_test_sets` returns with
    exclude = train + test), val_<bucket>.txt when `validation_per_bucket` > 0 (for choosing decoding
    settings without looking at the test sets; disjoint from all of the above, and drawn after them, so
    adding them changes no other file), train_low.txt when `low_train` > 0 (more training puzzles with
    `low_givens` givens, drawn last and disjoint from all of the above), and split.json describing it all.
    `per_bucket` and `validation_per_bucket` are a count for every bucket or {bucket: count}; the buckets
    are drawn in order (easy, medium, hard, minimal), so a bucket added at the end changes no earlier
    set. `workers` > 1 generates in that many processes, with the same result. Returns name -> path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buckets = buckets or BUCKET_GIVENS
    seen: set[bytes] = set()
    # The test set comes first, so it does not change when the train set grows.
    sets = {"test": _unique_examples(n_test, test_givens, seed, "test", seen, workers),
            "train": _unique_examples(n_train, train_givens, seed, "train", seen, workers)}
    if per_bucket:
        for name, examples in _bucket_sets(per_bucket, seed, seen, buckets, workers=workers).items():
            sets[f"test_{name}"] = examples
    if validation_per_bucket:
        for name, examples in _bucket_sets(validation_per_bucket, seed, seen, buckets, stream="validation",
                                           workers=workers).items():
            sets[f"val_{name}"] = examples
    if low_train:
        sets["train_low"] = _unique_examples(low_train, low_givens, seed, "train-low", seen, workers)
    paths = {}
    for name, examples in sets.items():
        paths[name] = directory / f"{name}.txt"
        write_examples(paths[name], examples)
    manifest = {
        "format": "one 'puzzle,solution' per line, 81 chars each, row-major, 0 = blank",
        "seed": seed,
        "train_givens": list(train_givens),
        "test_givens": list(test_givens),
        "bucket_givens": {k: list(v) for k, v in buckets.items()} if per_bucket else {},
        "low_givens": list(low_givens) if low_train else [],
        "counts": {name: len(examples) for name, examples in sets.items()},
        "disjoint_up_to_symmetry": True,
    }
    paths["manifest"] = directory / "split.json"
    paths["manifest"].write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return paths
