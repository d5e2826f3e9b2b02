"""`dgemma info` and the CLI surface."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def dgemma(*args):
    return subprocess.run([sys.executable, "-m", "dgemma", *args], capture_output=True, text=True)


def test_help_lists_commands():
    proc = dgemma("--help")
    assert proc.returncode == 0
    assert "info" in proc.stdout


def test_info_preset_matches_published_counts():
    proc = dgemma("info", "--preset", "diffusiongemma-26b-a4b")
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 25.2e9 <= last["total_params"] < 25.3e9  # published: 25.2B total
    assert round(last["active_params"] / 1e9, 1) == 3.8  # published: 3.8B active
    wb = last["weight_bytes"]
    assert wb["bf16"] > wb["int8"] > wb["int4"]
    assert abs(wb["bf16"] - 2 * last["total_params"]) < 1e6


def test_info_memory_model_int4_fits_16gb():
    proc = dgemma("info", "--preset", "diffusiongemma-26b-a4b", "--quantize", "int4", "--batch", "8")
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["memory"]["weight_bytes"] < 16e9
    assert last["memory"]["sampler_buffer_bytes"] == 8 * 256 * 262144 * 4


def test_info_model_folder(hf_checkpoints):
    folder, hf = hf_checkpoints["alternating"]
    proc = dgemma("info", "--model", str(folder))
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    # every stored text tensor of the tied backbone, counted once (vision tower and buffers excluded)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape())
                     for k in f.keys() if k.startswith("model.decoder.") and not k.endswith("layer_scalar"))
    assert last["total_params"] == stored
    # the vision tower and its projection, apart: every parameter (buffers are not parameters)
    vision = sum(p.numel() for name, p in hf.named_parameters() if "vision" in name)
    assert last["vision_params"] == vision > 0 and "vision tower" in proc.stdout
    assert last["weight_bytes"]["bf16"] == 2 * (stored + vision)


def test_info_bad_preset():
    proc = dgemma("info", "--preset", "nope")
    assert proc.returncode == 2 and "unknown preset" in proc.stderr and "Traceback" not in proc.stderr
