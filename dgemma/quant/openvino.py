"""int4 weights on OpenVINO's CPU kernels (`pip install 'dgemma[cpu-kernels]'`), holding the only copy.

Measured at the 26B-A4B's shapes (`benchmarks/cpu_kernels.py`, benchmarks/README.md), OpenVINO's int4 fully
connected layer (FullyConnectedCompressed) is several times torch's int4 kernel at a canvas's rows: an
expert's ~16 rows, the 256 rows of an attention projection or a dense MLP; torch's kernel is the faster at
one row. So where it is installed, integer compute on a CPU (`dgemma.quant.int8_compute.enable`) hands
the int4 weights to it, part by part (`parts`), as compiled graphs:

  routed experts (`LibraryExperts`), one graph per layer:
    x (R, H): the (token, choice) entries sorted by expert;  offsets (E + 1,) int64: where each starts
    for expert e: rows x[offsets[e] : offsets[e + 1]]
        -> int4 gate|up (2I, H), group scales -> gelu_tanh(gate) * up -> int4 down (H, I)
    y (R, H): the experts' outputs, in the same order
  a linear layer (`LibraryLinear`: attention projections, dense MLPs), one graph each: x (M, K) -> (M, N)

The codes are dgemma's (two's-complement nibbles, `quantize.quantize_tensor`, or read back from torch's int4
kernel layout), handed over without the zero point the stored format carries. Activations cross as views
of torch's buffers (input, offsets, output: no copies), in the model's dtype (bf16 or fp32; the products
run in bf16 either way).

One copy: OpenVINO repacks the weights into its own memory when a graph first runs, so each graph runs once
at hand-over on one row per expert (every fully connected layer repacks), and then the module's own codes
and scales are released (`release`): its buffers become meta tensors, shapes without storage. From then on
the library's copy is the only one: every row count runs on it (an AR token too), and a path that needs
dgemma's codes (dequantising, saving, LoRA on the weights, the torch kernels) raises `WeightsInLibrary`,
one line that says how to get a model that has them (load it with the torch kernels).

OpenVINO's copy costs ~1.5x the int4 codes and fp16 scales it replaces (measured on one 26B layer's experts:
612 MiB for 408 MiB): the codes, each group's scale as fp32 twice (a converted constant and the kernel's
transposed copy), and ~0.2 MiB per fully connected layer of kernels and buffers; neither the scale dtype
handed over, signed or unsigned codes, their alignment, nor the runtime cache's capacity changes it
(`benchmarks/README.md`). `MEMORY_FACTOR` is what `enable` checks against the memory available.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

GROUP = 32
# OpenVINO's copy as a share of the int4 codes and scales it replaces (1.50x measured on a 26B layer's
# experts, per fully connected layer ~0.2 MiB on top), with a margin
MEMORY_FACTOR = 1.6
# Linear layers from this many weights go to the library; smaller ones keep dgemma's path, where a graph call's
# fixed cost (~40 us) is more than the product (bench-20m's 256 x 256 layers)
MIN_LINEAR_WEIGHTS = 1 << 20
PARTS = ("experts", "linears")


class WeightsInLibrary(ValueError):
    """A path that needs dgemma's int4 codes on a module whose only copy is OpenVINO's."""


def unavailable() -> str | None:
    """Why the OpenVINO kernels cannot run here, or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (pip install 'dgemma[cpu-kernels]')"
    return None


def _readable(module: nn.Module, names: tuple[str, ...]) -> bool:
    """int4 codes in a layout `plain_codes` reads, widths whole groups of 32."""
    from dgemma import devices

    if getattr(module, "fmt", None) != "int4" or getattr(module, "weights_in_library", False):
        return False
    for name in names:
        q = getattr(module, name)
        rows, half = q.shape[-2:]
        if (2 * half) % GROUP or (module.kernel_layout and not devices.int4_kernel_layout_known(rows)):
            return False
    return True


def takes(module: nn.Module, everything: bool = False) -> str | None:
    """Which part a module is, if the library takes it: "experts" (a QuantExperts), "linears" (a QuantLinear
    of at least MIN_LINEAR_WEIGHTS weights, or any size with `everything`), else None."""
    from dgemma.quant.quantize import QuantExperts, QuantLinear

    if type(module) is QuantExperts and _readable(module, ("gate_up_proj_q", "down_proj_q")):
        return "experts"
    if type(module) is QuantLinear and _readable(module, ("qweight",)) and \
            (everything or module.in_features * module.out_features >= MIN_LINEAR_WEIGHTS):
        return "linears"
    return None


def plain_codes(q: torch.Tensor, kernel: bool):
    """One weight's codes (N, K/2) -> a (N, K/2) uint8 numpy array with column 2c in the low nibble, 2c + 1 in
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
    """One weight's scales -> (N, K/32) fp16 (the kernel layout keeps (K/32, N, 2) scale and zero)."""
    return (scales[..., 0].t() if kernel else scales).to(torch.float16).contiguous()


class _Graph:
    """What both kinds share: building int4 weights into a graph, compiling it, calling it on torch tensors."""

    def __init__(self, dtype: torch.dtype):
        import openvino as ov

        self.ov = ov
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.io_type = ov.Type.bf16 if self.dtype == torch.bfloat16 else ov.Type.f32
        self.keep = []  # the arrays the graph's constants read, alive until its first run has repacked them

    def weight(self, q: torch.Tensor, scales: torch.Tensor, kernel: bool):
        """int4 codes (N, K/2) and scales -> the graph's (N, K) fp32 weight: i4 codes (N, G, 32) -> f16 ->
        times the (N, G, 1) scales -> (N, K), the pattern OpenVINO compresses (it never makes the dense copy)."""
        import numpy as np
        import openvino.opset13 as ops

        ov = self.ov
        codes, s = plain_codes(q, kernel), plain_scales(scales, kernel).numpy()
        N, G = s.shape
        self.keep.extend((codes, s))
        w = ops.constant(ov.Tensor(codes, ov.Shape([N, G, GROUP]), ov.Type.i4), shared_memory=True)
        w = ops.multiply(ops.convert(w, ov.Type.f16), ops.constant(ov.Tensor(s.reshape(N, G, 1)), shared_memory=True))
        return ops.convert(ops.reshape(w, ops.constant(np.array([N, G * GROUP], dtype=np.int64)), False), ov.Type.f32)

    def compile(self, outputs, inputs, threads: int, name: str):
        import openvino.opset13 as ops

        ov = self.ov
        y = ops.convert(outputs, self.io_type)
        compiled = ov.Core().compile_model(ov.Model([y], inputs, name), "CPU", {
            "INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": GROUP, "INFERENCE_PRECISION_HINT": "bf16"})
        self.request = compiled.create_infer_request()
        # what the fully connected layers multiply: bf16 activations where the CPU has bf16 (AVX512_BF16, AMX),
        # else fp32, quantised to int8 per group of 32 on the fly where it has VNNI (OpenVINO's choice)
        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
        self.activations = "bf16" if "bf16" in precision or "bfloat16" in precision else \
            "int8 (dynamic, groups of 32) or fp32"

    def tensor(self, t: torch.Tensor):
        """A torch tensor as an OpenVINO one over the same memory."""
        ov = self.ov
        if t.dtype == torch.bfloat16:
            return ov.Tensor(t.view(torch.int16).numpy(), ov.Shape(list(t.shape)), ov.Type.bf16)
        return ov.Tensor(t.numpy(), shared_memory=True)

    def run(self, x: torch.Tensor, *others: torch.Tensor, out_features: int) -> torch.Tensor:
        x = x.to(self.dtype).contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=self.dtype)
        self.request.set_input_tensor(0, self.tensor(x))
        for i, other in enumerate(others, start=1):
            self.request.set_input_tensor(i, self.tensor(other))
        self.request.set_output_tensor(self.tensor(out))
        self.request.infer()
        return out

    def repacked(self):
        """After the first run: OpenVINO holds its own copy; the arrays its constants read can go."""
        self.keep.clear()


class LibraryExperts(_Graph):
    """One compiled graph for a QuantExperts' E experts (see the module docstring); releases the module's codes."""

    def __init__(self, module: nn.Module, threads: int):
        import numpy as np
        import openvino.opset13 as ops

        super().__init__(module.compute_dtype)
        E, two_i, half_h = module.gate_up_proj_q.shape
        H, kernel = 2 * half_h, bool(module.kernel_layout)
        x = ops.parameter([-1, H], self.io_type, name="x")
        offsets = ops.parameter([E + 1], self.ov.Type.i64, name="offsets")
        rows = ops.convert(x, self.ov.Type.f32)

        def product(inputs, name: str, e: int):
            w = self.weight(getattr(module, f"{name}_q")[e], getattr(module, f"{name}_scales")[e], kernel)
            return ops.matmul(inputs, w, False, True)

        def index(i: int):
            return ops.constant(np.array([i], dtype=np.int64))

        outputs = []
        for e in range(E):
            start = ops.slice(offsets, index(e), index(e + 1), index(1))
            stop = ops.slice(offsets, index(e + 1), index(e + 2), index(1))
            gate, up = ops.split(product(ops.slice(rows, start, stop, index(1), index(0)), "gate_up_proj", e),
                                 ops.constant(np.int64(1)), 2).outputs()
            outputs.append(product(ops.multiply(ops.gelu(gate, "tanh"), up), "down_proj", e))
        self.compile(ops.concat(outputs, 0), [x, offsets], threads, "experts")
        self.num_experts, self.hidden = E, H
        self(torch.zeros(E, H, dtype=self.dtype), [1] * E)  # one row per expert: every layer repacks
        self.repacked()
        release(module, ("gate_up_proj_q", "down_proj_q", "gate_up_proj_scales", "down_proj_scales"))

    @torch.compiler.disable
    def __call__(self, grouped_x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """grouped_x (R, H), rows sorted by expert (counts[e] rows each) -> the experts' outputs (R, H)."""
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(counts).cumsum(0)
        return self.run(grouped_x, offsets, out_features=self.hidden).to(grouped_x.dtype)


class LibraryLinear(_Graph):
    """One compiled graph for a QuantLinear, x (..., K) -> (..., N); releases the module's codes."""

    def __init__(self, module: nn.Module, threads: int):
        import openvino.opset13 as ops

        super().__init__(module.compute_dtype)
        K, N = module.in_features, module.out_features
        x = ops.parameter([-1, K], self.io_type, name="x")
        w = self.weight(module.qweight, module.scales, bool(module.kernel_layout))
        self.compile(ops.matmul(ops.convert(x, self.ov.Type.f32), w, False, True), [x], threads, "linear")
        self.in_features, self.out_features = K, N
        self(torch.zeros(1, K, dtype=self.dtype))
        self.repacked()
        release(module, ("qweight", "scales"))

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return self.run(flat, out_features=self.out_features).to(x.dtype).view(*x.shape[:-1], self.out_features)


def release(module: nn.Module, names: tuple[str, ...]):
    """Drop the module's own copy of its weights: each buffer becomes a meta tensor of the same shape and dtype
    (no storage), and `weights_in_library` marks the module (see `WeightsInLibrary`)."""
    for name in names:
        setattr(module, name, torch.empty_like(getattr(module, name), device="meta"))
    module.weights_in_library = True


def hand_over(model: nn.Module, *, required: bool, everything: bool, threads: int) -> dict[str, int]:
    """Give the library every part it takes (`takes`), module by module, each module's own copy released as
    soon as the library holds its own. Declines, with one note on stderr, where the memory available cannot
    hold the library's extra (`MEMORY_FACTOR`) over the weights it replaces; `required`: not installed is an
    error. Returns {part: modules handed over}."""
    import sys

    from dgemma import devices

    if unavailable():
        if required:
            raise ValueError(unavailable())
        return {}
    chosen = [(m, part) for m in model.modules() if (part := takes(m, everything))]
    if not chosen:
        return {}
    held = held_bytes(m for m, _ in chosen)
    largest = max(held_bytes([m]) for m, _ in chosen)  # one module's two copies side by side while it moves
    need = int((MEMORY_FACTOR - 1) * held + largest)
    free = devices.available_host_memory()
    if need > free:
        print(f"note: int4 weights stay on torch's kernels: OpenVINO's copy of them needs ~{need / 2**30:.1f} GiB "
              f"more, {free / 2**30:.1f} GiB available", file=sys.stderr)
        return {}
    counts = dict.fromkeys(PARTS, 0)
    for module, part in chosen:
        module.library = (LibraryExperts if part == "experts" else LibraryLinear)(module, threads)
        module.int8 = None  # integer compute's per-weight state read the released codes
        counts[part] += 1
    return {part: n for part, n in counts.items() if n}


def refuse(what: str):
    """The one line a path that needs dgemma's copy of library-held weights raises."""
    raise WeightsInLibrary(
        f"{what} needs dgemma's own int4 weights, and this model handed them to OpenVINO (its only copy, "
        "dgemma.quant.openvino): load it with DGEMMA_CPU_KERNELS=torch (or --cpu-int8-compute off) for that")


def in_library(model: nn.Module) -> bool:
    """Whether any module's weights are held by the library only."""
    return any(getattr(m, "weights_in_library", False) for m in model.modules())


def held_bytes(modules) -> int:
    """The int4 codes and scales these modules hold (what the library takes over)."""
    return sum(t.numel() * t.element_size() for m in modules for t in m.buffers(recurse=False))
