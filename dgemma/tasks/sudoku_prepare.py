"""The sudoku model's training folder, as `dgemma sudoku prepare` writes it: the training puzzles and the
held-out test and validation sets per difficulty bucket (`sudoku.write_split`), and train.jsonl, the training
examples as token ids ({"prompt_ids", "response_ids"} a line), each puzzle followed by symmetry-transformed
copies of it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dgemma.tasks import sudoku
from dgemma.tasks.sudoku_symmetry import random_transform


def set_sizes(per_bucket: int, validation: int, minimal: int | None = None,
              minimal_validation: int | None = None) -> dict:
    """Puzzles per bucket of the test and the validation sets ({"test": {bucket: n}, "validation": ...}, 0 for a
    set with none). The minimal bucket (21-23 givens) has its own counts, as its puzzles cost about 100x more to
    make: `minimal` test puzzles (default `per_bucket`) and `minimal_validation` validation ones (default
    `minimal`; at most `validation`)."""
    minimal_test = per_bucket if minimal is None else minimal
    minimal_val = min(validation, minimal_test if minimal_validation is None else minimal_validation)
    sizes = {"test": {**dict.fromkeys(sudoku.BUCKETS, per_bucket), "minimal": minimal_test},
             "validation": {**dict.fromkeys(sudoku.BUCKETS, validation), "minimal": minimal_val}}
    return {k: v if any(v.values()) else 0 for k, v in sizes.items()}


def prepare(out: str | Path, *, train: int, augment: int, sizes: dict, low_train: int = 0,
            low_augment: int | None = None, workers: int = 1, seed: int = 0) -> tuple[dict[str, Path], dict]:
    """Write the folder `out`: `train` training puzzles (+ `low_train` with 22-27 givens), the sets of `sizes`
    (`set_sizes`), and train.jsonl with `augment` transformed copies of each training puzzle (`low_augment` of
    each low-givens one; default `augment`). The same files for any number of `workers`; train.jsonl appears
    whole or not at all. Returns (name -> path of what `write_split` wrote, the counts written)."""
    out = Path(out)
    low_augment = augment if low_augment is None else low_augment
    paths = sudoku.write_split(out, n_train=train, n_test=0, seed=seed, per_bucket=sizes["test"],
                               validation_per_bucket=sizes["validation"], low_train=low_train, workers=workers)
    puzzles, _ = sudoku.read_puzzle_file(paths["train"])
    low, _ = sudoku.read_puzzle_file(paths["train_low"]) if "train_low" in paths else ([], [])
    rng = random.Random(seed)
    lines = 0
    with open(out / "train.jsonl.tmp", "w") as f:
        for ex, copies in [(ex, augment) for ex in puzzles] + [(ex, low_augment) for ex in low]:
            variants = [(ex.puzzle, ex.solution)]
            for _ in range(copies):  # the same transform on puzzle and solution keeps them a pair
                t = random_transform(rng)
                variants.append((t.apply(ex.puzzle), t.apply(ex.solution)))
            for puzzle, solution in variants:
                f.write(json.dumps({"prompt_ids": sudoku.encode_prompt(puzzle),
                                    "response_ids": sudoku.encode_solution(solution)}) + "\n")
                lines += 1
    (out / "train.jsonl.tmp").rename(out / "train.jsonl")
    return paths, {"train_puzzles": len(puzzles), "low_train_puzzles": len(low), "train_lines": lines}
