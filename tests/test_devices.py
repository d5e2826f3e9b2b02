"""dgemma.devices: the one bf16 rule and the default dtype built on it, played on other machines by
monkeypatching what it asks (oneDNN, the CPU's instruction sets, the measured bf16/fp32 rate, CUDA)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dgemma import devices

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def play_cpu(monkeypatch, tmp_path):
    """play_cpu(onednn_bf16, flags, measured) makes this process's CPU one of another class, with its probe
    cache in tmp_path; returns the list of the probe's measurements it takes from then on. The memoised answers are dropped before
    and after, so nothing played leaks into another test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def play(onednn_bf16: bool, flags: set[str], measured: float | None = None):
        measured_calls = []
        monkeypatch.setattr(devices, "onednn_runs_bf16", lambda: onednn_bf16)
        monkeypatch.setattr(devices, "cpu_info", lambda: ("Played CPU", frozenset(flags)))

        def measure():
            assert measured is not None, "this class is decided without measuring"
            measured_calls.append(measured)
            return measured

        monkeypatch.setattr(devices, "_measure_bf16_per_fp32", measure)
        _forget()
        return measured_calls

    _forget()
    yield play
    _forget()


def _forget():
    devices._cpu_fast_bf16.cache_clear()
    devices.cpu_bf16_per_fp32.cache_clear()


AVX2 = {"avx2", "fma"}
AVX512_VNNI = AVX2 | {"avx512f", "avx512_vnni"}  # Skylake-SP, Cascade Lake, Ice Lake
AVX512_BF16 = AVX512_VNNI | {"avx512_bf16"}  # Cooper Lake; AMD Zen 4 and 5
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}  # Sapphire Rapids and later


@pytest.mark.parametrize("onednn, flags, measured, fast, why", [
    (False, AVX2, None, False, "no oneDNN bf16 kernels"),
    (True, AVX512_VNNI, None, False, "no bf16 instructions"),  # oneDNN converts: decided without measuring
    (True, AVX512_BF16, 0.7, False, "0.70x fp32's rate, measured"),
    (True, AVX512_BF16, 1.6, True, "1.60x fp32's rate, measured"),
    (True, AMX, 6.0, True, "6.00x"),
    (True, AMX, 0.3, False, "0.30x"),  # oneDNN capped below AMX (ONEDNN_MAX_CPU_ISA): the measurement tells
    (True, {"fp", "asimd", "sve", "bf16"}, 2.0, True, "2.00x"),  # Arm with BF16 (Neoverse V1 and later)
    (True, {"fp", "asimd"}, None, False, "no bf16 instructions"),
    (True, set(), 1.2, True, "1.20x"),  # no /proc/cpuinfo (not Linux): measured
])
def test_each_cpu_class_gets_the_dtype_its_bf16_speed_earns(play_cpu, onednn, flags, measured, fast, why):
    probes = play_cpu(onednn, flags, measured)
    verdict = devices.fast_bf16("cpu")
    assert bool(verdict) == fast and why in str(verdict)
    assert bool(devices.fast_bf16(torch.device("cpu"))) == fast and probes == ([measured] if measured else [])
    choice = devices.default_dtype("cpu", 256)
    assert choice.dtype == (BF16 if fast else FP32) and choice.why == verdict.why
    assert str(choice) == f"{'bf16' if fast else 'fp32'} ({verdict.why})"  # what the start lines print
    assert devices.default_dtype("cpu", None, training=True).dtype == choice.dtype


def test_a_narrow_model_runs_fp32_on_a_cpu_and_is_never_measured(play_cpu):
    """Below CPU_BF16_MIN_HIDDEN a denoising step gains nothing from bf16 even with AMX: fp32, and the
    probe is not run for it (the tests' tiny models start without measuring anything)."""
    probes = play_cpu(True, AMX, 6.0)
    assert devices.default_dtype("cpu", 255) == devices.DtypeChoice(FP32, "a model 255 wide: on a CPU, bf16 "
                                                                            "pays from 256 wide")
    assert devices.default_dtype("cpu", None).dtype == FP32 and probes == []
    assert devices.default_dtype("cpu", 64, training=True).dtype == BF16  # a training step: thousands of rows


@pytest.mark.parametrize("onednn, flags, measured, dtype", [
    (True, AVX512_VNNI, None, BF16),  # slow bf16 matmuls, but the int4 kernel's activations
    (True, AMX, 6.0, BF16),
    (False, AVX2, None, FP32),  # a bf16 matmul there takes ATen's fallback: the dense parts would crawl
])
def test_an_int4_model_takes_bf16_where_torchs_int4_kernel_runs(play_cpu, monkeypatch, onednn, flags, measured, dtype):
    """torch's CPU int4 kernel runs nearly all of an int4 model's products and takes fp32 activations ~100x
    slower than bf16 ones: on an AVX-512 CPU an int4 model runs bf16 even where bf16 matmuls are slow."""
    play_cpu(onednn, flags, measured)
    monkeypatch.setattr(devices, "has_cpu_int4_kernel", lambda: True)
    choice = devices.default_dtype("cpu", 2816, quantize="int4")
    assert choice.dtype == dtype and ("int4 kernel" in choice.why) == (flags == AVX512_VNNI)
    assert devices.default_dtype("cpu", 2816, quantize="int8").dtype == devices.default_dtype("cpu", 2816).dtype
    assert devices.default_dtype("cpu", 128, quantize="int4").dtype == FP32  # the width rule first
    monkeypatch.setattr(devices, "has_cpu_int4_kernel", lambda: False)
    assert devices.default_dtype("cpu", 2816, quantize="int4").dtype == (BF16 if flags == AMX else FP32)


@pytest.mark.parametrize("cuda_bf16", [True, False])
def test_cuda_takes_bf16_where_torch_runs_it_at_any_width(monkeypatch, cuda_bf16):
    monkeypatch.setattr(devices, "_cuda_bf16", lambda: cuda_bf16)
    assert bool(devices.fast_bf16("cuda:1")) == cuda_bf16
    assert devices.default_dtype("cuda", 64).dtype == (BF16 if cuda_bf16 else FP32)  # no width rule on a GPU
    assert not devices.fast_bf16("meta") and devices.default_dtype("meta", 4096).dtype == FP32


def test_the_measurement_is_kept_per_cpu_torch_and_caps(play_cpu, monkeypatch, tmp_path):
    """Measured once per CPU, torch version and kernel caps, in the user's cache folder: a second process
    reads it (the same dtype, so the same tokens for a seed); a capped oneDNN is another key; a broken file
    is measured again and rewritten; an unwritable folder still gets its answer."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    probes = play_cpu(True, AMX, 6.0)
    assert devices.fast_bf16("cpu") and probes == [6.0]
    path = tmp_path / "dgemma" / "cpu-bf16.json"
    assert json.loads(path.read_text()) == {f"Played CPU | torch {torch.__version__} | no caps": 6.0}
    _forget()  # a second process
    assert devices.fast_bf16("cpu") and probes == [6.0]

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    probes = play_cpu(True, AMX, 0.31)
    assert not devices.fast_bf16("cpu") and probes == [0.31]
    assert len(json.loads(path.read_text())) == 2 and not list(path.parent.glob("*.json.*"))

    path.write_text("{not json")
    probes = play_cpu(True, AMX, 0.25)
    assert "0.25x" in str(devices.fast_bf16("cpu")) and probes == [0.25]
    assert list(json.loads(path.read_text()).values()) == [0.25]

    path.unlink()
    path.parent.chmod(0o500)
    try:
        probes = play_cpu(True, AMX, 5.0)
        assert devices.fast_bf16("cpu") and probes == [5.0]
    finally:
        path.parent.chmod(0o700)


def test_the_probe_is_short_and_reads_what_onednn_runs():
    """The real measurement, in this process: a rate ratio, in well under a second (its budget is ~0.1 s;
    the bound leaves room for a loaded machine)."""
    if not devices.onednn_runs_bf16():
        pytest.skip("oneDNN runs no bf16 here: the rule decides without measuring")
    start = time.perf_counter()
    ratio = devices._measure_bf16_per_fp32()
    assert 0 < ratio < 100 and time.perf_counter() - start < 3


@pytest.mark.skipif("amx_bf16" not in devices.cpu_info()[1], reason="needs a CPU with AMX-BF16")
def test_the_probe_honours_a_onednn_cap_which_the_flags_do_not_show():
    """On an AMX CPU, oneDNN capped at AVX-512 VNNI (no bf16 instructions) converts bf16 inside its kernels:
    the measurement sees bf16 slower than fp32 (measured ~0.2-0.45x), where the flags still list AMX
    (measured 5-15x uncapped)."""
    def measured(cap: str | None) -> float:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        code = "from dgemma import devices; print(devices._measure_bf16_per_fp32())"
        proc = subprocess.run([sys.executable, "-c", code], env={**env, **({"ONEDNN_MAX_CPU_ISA": cap} if cap else {})},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return float(proc.stdout)

    assert measured(None) > 2 and measured("AVX512_CORE_VNNI") < 0.8


def test_every_command_takes_its_default_dtype_from_dgemma_devices(monkeypatch):
    """generate, chat and serve (`load_from_args`), bench --dtype auto, sudoku and train --precision auto all
    ask `devices.default_dtype` for the model they run, and an explicit flag says so as its reason."""
    from dgemma.commands._common import resolve_device_dtype
    from dgemma.training import distributed
    from dgemma.weights import checkpoint
    from dgemma.training.config import TrainConfig
    from dgemma.training.loop import _resolved_precision

    asked = []

    def played(device, hidden_size, *, quantize=None, training=False):
        asked.append((str(device), hidden_size, quantize, training))
        return devices.DtypeChoice(BF16, "played")

    monkeypatch.setattr(devices, "default_dtype", played)
    monkeypatch.setattr(checkpoint, "model_shape", lambda path, quantize: (384 if path == "wide" else None, quantize))

    generate = argparse.Namespace(device="cpu", dtype=None, model="wide", quantize="int4")
    assert resolve_device_dtype(generate) == ("cpu", devices.DtypeChoice(BF16, "played"))
    assert resolve_device_dtype(argparse.Namespace(**{**vars(generate), "dtype": "fp32"}))[1] == \
        devices.DtypeChoice(FP32, "--dtype fp32")
    benched = argparse.Namespace(device="cpu", dtype="auto", model=None, config="bench-20m", quantize=None)
    assert resolve_device_dtype(benched)[1].why == "played"  # a preset's width, random weights
    assert resolve_device_dtype(argparse.Namespace(**{**vars(benched), "dtype": "bf16"}))[1] == \
        devices.DtypeChoice(BF16, "--dtype bf16")
    lines = []
    config = _resolved_precision(TrainConfig(data="x", out="y", precision="auto"), distributed.DistEnv(), lines.append)
    assert config.precision == "bf16" and lines == ["precision: bf16 (--precision auto: played)"]
    assert asked == [("cpu", 384, "int4", False), ("cpu", 256, None, False), ("cpu", None, None, True)]


def test_sudoku_takes_its_dtype_from_dgemma_devices(monkeypatch, capsys):
    from dgemma import cli
    from dgemma.weights import hub

    asked, loaded = [], []

    def played(device, hidden_size, *, quantize=None, training=False):
        asked.append((device, hidden_size))
        return devices.DtypeChoice(BF16, "played")

    load_model = hub.load_model
    monkeypatch.setattr(devices, "default_dtype", played)
    monkeypatch.setattr(hub, "load_model", lambda *a, **k: loaded.append(k["dtype"]) or load_model(*a, **k))
    assert cli.main(["sudoku", "solve", "--no-live", "--eager", "--steps", "2", "--rounds", "1"]) in (0, 1)
    assert loaded == [BF16] and asked == [("cpu", 128)] and "dtype: bf16 (played)" in capsys.readouterr().err


def test_auto_is_cuda_where_torch_sees_one_and_a_missing_gpu_is_one_line(monkeypatch, tiny_model_dir, capsys):
    from dgemma.cli import main

    for seen in (True, False):
        monkeypatch.setattr(devices, "cuda_available", lambda seen=seen: seen)
        assert devices.resolve_device("auto") == ("cuda" if seen else "cpu")
        assert devices.resolve_device("cpu") == "cpu"
    with pytest.raises(devices.DeviceError, match="--device cuda:1 asked for, but torch sees no CUDA device"):
        devices.resolve_device("cuda:1")
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "dgemma generate: error: --device cuda asked for, but torch sees no CUDA device\n"
