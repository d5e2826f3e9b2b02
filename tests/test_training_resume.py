"""A training process killed with SIGKILL after a checkpoint resumes with `--resume` and ends exactly where
an uninterrupted run ends: same loss at every logged step, same weights.

    .venv/bin/python -m pytest tests/test_training_resume.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import dgemma

from conftest import torch_threads
from test_training import reversal_records, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 60, 20


def train_command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dgemma", "train", "--init", "preset:tiny", "--vocab-size", "16",
            "--set", "hidden_size=32", "--set", "num_layers=2", "--set", "canvas_length=8", "--data", str(data),
            "--out", str(out), "--steps", str(STEPS), "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "10",
            "--log-every", "5", "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "5", "--no-progress", *extra]


def subprocess_env() -> dict:
    # one thread each: the runs are compared number for number, and the machine is shared
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_killed_run_resumes_to_the_same_loss_curve_and_weights(tmp_path):
    data = write_jsonl(tmp_path / "task.jsonl", reversal_records(256))
    env = subprocess_env()

    # the uninterrupted reference runs alongside
    reference = tmp_path / "reference"
    ref_proc = subprocess.Popen(train_command(data, reference), cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    # the run to be killed: SIGKILL as soon as its first checkpoint is complete
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_command(data, killed), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = killed / "checkpoints" / f"step-{SAVE_EVERY:07d}"
    deadline = time.monotonic() + 120
    while not first.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert proc.returncode == -9, proc.stderr.read().decode()  # killed mid-run, not finished or crashed
    assert not (killed / "model").exists()
    # as if the kill had also hit a checkpoint being written: a partial folder must be ignored
    (killed / "checkpoints" / ".step-0000040.tmp").mkdir()
    (killed / "checkpoints" / ".step-0000040.tmp" / "optimizer.safetensors").write_bytes(b"partial")
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 999, "loss": 12')  # a line cut short by the kill

    assert ref_proc.wait() == 0, ref_proc.stderr.read().decode()
    resumed = subprocess.run(train_command(data, killed, "--resume"), cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert not (killed / "checkpoints" / ".step-0000040.tmp").exists()

    expected, got = losses(reference), losses(killed)
    assert sorted(got) == sorted(expected) == list(range(5, STEPS + 1, 5))  # no gap, no duplicate, no step 999
    for step in expected:
        assert abs(got[step] - expected[step]) < 1e-5, (step, got[step], expected[step])

    a, b = dgemma.load_model(killed / "model"), dgemma.load_model(reference / "model")
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6, rtol=0)


def test_a_checkpoint_write_that_fails_midway_loses_nothing(tmp_path, monkeypatch, capsys):
    """The disk fills while the second checkpoint is written (DCP's writer raises ENOSPC after its first tensor):
    `dgemma train` says so in one line and exits 2, the partial write is gone, the first checkpoint is whole, and
    `--resume` from it ends where an uninterrupted run ends, losses and weights."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_files

    from dgemma.cli import main
    from dgemma.training import distributed as D

    data = write_jsonl(tmp_path / "task.jsonl", reversal_records(64))

    def flags(out: Path, *extra: str) -> list[str]:  # `dgemma train ...`, run in this process
        return train_command(data, out, "--steps", "12", "--save-every", "4", "--log-every", "2", *extra)[3:]

    writes, saves = dcp_files._write_item, D.save_state
    saving: list[str] = []  # the folder being written, and one entry per tensor written into it

    def save_state(folder, *args, **kwargs):
        saving[:] = [str(folder)]
        return saves(folder, *args, **kwargs)

    def disk_full(*args, **kwargs):
        saving.append("tensor")
        if ".step-0000008." in saving[0] and len(saving) > 2:  # one tensor of step 8 written, then no space
            raise OSError(errno.ENOSPC, "No space left on device")
        return writes(*args, **kwargs)

    with torch_threads(1):
        assert main(flags(tmp_path / "reference")) == 0
        run = tmp_path / "full-disk"
        with monkeypatch.context() as patch:
            patch.setattr(D, "save_state", save_state)
            patch.setattr(dcp_files, "_write_item", disk_full)
            capsys.readouterr()
            assert main(flags(run)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == ("dgemma train: error: writing the checkpoint of step 8 failed ([Errno 28] No space left on "
                           "device); step-0000004 is intact: --resume continues from it"), err
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000004"]  # the partial write is gone
        assert main(flags(run, "--resume")) == 0
    expected, got = losses(tmp_path / "reference"), losses(run)
    assert sorted(got) == sorted(expected) == list(range(2, 13, 2))
    for step in expected:
        assert abs(got[step] - expected[step]) < 1e-6, (step, got[step], expected[step])
    a, b = dgemma.load_model(run / "model"), dgemma.load_model(tmp_path / "reference" / "model")
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
