"""Pure 9x9 sudoku logic, independent of any model: solving, uniqueness, generation, singles and
validity (symmetries and the canonical form: `sudoku_symmetry`).

A grid is a tuple of 81 ints in reading order (row-major); 0 marks a blank. Puzzles and
solutions use the same type, all plain Python.

Candidate sets are 9-bit masks: bit d-1 set means digit d is still possible.
"""

from __future__ import annotations

import random
from typing import Sequence

Grid = tuple[int, ...]

ALL_DIGITS = 0x1FF
ROW_OF = tuple(i // 9 for i in range(81))
COL_OF = tuple(i % 9 for i in range(81))
BOX_OF = tuple((i // 27) * 3 + (i % 9) // 3 for i in range(81))
UNITS = (
    tuple(tuple(r * 9 + c for c in range(9)) for r in range(9))
    + tuple(tuple(r * 9 + c for r in range(9)) for c in range(9))
    + tuple(tuple(i for i in range(81) if BOX_OF[i] == b) for b in range(9))
)
UNIT_NAMES = tuple(f"row {k + 1}" for k in range(9)) + tuple(f"column {k + 1}" for k in range(9)) + tuple(
    f"box {k + 1}" for k in range(9)
)
POPCOUNT = tuple(bin(m).count("1") for m in range(512))
DIGIT_OF_BIT = {1 << (d - 1): d for d in range(1, 10)}
MIN_GIVENS = 17  # no 9x9 puzzle with fewer givens has a unique solution (McGuire et al., 2012)


def as_grid(cells: Sequence[int]) -> Grid:
    """Check shape and range, return an immutable grid."""
    grid = tuple(int(v) for v in cells)
    if len(grid) != 81 or any(not 0 <= v <= 9 for v in grid):
        raise ValueError("a grid is 81 values in 0..9 (0 = blank)")
    return grid


def count_givens(puzzle: Sequence[int]) -> int:
    return sum(1 for v in puzzle if v)


# -- solving -----------------------------------------------------------------------------------


def _unit_masks(cells: Sequence[int]):
    """Row/column/box masks of placed digits, or None if two givens clash."""
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(cells):
        if v:
            bit = 1 << (v - 1)
            r, c, b = ROW_OF[i], COL_OF[i], BOX_OF[i]
            if (rows[r] | cols[c] | boxes[b]) & bit:
                return None
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
    return rows, cols, boxes


def _search(cells, empties, rows, cols, boxes, limit, found, rng):
    """Depth-first search with the minimum-remaining-values heuristic.

    `empties` holds the blank cells still to fill; picking the most constrained one first means
    forced cells (one candidate) are placed before any branching, so easy puzzles never branch.
    Appends complete grids to `found` and stops once it holds `limit` of them.
    """
    if not empties:
        found.append(tuple(cells))
        return
    best_pos, best_mask, best_count = -1, 0, 10
    for pos, i in enumerate(empties):
        mask = ALL_DIGITS & ~(rows[ROW_OF[i]] | cols[COL_OF[i]] | boxes[BOX_OF[i]])
        n = POPCOUNT[mask]
        if n < best_count:
            best_pos, best_mask, best_count = pos, mask, n
            if n <= 1:
                break
    if best_count == 0:
        return
    cell = empties[best_pos]
    empties[best_pos] = empties[-1]
    empties.pop()
    r, c, b = ROW_OF[cell], COL_OF[cell], BOX_OF[cell]
    bits = [1 << k for k in range(9) if best_mask >> k & 1]
    if rng is not None:
        rng.shuffle(bits)
    for bit in bits:
        cells[cell] = DIGIT_OF_BIT[bit]
        rows[r] |= bit
        cols[c] |= bit
        boxes[b] |= bit
        _search(cells, empties, rows, cols, boxes, limit, found, rng)
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        if len(found) >= limit:
            break
    cells[cell] = 0
    empties.append(cell)
    empties[best_pos], empties[-1] = empties[-1], empties[best_pos]


def _solutions(puzzle: Sequence[int], limit: int, rng: random.Random | None = None) -> list[Grid]:
    cells = list(puzzle)
    masks = _unit_masks(cells)
    if masks is None:
        return []
    found: list[Grid] = []
    _search(cells, [i for i in range(81) if not cells[i]], *masks, limit, found, rng)
    return found


def count_solutions(puzzle: Sequence[int], limit: int = 2) -> int:
    """Number of solutions, counting no further than `limit` (2 answers 'is it unique?')."""
    return len(_solutions(puzzle, limit))


def has_unique_solution(puzzle: Sequence[int]) -> bool:
    return count_solutions(puzzle, 2) == 1


def solve(puzzle: Sequence[int]) -> Grid | None:
    """One solution (the solution, for a proper puzzle), or None if there is none."""
    found = _solutions(puzzle, 1)
    return found[0] if found else None


# -- validity ----------------------------------------------------------------------------------


def solution_errors(puzzle: Sequence[int], grid: Sequence[int] | None) -> list[str]:
    """Why `grid` is not a solution of `puzzle` (empty list: it is one).

    Checks the grid on its own terms, never against a stored answer: complete, every row, column
    and box a permutation of 1..9, and every given of the puzzle kept.
    """
    if grid is None:
        return ["no grid"]
    grid = tuple(grid)
    if len(grid) != 81:
        return [f"grid has {len(grid)} cells, not 81"]
    errors = []
    blanks = sum(1 for v in grid if v not in range(1, 10))
    if blanks:
        errors.append(f"incomplete: {blanks} cells without a digit 1-9")
    for name, unit in zip(UNIT_NAMES, UNITS):
        digits = [grid[i] for i in unit if grid[i] in range(1, 10)]
        dupes = sorted({d for d in digits if digits.count(d) > 1})
        if dupes:
            errors.append(f"{name} repeats {', '.join(map(str, dupes))}")
    changed = [i for i in range(81) if puzzle[i] and grid[i] != puzzle[i]]
    if changed:
        row, col = divmod(changed[0], 9)
        errors.append(f"{len(changed)} givens changed (first at row {row + 1}, column {col + 1})")
    return errors


def rule_violations(puzzle: Sequence[int], grid: Sequence[int]) -> list[int]:
    """The cells of `grid` (81 values, 0 or anything outside 1-9 = no digit) that break the rules, sorted:
    cells without a digit, cells whose digit repeats in their row, column or box (every cell of the
    clash but a kept given: a given is right by definition), and changed givens. A rules checker only: it
    never looks for what a cell should hold, so an empty answer means exactly `is_valid_solution`."""
    bad = {i for i in range(81) if grid[i] not in range(1, 10) or (puzzle[i] and grid[i] != puzzle[i])}
    for unit in UNITS:
        seen: dict[int, list[int]] = {}
        for i in unit:
            if grid[i] in range(1, 10):
                seen.setdefault(grid[i], []).append(i)
        for cells in seen.values():
            if len(cells) > 1:
                bad.update(i for i in cells if grid[i] != puzzle[i])
    return sorted(bad)


def is_valid_solution(puzzle: Sequence[int], grid: Sequence[int] | None) -> bool:
    return not solution_errors(puzzle, grid)


# -- singles-only propagation ------------------------------------------------------------------


def propagate_singles(puzzle: Sequence[int], hidden: bool = True) -> Grid:
    """Fill every cell forced by naked singles (a cell with one candidate) and, if `hidden`,
    hidden singles (a digit with one possible cell in a row, column or box), repeatedly, until
    nothing more is forced. Returns the partially (or fully) filled grid; no guessing is done.
    """
    cells = list(puzzle)
    masks = _unit_masks(cells)
    if masks is None:
        return tuple(cells)
    rows, cols, boxes = masks

    def place(i, d):
        bit = 1 << (d - 1)
        cells[i] = d
        rows[ROW_OF[i]] |= bit
        cols[COL_OF[i]] |= bit
        boxes[BOX_OF[i]] |= bit

    def candidates(i):
        return ALL_DIGITS & ~(rows[ROW_OF[i]] | cols[COL_OF[i]] | boxes[BOX_OF[i]])

    progress = True
    while progress:
        progress = False
        for i in range(81):
            if not cells[i]:
                mask = candidates(i)
                if mask == 0:
                    return tuple(cells)  # contradiction: stop, the caller sees blanks
                if POPCOUNT[mask] == 1:
                    place(i, DIGIT_OF_BIT[mask])
                    progress = True
        if progress or not hidden:
            continue  # naked singles are cheaper; only look for hidden ones when they run dry
        for unit in UNITS:
            blanks = [i for i in unit if not cells[i]]
            for bit in (1 << k for k in range(9)):
                spots = [i for i in blanks if candidates(i) & bit]
                if len(spots) == 1:
                    place(spots[0], DIGIT_OF_BIT[bit])
                    progress = True
                    blanks.remove(spots[0])
    return tuple(cells)


def is_singles_solvable(puzzle: Sequence[int], hidden: bool = True) -> bool:
    """True if naked (and, with `hidden`, hidden) singles alone complete the puzzle correctly."""
    filled = propagate_singles(puzzle, hidden)
    return 0 not in filled and is_valid_solution(puzzle, filled)


# -- generation --------------------------------------------------------------------------------


def random_solution(rng: random.Random) -> Grid:
    """A random complete grid: the MRV search on an empty grid with shuffled digit order."""
    return _solutions([0] * 81, 1, rng)[0]


def _removal_keeps_unique(cells: list[int], cell: int, digit: int) -> bool:
    """With `cell` blanked in `cells` (whose unique solution has `digit` there), is the solution
    still unique? Another solution must put a different digit in `cell`, so try each other
    candidate and look for one solution: cheaper than counting solutions of the whole puzzle.
    """
    rows, cols, boxes = _unit_masks(cells)
    others = ALL_DIGITS & ~(rows[ROW_OF[cell]] | cols[COL_OF[cell]] | boxes[BOX_OF[cell]]) & ~(1 << (digit - 1))
    for k in range(9):
        if others >> k & 1:
            cells[cell] = k + 1
            alternative = _solutions(cells, 1)
            cells[cell] = 0
            if alternative:
                return False
    return True


def generate_puzzle(rng: random.Random, givens: int, max_attempts: int = 100) -> tuple[Grid, Grid]:
    """A puzzle with exactly `givens` givens and a unique solution; returns (puzzle, solution).

    Makes a random full grid, then blanks cells in random order, keeping each removal only if
    the solution stays unique, until `givens` remain. If the cells run out first (the puzzle
    became minimal above the target), starts over with a new grid. Random removal seldom
    reaches below about 22 givens, so small targets cost many attempts.
    """
    if not MIN_GIVENS <= givens <= 81:
        raise ValueError(f"givens must be in {MIN_GIVENS}..81, got {givens}")
    for _ in range(max_attempts):
        solution = random_solution(rng)
        cells = list(solution)
        if _remove_while_unique(cells, rng, givens) == givens:
            return tuple(cells), solution
    raise RuntimeError(f"no unique puzzle with {givens} givens after {max_attempts} attempts")


def _remove_while_unique(cells: list[int], rng: random.Random, givens: int, keep: int = -1) -> int:
    """Blank the givens of `cells` in random order (never `keep`), each only if the solution stays
    unique, until `givens` remain or none can go. Returns the number of givens left."""
    remaining = count_givens(cells)
    order = [i for i in range(81) if cells[i] and i != keep]
    rng.shuffle(order)
    for cell in order:
        if remaining == givens:
            break
        digit = cells[cell]
        cells[cell] = 0
        if _removal_keeps_unique(cells, cell, digit):
            remaining -= 1
        else:
            cells[cell] = digit
    return remaining


def generate_minimal_puzzle(rng: random.Random, givens: int, max_moves: int = 400,
                            max_attempts: int = 20) -> tuple[Grid, Grid]:
    """A puzzle with exactly `givens` givens and a unique solution, for targets below what random
    removal reaches (it gets stuck at a minimal puzzle of about 22-26 givens); returns (puzzle, solution).

    Removes givens at random as `generate_puzzle` does, then climbs: put one blank cell's solution
    digit back and remove again in a new random order, keeping the move when it leaves no more givens
    than before (sideways moves let it wander across plateaus), until `givens` remain. After
    `max_moves` moves it starts over from a new grid. Measured on one core: about 0.4 s for 23 givens,
    1 s for 22, 3 s for 21, 20 s or more for 20 (most runs stall at 21).
    """
    if not MIN_GIVENS <= givens <= 81:
        raise ValueError(f"givens must be in {MIN_GIVENS}..81, got {givens}")
    for _ in range(max_attempts):
        solution = random_solution(rng)
        cells = list(solution)
        remaining = _remove_while_unique(cells, rng, givens)
        for _ in range(max_moves):
            if remaining == givens:
                break
            trial = list(cells)
            cell = rng.choice([i for i in range(81) if not trial[i]])
            trial[cell] = solution[cell]
            left = _remove_while_unique(trial, rng, givens, keep=cell)
            if left <= remaining:
                cells, remaining = trial, left
        if remaining == givens:
            return tuple(cells), solution
    raise RuntimeError(f"no unique puzzle with {givens} givens after {max_attempts} attempts")
