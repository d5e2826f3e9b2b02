"""`dgemma sudoku prepare | solve | eval` plumbing, and a short run on the shipped model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dgemma
from dgemma.tasks.sudoku_models import SHIPPED
from dgemma.tasks import sudoku as S

ROOT = SHIPPED.parent.parent.parent
RESULTS = ROOT / "results" / "sudoku"  # the shipped models' evaluation and training records


def run(*args):
    return subprocess.run([sys.executable, "-m", "dgemma", "sudoku", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def random_sudoku_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sudoku-random")
    config = dgemma.get_preset("tiny").replace(vocab_size=16, canvas_length=81, max_position_embeddings=256)
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(config)
    model.sampling_config = model.sampling_config.replace(max_denoising_steps=4)
    dgemma.save_pretrained(model, folder)
    return folder


def test_prepare_writes_disjoint_augmented_sets(tmp_path):
    proc = run("prepare", "--out", str(tmp_path), "--train", "12", "--augment", "2", "--per-bucket", "2",
               "--validation", "1", "--minimal", "1", "--low-train", "2", "--low-augment", "1", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert len(S.read_puzzle_file(tmp_path / "val_medium.txt")[0]) == 1
    minimal, _ = S.read_puzzle_file(tmp_path / "test_minimal.txt")
    assert len(minimal) == 1 and minimal[0].givens < 24 and S.has_unique_solution(minimal[0].puzzle)
    low, _ = S.read_puzzle_file(tmp_path / "train_low.txt")
    assert len(low) == 2 and all(22 <= e.givens <= 27 for e in low)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == 12 * 3 + 2 * 2  # low-givens puzzles with their own number of copies
    first = json.loads(lines[0])
    assert len(first["prompt_ids"]) == 82 and len(first["response_ids"]) == 81
    train = S.read_puzzle_file(tmp_path / "train.txt")[0] + low
    test = sum((S.read_puzzle_file(tmp_path / f"test_{b}.txt")[0] for b in S.BUCKETS), [])
    assert len(test) == 7
    keys = {S.canonical_form(e.puzzle) for e in train}
    assert not keys & {S.canonical_form(e.puzzle) for e in test}


def test_eval_reports_buckets_bad_lines_and_json(tmp_path, random_sudoku_model):
    examples = S.generate_examples(3, givens=(40, 45), seed=1) + S.generate_examples(2, givens=(30, 35), seed=2)
    lines = [S.grid_to_string(e.puzzle) for e in examples]
    lines[1:1] = ["not a puzzle"]
    lines.append("1" * 81)  # 81 chars but the givens clash
    f = tmp_path / "puzzles.txt"
    f.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    proc = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--batch", "4",
               "--plot", str(tmp_path / "settle.png"))
    assert proc.returncode == 0, proc.stderr
    assert ":2: skipped" in proc.stderr and ":7: skipped" in proc.stderr  # by line number; not fatal
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["total"] == 5 and result["buckets"]["easy"]["total"] == 3
    assert result["buckets"]["medium"]["total"] == 2
    assert 0 <= result["accuracy"] <= 1 and len(result["mean_fix_step_of_blank_cells"]) == 81
    assert (tmp_path / "settle.png").read_bytes()[:4] == b"\x89PNG"


def test_clamped_eval_keeps_every_given(tmp_path, random_sudoku_model):
    examples = S.generate_examples(3, givens=(30, 45), seed=4)
    f = tmp_path / "p.txt"
    f.write_text("\n".join(S.grid_to_string(e.puzzle, blank=".") for e in examples) + "\n")
    proc = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--clamp")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["givens_kept"] == 1.0


def test_eval_takes_the_sampler_settings_and_rejects_bad_ones(tmp_path, random_sudoku_model):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(S.grid_to_string(e.puzzle) for e in S.generate_examples(2, givens=(30, 45), seed=5)))
    proc = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--steps", "1", "--t-max", "2.0",
               "--entropy-bound", "0.5")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["mean_denoising_steps"] == 1
    bad = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--t-max", "0.2", "--t-min", "0.5")
    assert bad.returncode == 2 and "t_min <= t_max" in bad.stderr and "Traceback" not in bad.stderr
    negative = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--entropy-bound", "-1")
    assert negative.returncode == 2 and "Traceback" not in negative.stderr


def test_shipped_decoding_is_the_one_chosen_on_validation_puzzles():
    """ship_sudoku.sh writes scripts/sudoku-decoding.json into the shipped generation_config.json."""
    chosen = json.loads((ROOT / "scripts" / "sudoku-decoding.json").read_text())
    sampling = dgemma.load_model(SHIPPED).sampling_config
    assert (sampling.t_max, sampling.t_min, sampling.max_denoising_steps, sampling.entropy_bound) == (
        chosen["t_max"], chosen["t_min"], chosen["max_denoising_steps"], chosen["entropy_bound"])
    assert json.loads((RESULTS / "decoding.json").read_text()) == chosen


def test_solve_says_invalid_clearly_and_bad_puzzle_exits_2(random_sudoku_model):
    proc = run("solve", "--model", str(random_sudoku_model), "--no-live", "--steps", "2")
    assert proc.returncode in (0, 1), proc.stderr
    assert ("INVALID" in proc.stdout) == (proc.returncode == 1)
    bad = run("solve", "12345", "--model", str(random_sudoku_model))
    assert bad.returncode == 2 and "bad puzzle" in bad.stderr and "Traceback" not in bad.stderr
    missing = run("eval", "--file", "/no/such/file")
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_shipped_model_solves_and_evaluates(tmp_path):
    assert (SHIPPED / "config.json").is_file() and (SHIPPED / "model.safetensors").is_file()
    proc = run("solve", "--no-live")
    assert proc.returncode in (0, 1), proc.stderr
    assert "denoising steps" in proc.stdout
    f = tmp_path / "p.txt"
    f.write_text("\n".join(S.grid_to_string(e.puzzle) for e in S.generate_examples(4, givens=(40, 45), seed=9)))
    proc = run("eval", "--file", str(f))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["total"] == 4


def test_shipped_models_and_their_training_records():
    """The diffusion model and its AR baseline ship as model folders; the records of their training say
    how each was made: stage 2 continued stage 1's step-4,750 weights with per-step symmetries, and the
    AR baseline is stage 1's recipe with the AR objective, stopped at step 1,500."""
    ar = ROOT / "dgemma" / "assets" / "sudoku-ar"
    for folder in (SHIPPED, ar):
        assert {"config.json", "generation_config.json", "model.safetensors"} <= {f.name for f in folder.iterdir()}
    assert dgemma.load_model(ar).config == dgemma.load_model(SHIPPED).config
    state = json.loads((RESULTS / "trainer_state.json").read_text())
    stage1 = json.loads((RESULTS / "trainer_state-stage1.json").read_text())
    baseline = json.loads((RESULTS / "trainer_state-ar.json").read_text())
    assert state["config"]["augment"] == "sudoku" and state["step"] == 3000
    assert state["config"]["model"].endswith(f"step-{stage1['step']:07d}/model") and stage1["step"] == 4750
    assert baseline["step"] == 1500 and baseline["config"]["objective"] == "ar"
    assert {k: v for k, v in baseline["config"].items() if k not in ("objective", "out", "until")} == {
        k: v for k, v in stage1["config"].items() if k not in ("objective", "out", "until")}


def test_search_flags_report_forwards_rounds_and_seconds(tmp_path, random_sudoku_model):
    """An untrained model never satisfies the rules checker, so every round and candidate runs."""
    f = tmp_path / "p.txt"
    f.write_text("\n".join(S.grid_to_string(e.puzzle) for e in S.generate_examples(2, givens=(30, 45), seed=6)))
    single = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--steps", "1")
    searched = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--steps", "1",
                   "--rounds", "3", "--candidates", "2")
    assert single.returncode == 0 and searched.returncode == 0, single.stderr + searched.stderr
    one, many = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (single, searched))
    assert one["forwards_per_puzzle"] == 1 and one["mean_rounds"] == 1 and one["seconds_per_puzzle"] > 0
    assert (many["rounds"], many["candidates"]) == (3, 2)
    assert many["forwards_per_puzzle"] == 1 * 3 * 2 and many["mean_rounds"] == 3
    assert many["verifier_accepted"] == 0 and many["solved"] == 0
    solve = run("solve", "--model", str(random_sudoku_model), "--no-live", "--steps", "2", "--rounds", "2")
    assert solve.returncode == 1, solve.stderr
    assert "denoised again in round 2" in solve.stdout and "not accepted in round 2" in solve.stdout
    bad = run("eval", "--file", str(f), "--model", str(random_sudoku_model), "--rounds", "0")
    assert bad.returncode == 2 and ">= 1" in bad.stderr and "Traceback" not in bad.stderr


def test_ar_without_model_is_the_shipped_ar_baseline(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(S.grid_to_string(e.puzzle) for e in S.generate_examples(3, givens=(40, 45), seed=9)))
    proc = run("eval", "--file", str(f), "--ar", "--candidates", "2")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"].endswith("sudoku-ar") and result["mode"] == "ar"
    # the diffusion model's encoder, decoded left to right, keeps under 10% of the givens; the baseline ~all
    assert result["givens_kept"] > 0.9
    assert 1 <= result["samples_per_puzzle"] <= 2 and result["forwards_per_puzzle"] == 81 * result["samples_per_puzzle"]
    solve = run("solve", "--ar", "--no-live")
    assert solve.returncode in (0, 1) and "left to right" in solve.stdout, solve.stderr
