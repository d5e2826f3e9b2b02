"""The sudoku task without a model: generator, solver, checker, symmetry, splits, I/O, tokens, scores."""

import json
import random

import pytest

from dgemma.tasks.sudoku import (
    BUCKET_GIVENS,
    Example,
    SudokuVocab,
    Transform,
    bucket_of,
    canonical_form,
    count_givens,
    count_solutions,
    decode_canvas,
    encode_prompt,
    encode_solution,
    format_grid,
    generate_examples,
    generate_minimal_puzzle,
    generate_puzzle,
    grid_to_string,
    has_unique_solution,
    is_singles_solvable,
    is_valid_solution,
    make_bucket_test_sets,
    make_split,
    parse_puzzle,
    propagate_singles,
    random_solution,
    random_transform,
    read_puzzle_file,
    score,
    rule_violations,
    solution_errors,
    solve,
    transpose,
    wilson_interval,
    write_split,
)

# Wikipedia's example puzzle: easy, well known to fall to singles.
WIKI = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
WIKI_SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
# Arto Inkala's "world's hardest sudoku" (2012): unique, and needs far more than singles.
INKALA = "8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4.."
# A generated puzzle where naked singles stall but hidden singles finish (checked independently below).
# The three buckets that random removal reaches cheaply (the minimal one costs ~1.5 s a puzzle).
FAST_BUCKETS = {k: BUCKET_GIVENS[k] for k in ("easy", "medium", "hard")}
NEEDS_HIDDEN = "..3.7.61.68.......714265..8...154...4..89...1.6....5.9.5..8..34..95.7..6.......8."


# -- an independent reference, deliberately naive (sets, no bitmasks) ---------------------------


def peers_digits(grid, i):
    r, c = divmod(i, 9)
    box = [(r // 3 * 3 + dr) * 9 + c // 3 * 3 + dc for dr in range(3) for dc in range(3)]
    return {grid[r * 9 + k] for k in range(9)} | {grid[k * 9 + c] for k in range(9)} | {grid[j] for j in box}


def brute_count(puzzle, limit=2):
    grid = list(puzzle)

    def count():
        blanks = [i for i in range(81) if not grid[i]]
        if not blanks:
            return 1
        options = {i: [d for d in range(1, 10) if d not in peers_digits(grid, i)] for i in blanks}
        cell = min(blanks, key=lambda i: len(options[i]))
        total = 0
        for d in options[cell]:
            grid[cell] = d
            total += count()
            grid[cell] = 0
            if total >= limit:
                break
        return total

    return count()


def units_ok(grid):
    rows = [grid[r * 9 : r * 9 + 9] for r in range(9)]
    cols = [grid[c::9] for c in range(9)]
    boxes = [[grid[(b // 3 * 3 + k // 3) * 9 + b % 3 * 3 + k % 3] for k in range(9)] for b in range(9)]
    return all(sorted(u) == list(range(1, 10)) for u in rows + cols + boxes)


def order_key(grid):
    """The order the canonical form minimises: blank pattern first (blank < given), then digits."""
    return tuple(1 if v else 0 for v in grid), tuple(grid)


def relabel_first_appearance(grid):
    labels = {0: 0}
    return tuple(labels.setdefault(v, len(labels)) for v in grid)


@pytest.fixture(scope="module")
def generated():
    rng = random.Random(11)
    return [generate_puzzle(rng, givens) for givens in (24, 27, 31, 36, 40, 45)]


# -- generation and solving ----------------------------------------------------------------------


def test_generated_puzzles_hit_target_and_are_unique_by_independent_count(generated):
    for (puzzle, solution), target in zip(generated, (24, 27, 31, 36, 40, 45)):
        assert count_givens(puzzle) == target
        assert brute_count(puzzle) == 1
        assert units_ok(solution) and all(p in (0, s) for p, s in zip(puzzle, solution))
        assert solve(puzzle) == solution


def test_minimal_generator_goes_below_random_removal_with_a_unique_solution():
    # 22 givens: random removal alone stalls at 22-26, the climb gets there in about a second.
    rng = random.Random(5)
    for target in (23, 22):
        puzzle, solution = generate_minimal_puzzle(rng, target)
        assert count_givens(puzzle) == target
        assert brute_count(puzzle) == 1  # the naive counter, not the generator's solver
        assert units_ok(solution) and all(p in (0, s) for p, s in zip(puzzle, solution))
    assert generate_minimal_puzzle(random.Random(2), 23) == generate_minimal_puzzle(random.Random(2), 23)
    with pytest.raises(ValueError):
        generate_minimal_puzzle(random.Random(0), 16)


def test_generation_is_deterministic_and_rejects_impossible_targets():
    assert generate_puzzle(random.Random(3), 33) == generate_puzzle(random.Random(3), 33)
    assert generate_puzzle(random.Random(3), 33) != generate_puzzle(random.Random(4), 33)
    with pytest.raises(ValueError):
        generate_puzzle(random.Random(0), 16)


def test_solver_counts_zero_one_and_many():
    wiki = parse_puzzle(WIKI)
    assert solve(wiki) == parse_puzzle(WIKI_SOLUTION)
    assert count_solutions(wiki) == brute_count(wiki) == 1
    assert has_unique_solution(parse_puzzle(INKALA))
    assert count_solutions((0,) * 81, limit=5) == 5
    # A full grid with one row blanked but for one digit is still unique.
    full = parse_puzzle(WIKI_SOLUTION)
    assert count_solutions(tuple(0 if i in range(1, 9) else v for i, v in enumerate(full))) == 1
    # an unsolvable puzzle: the same digit twice in a column
    clash = list((0,) * 81)
    clash[0] = clash[9] = 5
    assert count_solutions(clash) == 0 and solve(clash) is None


def test_two_solutions_found_for_deadly_pattern():
    # Cells (r0,c0)=a, (r0,c1)=b, (r1,c0)=b, (r1,c1)=a with r0, r1 in one band and c0, c1 in
    # different stacks: swapping a and b keeps every unit a permutation, so blanking the four
    # cells leaves exactly two solutions.
    full = parse_puzzle(WIKI_SOLUTION)
    for r0 in range(9):
        for r1 in range(r0 // 3 * 3, r0 // 3 * 3 + 3):
            for c0 in range(9):
                for c1 in range(9):
                    cells = [r0 * 9 + c0, r0 * 9 + c1, r1 * 9 + c0, r1 * 9 + c1]
                    if r0 == r1 or c0 // 3 == c1 // 3 or len(set(cells)) < 4:
                        continue
                    a, b = full[cells[0]], full[cells[1]]
                    if (full[cells[2]], full[cells[3]]) == (b, a):
                        puzzle = tuple(0 if i in cells else v for i, v in enumerate(full))
                        assert count_solutions(puzzle, limit=5) == brute_count(puzzle, limit=5) == 2
                        assert not has_unique_solution(puzzle)
                        return
    pytest.fail("no swappable rectangle in the fixture grid")


def test_bucket_boundaries():
    assert [bucket_of(g) for g in (81, 40, 39, 30, 29, 24, 23, 17)] == [
        "easy", "easy", "medium", "medium", "hard", "hard", "minimal", "minimal"]
    for name, (low, high) in BUCKET_GIVENS.items():
        assert bucket_of(low) == bucket_of(high) == name
    assert bucket_of(parse_puzzle(WIKI)) == "medium"  # 30 givens


# -- singles ---------------------------------------------------------------------------------------


def test_singles_flag_on_known_puzzles():
    assert is_singles_solvable(parse_puzzle(WIKI))
    assert propagate_singles(parse_puzzle(WIKI)) == parse_puzzle(WIKI_SOLUTION)
    inkala = parse_puzzle(INKALA)
    assert not is_singles_solvable(inkala)
    assert propagate_singles(inkala).count(0) > 0


def test_hidden_singles_needed_example_checked_independently():
    puzzle = parse_puzzle(NEEDS_HIDDEN)
    assert has_unique_solution(puzzle)
    stalled = propagate_singles(puzzle, hidden=False)
    assert not is_singles_solvable(puzzle, hidden=False) and is_singles_solvable(puzzle)
    # Where naked singles stall, no blank has exactly one candidate, yet some unit has a digit
    # with exactly one possible cell, and everything filled agrees with the solution.
    blanks = [i for i in range(81) if not stalled[i]]
    assert blanks and all(len(set(range(1, 10)) - peers_digits(stalled, i)) >= 2 for i in blanks)
    units = [[r * 9 + c for c in range(9)] for r in range(9)] + [[r * 9 + c for r in range(9)] for c in range(9)]
    hidden = [
        (unit, d)
        for unit in units
        for d in range(1, 10)
        if d not in [stalled[i] for i in unit]
        and sum(1 for i in unit if not stalled[i] and d not in peers_digits(stalled, i)) == 1
    ]
    assert hidden
    assert all(v in (0, s) for v, s in zip(stalled, solve(puzzle)))


# -- validity checker ------------------------------------------------------------------------------


def swapped(grid, i, j):
    cells = list(grid)
    cells[i], cells[j] = cells[j], cells[i]
    return tuple(cells)


def test_checker_catches_each_kind_of_invalid_grid():
    full = parse_puzzle(WIKI_SOLUTION)
    empty = (0,) * 81
    assert is_valid_solution(empty, full) and is_valid_solution(parse_puzzle(WIKI), full)
    # Same column, same box: the column and box stay permutations, two rows repeat a digit.
    errors = solution_errors(empty, swapped(full, 0, 9))
    assert errors and all(e.startswith("row") for e in errors)
    # Same row, same box: only columns break.
    errors = solution_errors(empty, swapped(full, 0, 1))
    assert errors and all(e.startswith("column") for e in errors)
    # Swap rows 0 and 3 (different bands): rows and columns stay permutations, boxes break.
    rows = [full[r * 9 : r * 9 + 9] for r in range(9)]
    rows[0], rows[3] = rows[3], rows[0]
    errors = solution_errors(empty, sum(rows, ()))
    assert errors and all(e.startswith("box") for e in errors)
    # A different valid grid (digits relabelled) loses the givens.
    relabelled = tuple(v % 9 + 1 for v in full)
    assert solution_errors(empty, relabelled) == []
    errors = solution_errors(parse_puzzle(WIKI), relabelled)
    assert len(errors) == 1 and "givens changed" in errors[0]
    incomplete = tuple(0 if i == 40 else v for i, v in enumerate(full))
    assert [e for e in solution_errors(empty, incomplete) if "incomplete" in e]
    assert not is_valid_solution(empty, None)
    assert not is_valid_solution(empty, full[:80])
    assert not is_valid_solution(empty, tuple(10 if i == 0 else v for i, v in enumerate(full)))


def test_rule_violations_name_the_clashing_cells_and_changed_givens():
    full, puzzle = parse_puzzle(WIKI_SOLUTION), parse_puzzle(WIKI)
    assert rule_violations(puzzle, full) == []
    # cells 0 and 9 swapped: same column and box, so only rows 1 and 2 repeat a digit, at 4 cells
    grid = swapped(full, 0, 9)
    expected = {0, 9, full.index(full[9]), 9 + full[9:18].index(full[0])}
    assert set(rule_violations((0,) * 81, grid)) == expected
    # with the puzzle's givens: the swapped cells are changed givens, a clashing kept given is not rejected
    assert puzzle[0] and puzzle[9]
    assert set(rule_violations(puzzle, grid)) == {i for i in expected if not puzzle[i] or grid[i] != puzzle[i]}
    # a cell without a digit, alone: nothing else clashes
    assert rule_violations((0,) * 81, tuple(0 if i == 40 else v for i, v in enumerate(full))) == [40]
    # a valid grid with other digits: only the givens break a rule
    relabelled = tuple(v % 9 + 1 for v in full)
    assert rule_violations(puzzle, relabelled) == [i for i in range(81) if puzzle[i]]


# -- symmetry and canonical form -------------------------------------------------------------------


def test_transforms_preserve_validity_and_uniqueness(generated):
    rng = random.Random(5)
    for puzzle, solution in generated:
        t = random_transform(rng)
        p, s = t.apply(puzzle), t.apply(solution)
        assert units_ok(s) and is_valid_solution(p, s)
        assert count_givens(p) == count_givens(puzzle) and brute_count(p) == 1
    full = parse_puzzle(WIKI_SOLUTION)
    assert units_ok(transpose(full)) and transpose(transpose(full)) == full
    with pytest.raises(ValueError):  # rows 0 and 3 come from different bands: breaks boxes
        Transform(False, (3, 1, 2, 0, 4, 5, 6, 7, 8), tuple(range(9)), tuple(range(10)))
    with pytest.raises(ValueError):
        Transform(False, tuple(range(9)), tuple(range(9)), (1, 0, *range(2, 10)))


def test_canonical_form_equal_for_transformed_copies_and_minimal(generated):
    rng = random.Random(9)
    for puzzle, _ in generated[:4]:
        canon = canonical_form(puzzle)
        assert count_givens(canon) == count_givens(puzzle) and has_unique_solution(canon)
        assert canonical_form(canon) == canon
        for _ in range(4):
            assert canonical_form(random_transform(rng).apply(puzzle)) == canon
        # Minimal in the documented order against any transformed, relabelled copy.
        for _ in range(200):
            assert order_key(canon) <= order_key(relabel_first_appearance(random_transform(rng).apply(puzzle)))


def test_canonical_form_distinguishes_different_puzzles(generated):
    forms = {canonical_form(p) for p, _ in generated}
    assert len(forms) == len(generated)
    # Same blank pattern and digit counts, only two digits swapped in one row: a different puzzle.
    wiki = parse_puzzle(WIKI)
    changed = swapped(wiki, 0, 1)  # row 1 starts 3 5 instead of 5 3
    assert canonical_form(changed) != canonical_form(wiki)
    # The degenerate case (a full grid: every arrangement ties on the pattern) is still exact.
    full = parse_puzzle(WIKI_SOLUTION)
    canon = canonical_form(full)
    rng = random.Random(2)
    assert canonical_form(random_transform(rng).apply(full)) == canon
    assert canonical_form(random_solution(rng)) != canon
    # Here the digits alone decide, so this checks the pruned search over tied arrangements.
    assert canon[:9] == tuple(range(1, 10)) and units_ok(canon)
    for _ in range(300):
        assert canon <= relabel_first_appearance(random_transform(rng).apply(full))


# -- data sets -------------------------------------------------------------------------------------


def test_make_split_is_deterministic_and_disjoint_up_to_symmetry():
    split = make_split(12, 6, seed=1, train_givens=(30, 45), test_givens=(30, 45))
    assert (len(split.train), len(split.test)) == (12, 6)
    assert make_split(12, 6, seed=1, train_givens=(30, 45), test_givens=(30, 45)) == split
    other = make_split(12, 6, seed=2, train_givens=(30, 45), test_givens=(30, 45))
    assert not {e.puzzle for e in other.train} & {e.puzzle for e in split.train}
    # The test set does not depend on the train size; a bigger train set extends a smaller one.
    bigger = make_split(15, 6, seed=1, train_givens=(30, 45), test_givens=(30, 45))
    assert bigger.test == split.test and bigger.train[:12] == split.train
    forms = [canonical_form(e.puzzle) for e in split.train + split.test]
    assert len(set(forms)) == len(forms)
    for e in split.train + split.test:
        assert 30 <= e.givens <= 45 and is_valid_solution(e.puzzle, e.solution)


def test_bucket_test_sets_exclude_symmetric_copies():
    sets = make_bucket_test_sets(per_bucket={"easy": 2, "medium": 2, "hard": 2, "minimal": 1}, seed=4)
    assert {name: {e.bucket for e in examples} for name, examples in sets.items()} == {n: {n} for n in BUCKET_GIVENS}
    # Excluding *transformed* copies of the easy set (not byte-equal) must push those puzzles out.
    rng = random.Random(0)
    disguised = [random_transform(rng).apply(e.puzzle) for e in sets["easy"]]
    assert not set(disguised) & {e.puzzle for e in sets["easy"]}
    again = make_bucket_test_sets(per_bucket=2, seed=4, exclude=disguised, buckets=FAST_BUCKETS)
    assert not {e.puzzle for e in again["easy"]} & {e.puzzle for e in sets["easy"]}
    assert again["medium"] == sets["medium"] and again["hard"] == sets["hard"]


def test_write_split_round_trips(tmp_path):
    givens = {"train_givens": (35, 45), "test_givens": (35, 45)}
    paths = write_split(tmp_path, n_train=5, n_test=3, seed=3, per_bucket=1, buckets=FAST_BUCKETS, **givens)
    split = make_split(5, 3, seed=3, **givens)
    buckets = make_bucket_test_sets(1, seed=3, exclude=split.train + split.test, buckets=FAST_BUCKETS)
    expected = {"train": split.train, "test": split.test, **{f"test_{k}": v for k, v in buckets.items()}}
    for name, examples in expected.items():
        read, errors = read_puzzle_file(paths[name])
        assert errors == [] and read == examples
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["counts"] == {name: len(v) for name, v in expected.items()} and manifest["seed"] == 3
    assert len(generate_examples(3, (40, 45), seed=0)) == 3


def test_minimal_bucket_and_low_train_are_disjoint_and_leave_earlier_sets_unchanged(tmp_path):
    givens = {"train_givens": (35, 45), "test_givens": (35, 45)}
    old_buckets = {k: v for k, v in BUCKET_GIVENS.items() if k != "minimal"}
    before = write_split(tmp_path / "before", n_train=4, n_test=0, seed=6, per_bucket=1, buckets=old_buckets, **givens)
    after = write_split(tmp_path / "after", n_train=4, n_test=0, seed=6, per_bucket={**dict.fromkeys(old_buckets, 1),
                        "minimal": 2}, low_train=3, low_givens=(22, 25), workers=2, **givens)
    for name in ("train", "test_easy", "test_medium", "test_hard"):
        assert after[name].read_text() == before[name].read_text()
    minimal, _ = read_puzzle_file(after["test_minimal"])
    low, _ = read_puzzle_file(after["train_low"])
    assert len(minimal) == 2 and all(21 <= e.givens <= 23 and e.bucket == "minimal" for e in minimal)
    assert len(low) == 3 and all(22 <= e.givens <= 25 for e in low)
    for e in minimal + low:
        assert brute_count(e.puzzle) == 1 and is_valid_solution(e.puzzle, e.solution)
    everything = [e for name in ("train", "test_easy", "test_medium", "test_hard", "test_minimal", "train_low")
                  for e in read_puzzle_file(after[name])[0]]
    forms = [canonical_form(e.puzzle) for e in everything]
    assert len(set(forms)) == len(forms)


def test_validation_sets_are_disjoint_and_leave_every_other_file_unchanged(tmp_path):
    givens = {"train_givens": (35, 45), "test_givens": (35, 45)}
    plain = write_split(tmp_path / "plain", n_train=5, n_test=2, seed=3, per_bucket=2, buckets=FAST_BUCKETS, **givens)
    with_val = write_split(tmp_path / "val", n_train=5, n_test=2, seed=3, per_bucket=2, validation_per_bucket=3,
                           buckets=FAST_BUCKETS, **givens)
    for name in ("train", "test", "test_easy", "test_medium", "test_hard"):
        assert with_val[name].read_bytes() == plain[name].read_bytes(), name
    validation = {b: read_puzzle_file(with_val[f"val_{b}"])[0] for b in FAST_BUCKETS}
    assert {b: [e.bucket for e in v] for b, v in validation.items()} == {b: [b] * 3 for b in FAST_BUCKETS}
    others = sum((read_puzzle_file(plain[n])[0] for n in ("train", "test", "test_easy", "test_medium", "test_hard")), [])
    seen = {canonical_form(e.puzzle) for e in others}
    val_forms = [canonical_form(e.puzzle) for v in validation.values() for e in v]
    assert len(set(val_forms)) == 9 and not seen & set(val_forms)
    assert json.loads(with_val["manifest"].read_text())["counts"]["val_hard"] == 3


# -- text I/O --------------------------------------------------------------------------------------


def test_parse_puzzle_forms_and_errors():
    wiki = parse_puzzle(WIKI)
    assert parse_puzzle(WIKI.replace(".", "0")) == wiki
    assert parse_puzzle("  " + WIKI + "\r\n") == wiki
    assert grid_to_string(wiki, ".") == WIKI and parse_puzzle(grid_to_string(wiki)) == wiki
    for line, reason in [
        (WIKI[:80], "expected 81 cells, got 80"),
        (WIKI + "1", "expected 81 cells, got 82"),
        ("x" + WIKI[1:], "invalid character 'x' at position 1"),
        ("55" + WIKI[2:], "givens clash: row 1 repeats 5"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_puzzle(line)


def test_read_puzzle_file_reports_bad_lines_with_numbers(tmp_path):
    relabelled = "".join(str(int(v) % 9 + 1) for v in WIKI_SOLUTION)  # a valid grid, wrong givens
    lines = [
        "quizzes,solutions",  # 1 header, skipped
        WIKI,  # 2 ok
        "",  # 3 blank, skipped
        "# comment",  # 4 skipped
        WIKI[:-1],  # 5 short
        f"{WIKI},{WIKI_SOLUTION}",  # 6 ok with solution
        f"{WIKI},{relabelled}",  # 7 solution does not solve it
        f"{WIKI},{WIKI_SOLUTION},x",  # 8 too many fields
        "?" * 81,  # 9 bad character
        INKALA.replace(".", "0"),  # 10 ok
    ]
    path = tmp_path / "puzzles.txt"
    path.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    examples, errors = read_puzzle_file(path)
    assert examples == [
        Example(parse_puzzle(WIKI)),
        Example(parse_puzzle(WIKI), parse_puzzle(WIKI_SOLUTION)),
        Example(parse_puzzle(INKALA)),
    ]
    assert [n for n, _ in errors] == [5, 7, 8, 9]
    assert "expected 81 cells" in errors[0][1]
    assert "solution does not solve the puzzle" in errors[1][1]
    assert "3 fields" in errors[2][1]
    assert "invalid character '?'" in errors[3][1]


def test_format_grid_draws_boxes():
    text = format_grid(parse_puzzle(WIKI))
    lines = text.split("\n")
    assert len(lines) == 13 and lines[0] == "┌───────┬───────┬───────┐" and lines[-1] == "└───────┴───────┴───────┘"
    assert lines[1] == "│ 5 3 · │ · 7 · │ · · · │" and lines[4] == "├───────┼───────┼───────┤"
    assert format_grid(parse_puzzle(WIKI), blank=".").count(".") == 81 - 30


# -- tokenisation ----------------------------------------------------------------------------------


def test_vocab_conventions():
    assert (SudokuVocab.PAD, SudokuVocab.EOS, SudokuVocab.BOS) == (0, 1, 2)
    ids = {SudokuVocab.PAD, SudokuVocab.EOS, SudokuVocab.BOS, SudokuVocab.BLANK, *SudokuVocab.DIGIT_IDS}
    assert len(ids) == 13 and max(ids) < SudokuVocab.vocab_size == len(SudokuVocab.token_names()) == 16


def test_tokenisation_round_trip():
    puzzle, solution = parse_puzzle(WIKI), parse_puzzle(WIKI_SOLUTION)
    prompt = encode_prompt(puzzle)
    assert len(prompt) == SudokuVocab.prompt_length and prompt[0] == SudokuVocab.BOS
    assert prompt[1:4] == [SudokuVocab.digit_id(5), SudokuVocab.digit_id(3), SudokuVocab.BLANK]
    assert prompt.count(SudokuVocab.BLANK) == 81 - 30
    canvas = encode_solution(solution)
    assert len(canvas) == SudokuVocab.canvas_length
    assert decode_canvas(canvas) == solution
    assert decode_canvas(canvas + [SudokuVocab.EOS, SudokuVocab.PAD]) == solution
    assert decode_canvas(canvas[:80]) is None and decode_canvas(canvas + [SudokuVocab.digit_id(1)]) is None
    noisy = decode_canvas([SudokuVocab.BLANK] + canvas[1:])
    assert noisy[0] == 0 and noisy[1:] == solution[1:] and not is_valid_solution(puzzle, noisy)
    with pytest.raises(ValueError):
        encode_solution(puzzle)


# -- scoring ---------------------------------------------------------------------------------------


def test_wilson_interval_known_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_score_counts_buckets_and_cells():
    wiki, wiki_solution = parse_puzzle(WIKI), parse_puzzle(WIKI_SOLUTION)
    easy = tuple(v if i < 45 else 0 for i, v in enumerate(wiki_solution))  # 45 givens: easy
    relabelled = tuple(v % 9 + 1 for v in wiki_solution)  # valid grid, but every cell wrong
    result = score([wiki, Example(easy, wiki_solution), wiki], [wiki_solution, None, relabelled])
    assert (result["solved"], result["total"]) == (1, 3)
    assert result["accuracy"] == pytest.approx(1 / 3) and result["ci95"] == wilson_interval(1, 3)
    assert result["buckets"]["medium"]["solved"] == 1 and result["buckets"]["medium"]["total"] == 2
    assert result["buckets"]["easy"]["total"] == 1 and result["buckets"]["easy"]["solved"] == 0
    assert result["buckets"]["hard"]["total"] == 0
    assert result["cell_accuracy"] == pytest.approx(81 / 243)
    assert result["blank_accuracy"] == pytest.approx(51 / (51 + 36 + 51))
    assert result["givens_kept"] == pytest.approx(30 / (30 + 45 + 30))
    with pytest.raises(ValueError):
        score([wiki], [])


def test_sudoku_verifier_rejects_the_units_of_a_clash():
    from dgemma.tasks.sudoku_eval import SudokuVerifier

    full, puzzle = parse_puzzle(WIKI_SOLUTION), parse_puzzle(WIKI)
    tokens = encode_solution(full)
    assert SudokuVerifier(puzzle)(tokens) == [] and SudokuVerifier(puzzle, "cells")(tokens) == []
    blank = next(i for i in range(81) if not puzzle[i])
    broken = list(tokens)
    broken[blank] = tokens[blank] % 9 + 4  # another digit token
    cells = SudokuVerifier(puzzle, "cells")(broken)
    units = SudokuVerifier(puzzle)(broken)
    assert blank in cells and set(cells) <= set(units)
    row, col = divmod(blank, 9)
    assert {i for i in range(row * 9, row * 9 + 9) if not puzzle[i]} <= set(units)
    assert {i for i in range(col, 81, 9) if not puzzle[i]} <= set(units)
    assert not any(puzzle[i] for i in units)  # no given was changed, so none is rejected
