"""dgemma.devices: the one bf16 rule and the defaults built on it, played on other machines by monkeypatching
the probes (CUDA with bf16, an AVX-512 CPU with oneDNN's bf16 kernels, an AVX2 CPU without)."""

from __future__ import annotations

import pytest
import torch

from dgemma import devices


@pytest.mark.parametrize("cuda_bf16, cpu_bf16", [(True, True), (True, False), (False, False)])
def test_the_default_dtype_is_bf16_only_where_native_and_on_a_cpu_from_256_wide(monkeypatch, cuda_bf16, cpu_bf16):
    monkeypatch.setattr(devices, "_cuda_bf16", lambda: cuda_bf16)
    monkeypatch.setattr(devices, "_cpu_bf16", lambda: cpu_bf16)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert devices.native_bf16("cuda:1") == cuda_bf16 and devices.native_bf16(torch.device("cpu")) == cpu_bf16
    assert not devices.native_bf16("meta")
    assert devices.default_dtype("cuda", 64) == (bf16 if cuda_bf16 else fp32)  # no width rule on a GPU
    assert devices.default_dtype("cpu", 256) == (bf16 if cpu_bf16 else fp32)
    assert devices.default_dtype("cpu", 255) == fp32 and devices.default_dtype("cpu", None) == fp32


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
