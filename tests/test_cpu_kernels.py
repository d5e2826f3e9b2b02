"""Routed experts on OpenVINO's int4 x int8 kernels (dgemma.quant.openvino, the cpu-kernels extra):
the codes it is handed, its products against the fp32 product of the dequantised weights, a whole model's
logits against torch's path, and what `dgemma bench` reports as run."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import dgemma
from dgemma import devices
from dgemma.quant import int8_compute, kernels
from dgemma.quant import openvino as openvino_experts
from dgemma.quant import quantize as quant
from dgemma.quant.quantize import quantize_model, use_cpu_int4_kernel

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="openvino is not installed (pip install 'dgemma[cpu-kernels]')")


def _tiny_int4(dtype, seed=0):
    torch.manual_seed(seed)
    model = quantize_model(dgemma.DiffusionGemma(dgemma.get_preset("tiny")).to(dtype).eval(), "int4")
    use_cpu_int4_kernel(model)  # bf16: torch's kernel layout, which the graphs read back
    return model


@pytest.mark.parametrize("kernel", [False, True])
def test_codes_are_handed_over_as_signed_nibbles(kernel):
    """Whichever layout the module holds (dgemma's, or torch's int4 kernel's as AVX-512 packs it), OpenVINO gets
    (N, K/2) bytes: column 2c in the low nibble, 2c + 1 in the high one, the signed value in two's complement."""
    if kernel and not devices.int4_kernel_layout_known(128):
        pytest.skip("torch packs its int4 kernel's layout this way on AVX-512 CPUs only")
    w = torch.randn(128, 96) * 0.02
    q, scales = quant.quantize_tensor(w, "int4")
    if kernel:
        q, scales = quant._to_kernel_layout(q, scales, torch.bfloat16)
    codes = torch.from_numpy(openvino_experts.plain_codes(q, kernel))
    low, high = (codes & 15).to(torch.int8), (codes >> 4).to(torch.int8)
    values = torch.stack([low - 16 * (low > 7), high - 16 * (high > 7)], dim=-1).flatten(-2)  # (128, 96)
    dense = values.float().view(128, 3, 32) * openvino_experts.plain_scales(scales, kernel).float()[..., None]
    reference = quant.dequantize_tensor(*quant.quantize_tensor(w, "int4"), "int4", torch.float32)
    assert torch.allclose(dense.view(128, 96), reference, rtol=2**-7, atol=0)  # kernel scales are bf16


@needs_openvino
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_experts_match_the_dequantised_product(dtype):
    """One layer's experts over grouped entries, some experts given no rows: cosine >= 0.999 against the fp32
    product of the dequantised weights (int8 activations in groups of 32), as torch's path gets."""
    model = _tiny_int4(dtype)
    assert int8_compute.enable(model, "on", library="openvino")
    experts = model.layers[1].experts
    assert experts.library is not None
    g = torch.Generator().manual_seed(3)
    counts = [20, 0, 13, 7]
    grouped = torch.randn(sum(counts), 64, generator=g).to(dtype)
    out = experts.library(grouped, counts).float()
    reference, start = torch.empty_like(out), 0
    for e, n in enumerate(counts):
        gate_up, down = (w.float() for w in experts.expert_weights(e))
        reference[start : start + n] = F.linear(F.gelu(F.linear(grouped[start : start + n].float(), gate_up)
                                                       .chunk(2, -1)[0], approximate="tanh")
                                                * F.linear(grouped[start : start + n].float(), gate_up).chunk(2, -1)[1], down)
        start += n
    assert F.cosine_similarity(out, reference, dim=-1).min() >= 0.999
    assert (out - reference).abs().max() <= 0.03 * reference.abs().max()


@needs_openvino
@torch.no_grad()
def test_sudoku_logits_agree_with_torchs_kernels(monkeypatch):
    """The shipped sudoku model in int4 (trained routers: a random model's flip on any rounding) over 8 puzzles:
    a denoising step (1,296 entries: the graphs run) against torch's int4 kernels, both against the float
    model: the library's logits as close to it as torch's (mean cosine within 0.001, argmax agreement within a
    point; int4 itself costs more here: cosine 0.996, 94% of the argmaxes of these random canvases). An
    AR-sized call (few entries) stays on torch's path."""
    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.tasks import sudoku

    puzzles = [e.puzzle for e in sudoku.generate_examples(8, seed=4)]
    prompt = torch.tensor([sudoku.encode_prompt(p) for p in puzzles])
    canvas = torch.randint(0, 16, (8, 81), generator=torch.Generator().manual_seed(5))
    reference = dgemma.load_model(SHIPPED, dtype=torch.float32)
    torch_path = dgemma.load_model(SHIPPED, dtype=torch.bfloat16, quantize="int4")
    library = copy.deepcopy(torch_path)
    assert int8_compute.enable(torch_path, "on", library="torch") and torch_path.layers[0].experts.library is None
    assert int8_compute.enable(library, "on", library="openvino") and library.layers[0].experts.library is not None
    logits = []
    for model in (reference, torch_path, library):
        cache = model.new_cache(8, 96)
        model.encode(prompt, cache, return_logits=False)
        logits.append(model.denoise(canvas, cache).float().flatten(0, 1))
    cos = [F.cosine_similarity(logits[0], other, dim=-1).mean() for other in logits[1:]]
    agree = [(logits[0].argmax(-1) == other.argmax(-1)).float().mean() for other in logits[1:]]
    assert cos[1] >= cos[0] - 0.001 and agree[1] >= agree[0] - 0.01, (cos, agree)
    calls = []
    monkeypatch.setattr(openvino_experts.OpenVinoExperts, "__call__", lambda self, *a: calls.append(a))
    library.encode(prompt[:1, :2], library.new_cache(1, 8))  # 2 tokens, top-2: 4 entries
    assert not calls


@needs_openvino
def test_bench_reports_the_kernels_that_ran(monkeypatch):
    """What `dgemma bench` prints: OpenVINO for a canvas's experts, torch's int4 kernel for an AR token's; the
    projections in int8 at a canvas's rows where the weights are large enough to repay widening."""
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on", library="openvino")
    canvas, token = kernels.kernels(model, 256), kernels.kernels(model, 1)
    assert canvas["experts"].startswith("OpenVINO") and token["experts"].startswith("torch int4")
    assert canvas["projections"].startswith("torch int4")  # 64 x 96 weights: widening does not pay
    monkeypatch.setattr(int8_compute, "MIN_WEIGHTS_TO_WIDEN", 1)
    assert kernels.kernels(model, 256)["projections"].startswith("int8 x int8")
    assert canvas["head"] == "bfloat16 matmul"  # the tiny table is below int8_compute.MIN_TABLE_ENTRIES


def test_unknown_library_is_refused():
    with pytest.raises(ValueError, match="openvino"):
        int8_compute.enable(_tiny_int4(torch.float32), "on", library="onnx")
