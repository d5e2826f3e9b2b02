"""Two CPU processes under torchrun (FSDP2, gloo) train exactly like one process with the same global
batch: same loss at every step, same final weights.

    .venv/bin/python -m pytest tests/test_training_distributed.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import dgemma

from test_training import reversal_records, write_jsonl
from test_training_resume import ROOT, subprocess_env


def run_args(data, out) -> list[str]:
    return ["-m", "dgemma", "train", "--init", "preset:tiny", "--vocab-size", "16", "--set", "hidden_size=32",
            "--set", "num_layers=2", "--set", "canvas_length=8", "--data", str(data), "--out", str(out),
            "--steps", "8", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2", "--log-every", "1",
            "--save-every", "8", "--no-progress"]


def test_two_process_fsdp_matches_one_process(tmp_path):
    data = write_jsonl(tmp_path / "task.jsonl", reversal_records(128))
    env = subprocess_env()
    # global batch 4: one process, 2 micro-batches of 2 | two processes, 2 micro-batches of 1 each.
    # One example per forward means the processes' self-conditioning coins often disagree: the passes
    # they run must not (FSDP gathers weights collectively).
    single = subprocess.Popen([sys.executable, *run_args(data, tmp_path / "one"), "--micro-batch-size", "2"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             *run_args(data, tmp_path / "two"), "--micro-batch-size", "1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert double.returncode == 0, double.stderr[-3000:]
    assert "2 process(es) on cpu" in double.stderr
    assert single.wait() == 0, single.stderr.read()

    def losses(name):
        return [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())]

    one, two = losses("one"), losses("two")
    assert len(one) == len(two) == 8
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)
    assert one[-1] < one[0]  # it trained
    a, b = dgemma.load_model(tmp_path / "one" / "model"), dgemma.load_model(tmp_path / "two" / "model")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-4, rtol=0), name
