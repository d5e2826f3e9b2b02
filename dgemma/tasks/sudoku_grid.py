"""Pure 9x9 sudoku logic, independent of any model: solving, uniqueness, generation, singles,
validity, symmetry transforms and an exact canonical form.

A grid is a tuple of 81 ints in reading order (row-major); 0 marks a blank. Puzzles and
solutions use the same type. Everything here is plain Python except the canonical form, which
uses numpy to score all column permutations at once.

Candidate sets are 9-bit masks: bit d-1 set means digit d is still possible.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

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


# -- symmetry ----------------------------------------------------------------------------------


def _line_permutations() -> list[tuple[int, ...]]:
    """The 6 * 6^3 = 1296 permutations of 9 rows (or columns) that keep bands (stacks) intact:
    output band k takes source band order[k], and its rows are permuted within."""
    perms = []
    for order in itertools.permutations(range(3)):
        for inner in itertools.product(itertools.permutations(range(3)), repeat=3):
            perms.append(tuple(order[k] * 3 + inner[k][j] for k in range(3) for j in range(3)))
    return perms


LINE_PERMUTATIONS = _line_permutations()


def _is_line_permutation(perm: Sequence[int]) -> bool:
    return sorted(perm) == list(range(9)) and all(len({perm[k * 3 + j] // 3 for j in range(3)}) == 1 for k in range(3))


@dataclass(frozen=True)
class Transform:
    """A validity-preserving symmetry: optional transpose, then rows and columns reordered
    (output row i is source row rows[i], likewise columns), then digits relabelled (d -> digits[d]).
    rows/cols must keep bands/stacks together; digits[0] must be 0 so blanks stay blank."""

    transpose: bool
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    digits: tuple[int, ...]

    def __post_init__(self):
        if not (_is_line_permutation(self.rows) and _is_line_permutation(self.cols)):
            raise ValueError("rows and cols must permute bands/stacks and lines within them")
        if len(self.digits) != 10 or self.digits[0] != 0 or sorted(self.digits[1:]) != list(range(1, 10)):
            raise ValueError("digits must be 0 followed by a permutation of 1..9")

    def apply(self, grid: Sequence[int]) -> Grid:
        src = transpose(grid) if self.transpose else grid
        return tuple(self.digits[src[r * 9 + c]] for r in self.rows for c in self.cols)


def transpose(grid: Sequence[int]) -> Grid:
    return tuple(grid[c * 9 + r] for r in range(9) for c in range(9))


def random_transform(rng: random.Random) -> Transform:
    """Uniform over the 2 * 1296^2 * 9! symmetries (used for augmentation)."""
    digits = list(range(1, 10))
    rng.shuffle(digits)
    return Transform(
        transpose=rng.random() < 0.5,
        rows=rng.choice(LINE_PERMUTATIONS),
        cols=rng.choice(LINE_PERMUTATIONS),
        digits=(0, *digits),
    )


# -- canonical form ----------------------------------------------------------------------------
#
# The canonical form of a puzzle is the smallest member of its orbit under the full group
# (transpose x 1296 row x 1296 column permutations x 9! digit relabellings, 1.2e12 elements) in
# this total order: first the blank pattern (reading order, blank < given), then the digits.
# Minimising in that order splits the work:
#  1. Blank pattern. For a fixed transpose and column permutation, the smallest row arrangement
#     is found by sorting: order the three rows of each band by their 9-bit mask, then the bands
#     by their sorted triple. numpy does this for all 2 * 1296 column choices at once.
#  2. Digits. For each (transpose, column permutation) reaching the minimal pattern -- usually
#     one or a handful for a generated puzzle, i.e. the pattern's automorphisms -- search the row
#     arrangements that keep the pattern, row by row, relabelling digits by first appearance (the
#     smallest relabelling of a fixed arrangement) and cutting any branch whose rows so far exceed
#     the best found.
# The result is exact: equal iff the puzzles are equivalent. Measured cost: ~0.75 ms for a
# generated puzzle (24-45 givens); symmetric patterns cost more (0.1-0.4 s for a full grid or
# whole blank bands) because many arrangements tie on the pattern.

_MASK_TABLE: np.ndarray | None = None  # [column permutation, row mask] -> permuted row mask


def _mask_table() -> np.ndarray:
    global _MASK_TABLE
    if _MASK_TABLE is None:
        perms = np.array(LINE_PERMUTATIONS)  # (1296, 9)
        masks = np.arange(512)
        weights = 1 << (8 - np.arange(9))  # column 0 is the most significant bit
        bits = (masks[:, None] >> (8 - np.arange(9))) & 1  # (512, 9), bit of source column j
        _MASK_TABLE = (bits[:, perms] * weights).sum(axis=2).T.astype(np.int64)  # (1296, 512)
    return _MASK_TABLE


def _row_masks(grid: Sequence[int]) -> list[int]:
    return [sum(1 << (8 - c) for c in range(9) if grid[r * 9 + c]) for r in range(9)]


def _best_rows(src: Grid, cols: Sequence[int], masks: list[int], target: list[int], best: list) -> bool:
    """Row-by-row search for the smallest digit relabelling among row arrangements that give
    the minimal blank pattern `target` (9 row masks) for one (transpose, column permutation).

    `best` holds the 9 relabelled rows of the best arrangement seen so far (across all column
    permutations) and is updated in place; a branch is cut as soon as its rows so far are larger
    than best's. Returns whether `best` changed.
    """
    values = [[src[r * 9 + c] for c in cols] for r in range(9)]
    band_key = [tuple(sorted(masks[b * 3 : b * 3 + 3])) for b in range(3)]
    target_key = [tuple(target[b * 3 : b * 3 + 3]) for b in range(3)]
    chosen: list[int] = []
    rows_out: list[tuple[int, ...]] = []

    def extend(i: int, relabel: dict, tied: bool) -> bool:
        if i == 9:
            if best and tied:
                return False  # equal to best: nothing to change
            best[:] = list(rows_out)
            return True
        if i % 3 == 0:  # start a band: any unused source band with the right pattern
            used_bands = {r // 3 for r in chosen}
            bands = [b for b in range(3) if b not in used_bands and band_key[b] == target_key[i // 3]]
            options = [r for b in bands for r in range(b * 3, b * 3 + 3)]
        else:  # continue the band of the previous row
            band = chosen[-1] // 3
            options = [r for r in range(band * 3, band * 3 + 3) if r not in chosen]
        changed = False
        for r in options:
            if masks[r] != target[i]:
                continue
            labels = dict(relabel)
            row = tuple(labels.setdefault(v, len(labels)) for v in values[r])
            still_tied = tied and bool(best)
            if still_tied and row > best[i]:
                continue
            chosen.append(r)
            rows_out.append(row)
            if extend(i + 1, labels, still_tied and row == best[i]):
                changed = True
                tied = True  # best now shares this node's prefix
            chosen.pop()
            rows_out.pop()
        return changed

    return extend(0, {0: 0}, True)


def canonical_form(puzzle: Sequence[int]) -> Grid:
    """The orbit minimum described above: equal for two puzzles iff some symmetry maps one to
    the other."""
    table = _mask_table()
    candidates = []  # per transpose: (source grid, row-mask images for every column permutation)
    band_keys = []
    for flip in (False, True):
        src = transpose(puzzle) if flip else tuple(puzzle)
        images = table[:, _row_masks(src)]  # (1296, 9)
        bands = np.sort(images.reshape(-1, 3, 3), axis=2)
        band_keys.append(np.sort((bands[:, :, 0] << 18) | (bands[:, :, 1] << 9) | bands[:, :, 2], axis=1))
        candidates.append((src, images))
    keys = np.concatenate(band_keys)  # (2592, 3): the best row arrangement's pattern, per choice
    alive = np.ones(len(keys), dtype=bool)
    for k in range(3):  # lexicographic minimum over the three band keys
        alive &= keys[:, k] == keys[alive, k].min()
    first = int(np.flatnonzero(alive)[0])
    target = [int(key) >> shift & 511 for key in keys[first] for shift in (18, 9, 0)]
    best: list = []
    for index in np.flatnonzero(alive):
        src, images = candidates[index // 1296]
        perm = int(index % 1296)
        _best_rows(src, LINE_PERMUTATIONS[perm], images[perm].tolist(), target, best)
    return tuple(v for row in best for v in row)


def are_equivalent(a: Sequence[int], b: Sequence[int]) -> bool:
    return canonical_form(a) == canonical_form(b)
