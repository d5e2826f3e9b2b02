"""The routed experts of an int4 model on OpenVINO's CPU kernels (`pip install 'dgemma[cpu-kernels]'`).

Measured on the 26B-A4B's expert shapes (`benchmarks/cpu_kernels.py`), OpenVINO's int4 fully connected layer
with dynamic int8 quantisation of its activations (groups of 32) was 2.5-3x torch's int4 kernel at an
expert's ~16 rows of a canvas, and a whole MoE layer of 256 tokens ran 2.6x faster; onnxruntime's
MatMulNBits and QMoE, kt-kernel and torchao were slower or could not run Gemma's experts (the table in
benchmarks/README.md). So where it is installed, int8 compute on a CPU (`dgemma.quant.int8_compute`)
runs each layer's experts as one OpenVINO graph:

    x (R, H) bf16: the (token, choice) entries sorted by expert;  offsets (E + 1,) int64: where each starts
    for expert e: rows x[offsets[e] : offsets[e + 1]]
        -> int4 gate|up (2I, H), group scales: FullyConnectedCompressed -> gelu_tanh(gate) * up
        -> int4 down (H, I): FullyConnectedCompressed
    y (R, H) bf16: the experts' outputs, in the same order

The codes are dgemma's (two's-complement nibbles, `quant.quantize_tensor`), handed over without the zero
point the stored format carries. Tensors cross as views of torch's buffers (input, offsets, output: no
copies). OpenVINO repacks the weights when it first runs them, into its own memory: the experts' int4 bytes
again and ~15-40% more (the module keeps its own codes for every other path); `enable` declines where the
machine has not that much memory available. Few entries (AR decoding: 8 of them) stay on torch's path,
where the graph's per-expert cost (all E experts run, most on no rows) does not pay.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

GROUP = 32
# Entries (token, choice) from which a layer runs on OpenVINO rather than torch's int4 kernel. Measured with
# `python benchmarks/cpu_kernels.py --moe` at the 26B's shape, 1 thread: at 1 token (8 entries) the graph took
# 0.74x torch's speed (its 128 experts all run, 120 on no rows), at 4 tokens (32 entries) 1.8x, at 256 3.0x.
MIN_ENTRIES = 32
# OpenVINO's own copy of the experts, as a share of their int4 bytes (measured 1.15-1.43x at the 26B's shape)
MEMORY_FACTOR = 1.45


def unavailable() -> str | None:
    """Why the OpenVINO experts cannot run here, or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (pip install 'dgemma[cpu-kernels]')"
    return None


def applies(module: nn.Module) -> bool:
    """An int4 QuantExperts whose widths are whole groups of 32."""
    if getattr(module, "fmt", None) != "int4" or not hasattr(module, "gate_up_proj_q"):
        return False
    _, two_i, half_h = module.gate_up_proj_q.shape
    return (2 * half_h) % GROUP == 0 and (two_i // 2) % GROUP == 0


def plain_codes(q: torch.Tensor, kernel: bool):
    """One expert's codes (N, K/2) -> a (N, K/2) uint8 numpy array with column 2c in the low nibble, 2c + 1 in
    the high one, each the signed 4-bit value (two's complement). `kernel`: read from the layout of torch's
    CPU int4 kernel (blocks of 64 rows stored (K, 32), byte [k, j] = rows j (low) and j + 32 (high) of column
    k: see `int8_compute.Int4Widener`), else from dgemma's (value + 8 per nibble). In numpy: its uint8 bit
    operations are ~100x torch's here."""
    import numpy as np

    codes = q.numpy()
    if kernel:
        N, half = codes.shape
        pairs = codes.reshape(N // 64, half, 2, 32)  # (block, column pair, even / odd column, row in half-block)
        even, odd = pairs[:, :, 0], pairs[:, :, 1]
        plain = np.empty((N // 64, 64, half), np.uint8)
        plain[:, :32] = ((even & np.uint8(15)) | ((odd & np.uint8(15)) << np.uint8(4))).transpose(0, 2, 1)
        plain[:, 32:] = ((even >> np.uint8(4)) | (odd & np.uint8(0xF0))).transpose(0, 2, 1)
        codes = plain.reshape(N, half)
    return codes ^ np.uint8(0x88)  # value + 8 -> value, in each nibble


def plain_scales(scales: torch.Tensor, kernel: bool) -> torch.Tensor:
    """One expert's scales -> (N, K/32) fp16 (the kernel layout keeps (K/32, N, 2) scale and zero)."""
    return (scales[..., 0].t() if kernel else scales).to(torch.float16).contiguous()


class OpenVinoExperts:
    """One compiled OpenVINO graph for a QuantExperts' E experts (see the module docstring)."""

    def __init__(self, module: nn.Module, threads: int):
        import numpy as np
        import openvino as ov
        import openvino.opset13 as ops

        E, _, half_h = module.gate_up_proj_q.shape
        H = 2 * half_h
        kernel = bool(module.kernel_layout)
        x = ops.parameter([-1, H], ov.Type.bf16, name="x")
        offsets = ops.parameter([E + 1], ov.Type.i64, name="offsets")
        rows = ops.convert(x, ov.Type.f32)
        keep = []  # the arrays the constants read, alive until the first run has repacked them

        def fully_connected(inputs, name: str, e: int):
            q, scales = getattr(module, f"{name}_q")[e], getattr(module, f"{name}_scales")[e]
            codes, s = plain_codes(q, kernel), plain_scales(scales, kernel).numpy()
            N, G = s.shape
            keep.extend((codes, s))
            w = ops.constant(ov.Tensor(codes, ov.Shape([N, G, GROUP]), ov.Type.i4), shared_memory=True)
            w = ops.multiply(ops.convert(w, ov.Type.f16), ops.constant(ov.Tensor(s.reshape(N, G, 1)), shared_memory=True))
            w = ops.convert(ops.reshape(w, ops.constant(np.array([N, G * GROUP], dtype=np.int64)), False), ov.Type.f32)
            return ops.matmul(inputs, w, False, True)

        def index(i: int):
            return ops.constant(np.array([i], dtype=np.int64))

        outputs = []
        for e in range(E):
            start = ops.slice(offsets, index(e), index(e + 1), index(1))
            stop = ops.slice(offsets, index(e + 1), index(e + 2), index(1))
            gate, up = ops.split(fully_connected(ops.slice(rows, start, stop, index(1), index(0)), "gate_up_proj", e),
                                 ops.constant(np.int64(1)), 2).outputs()
            outputs.append(fully_connected(ops.multiply(ops.gelu(gate, "tanh"), up), "down_proj", e))
        y = ops.convert(ops.concat(outputs, 0), ov.Type.bf16)
        compiled = ov.Core().compile_model(ov.Model([y], [x, offsets], "experts"), "CPU", {
            "INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": GROUP, "INFERENCE_PRECISION_HINT": "bf16"})
        self._ov, self.request, self.num_experts, self.hidden = ov, compiled.create_infer_request(), E, H
        self(torch.zeros(E, H, dtype=torch.bfloat16), [1] * E)  # repacks the weights: `keep` can go
        keep.clear()

    def __call__(self, grouped_x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """grouped_x (R, H), rows sorted by expert (counts[e] rows each) -> the experts' outputs (R, H)."""
        ov = self._ov
        x = grouped_x.to(torch.bfloat16).contiguous()
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        out = torch.empty_like(x)
        self.request.set_input_tensor(0, ov.Tensor(x.view(torch.int16).numpy(), ov.Shape(list(x.shape)), ov.Type.bf16))
        self.request.set_input_tensor(1, ov.Tensor(offsets.numpy(), shared_memory=True))
        self.request.set_output_tensor(ov.Tensor(out.view(torch.int16).numpy(), ov.Shape(list(out.shape)), ov.Type.bf16))
        self.request.infer()
        return out.to(grouped_x.dtype)

    @staticmethod
    def runs(entries: int) -> bool:
        return entries >= MIN_ENTRIES


def expert_bytes(model: nn.Module) -> int:
    """The int4 codes and scales of every QuantExperts the OpenVINO graphs would take."""
    return sum(t.numel() * t.element_size() for m in model.modules() if applies(m)
               for t in (m.gate_up_proj_q, m.down_proj_q, m.gate_up_proj_scales, m.down_proj_scales))
