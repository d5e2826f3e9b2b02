"""int4 weights on OpenVINO's CPU kernels, which then hold the only copy (OpenVINO: a default dependency on
x86-64 Linux, `pip install 'dgemma[cpu-kernels]'` elsewhere).

Measured at the 26B-A4B's shapes (`benchmarks/cpu_kernels.py`, benchmarks/README.md), OpenVINO's int4 fully
connected layer (FullyConnectedCompressed) is several times torch's int4 kernel at a canvas's rows: an
expert's ~16 rows, the 256 rows of an attention projection or a dense MLP; torch's kernel is the faster at
one row. So where it is installed, int8 compute on a CPU (`dgemma.quant.int8_compute.enable`) hands
the int4 weights to it, part by part (`takes`), as compiled graphs:

  routed experts (`LibraryExperts`), per layer one graph per thread over consecutive experts:
    x (R, H): its experts' (token, choice) entries, sorted by expert;  offsets (E/T + 1,) int64: where each starts
    for expert e: rows x[offsets[e] : offsets[e + 1]]
        -> int4 gate|up (2I, H), group scales -> gelu_tanh(gate) * up -> int4 down (H, I)
    y (R, H): the experts' outputs, in the same order
  each graph on one thread, all of a layer's at once, on views of one input and one output (an expert's ~16
  rows are too few to share a product between threads: on 2 cores two one-thread graphs are 1.15x one
  two-thread graph at a canvas and 2x at one token, benchmarks/README.md)
  a linear layer (`LibraryLinear`: attention projections, dense MLPs), one graph each: x (M, K) -> (M, N)

The codes are dgemma's (two's-complement nibbles, `formats.quantize_tensor`, or read back from torch's int4
kernel layout), handed over without the zero point the stored format carries. Activations cross as views
of torch's buffers (input, offsets, output: no copies), in the model's dtype (bf16 or fp32). The products run
on bf16 activations, or where OpenVINO quantises them on the fly (it does on an AMD Zen 4: AVX-512 with VNNI
and AVX512_BF16, no AMX) on int8 ones per group of the weights' own size (`compile_config`; `activations` asks
which).

One copy: OpenVINO repacks the weights into its own memory when a graph first runs, so each graph runs once
at hand-over on one row per expert (every fully connected layer repacks), and then the module's own codes
and scales are released (`release`): its buffers become meta tensors, shapes without storage. From then on
the library's copy is the only one: every row count runs on it (an AR token too), and a path that needs
dgemma's codes (dequantising, saving, LoRA on the weights, the torch kernels) raises `WeightsInLibrary`,
one line that says how to get a model that has them (load it with the torch kernels).

OpenVINO's copy costs more than the one it replaces (measured on one 26B layer's experts: 612 MiB for 408 MiB
of codes and fp16 scales): the codes, each group's scale as fp32 twice (a converted constant and the kernel's
transposed copy) and ~0.2 MiB per fully connected layer; neither the scale dtype handed over, signed or
unsigned codes, their alignment, nor its runtime cache's capacity changes that (benchmarks/README.md). Each
graph would also keep the intermediate tensors of the largest call it has run: a canvas call hands them back
as it returns (`RELEASE_ROWS`), so a step holds one graph's at a time (glibc keeps part of what they free,
fragmented between torch's allocations, and once in every malloc arena the graphs' threads use: a 26B step rose
~3 GiB over the resident set with glibc's arena per thread, against 0.9 on torch's kernels; MALLOC_ARENAS takes
~0.5 GiB off that, and the plan counts the rest, KEPT_SHARE). So the hand-over is planned
(`dgemma.quant.openvino_memory`: `plan`, `library_bytes`): in dgemma's groups of 32 where the process then stays
within MEMORY_SHARE of the machine's memory, else the experts quantised again in groups of 64 (half the
per-group numbers; the 26B-A4B on a 24 GB machine), and as many layers as fit; the others keep dgemma's copy
and torch's kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools

import torch
from torch import nn

from dgemma import processes
from dgemma.quant.openvino_memory import (  # noqa: F401 (the plan's names, read as openvino.* by callers)
    GROUP, MEMORY_SHARE, canvas_entries, held_bytes, library_bytes, plan, reserve_bytes)

# A call of at least this many rows hands its intermediate tensors back as it returns (`_Graph.run`): kept, each
# graph would hold those of the largest call it has run (~56 MiB per experts layer of the 26B at a canvas; with
# 27 layers and their linears, 3.7 GiB over a step), while one-row calls (an AR token) keep theirs, a few KiB,
# and skip the release's ~0.1 ms
RELEASE_ROWS = 64
# Linear layers from this many weights go to the library; smaller ones keep dgemma's path, where a graph call's
# fixed cost (~40 us) is more than the product (bench-20m's 256 x 256 layers)
MIN_LINEAR_WEIGHTS = 1 << 20
PARTS = ("experts", "linears")
# glibc's malloc arenas once the library runs: every compiled graph runs on threads of its own (an experts graph
# on one thread, 60 graphs for the 26B's experts), and each arena those threads get keeps the largest set of
# intermediate tensors they freed. Two arenas between all of them: the 26B's step peak 20.10 -> 19.55 GiB and
# its process peak 20.46 -> 19.80 (`dgemma bench`, a 5.06 s step against 4.92 s in another run); one arena
# saved ~0.1 GiB more on 8 layers but cost 3-7% of the step (benchmarks/README.md)
MALLOC_ARENAS = 2


class WeightsInLibrary(ValueError):
    """A path that needs dgemma's int4 codes on a module whose only copy is OpenVINO's."""


def unavailable() -> str | None:
    """Why the OpenVINO kernels cannot run here, or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (pip install openvino, or 'dgemma[cpu-kernels]')"
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
    of at least MIN_LINEAR_WEIGHTS weights, or any size with `everything`), else None. (Known by their
    buffers: dgemma.quant.quantize imports this module.)"""
    if not hasattr(module, "library"):
        return None
    if hasattr(module, "gate_up_proj_q") and _readable(module, ("gate_up_proj_q", "down_proj_q")):
        return "experts"
    if hasattr(module, "qweight") and _readable(module, ("qweight",)) and \
            (everything or module.in_features * module.out_features >= MIN_LINEAR_WEIGHTS):
        return "linears"
    return None


def plain_codes(q: torch.Tensor, kernel: bool):
    """Codes (..., N, K/2) (one weight, or a stack of experts) -> a (..., N, K/2) uint8 numpy array with
    column 2c in the low nibble, 2c + 1 in the high one, each the signed 4-bit value (two's complement).
    `kernel`: read from the layout of torch's CPU int4 kernel (blocks of 64 rows stored (K, 32), byte [k, j] =
    rows j (low) and j + 32 (high) of column k: see `int8_compute.Int4Widener`), else from dgemma's (value + 8
    per nibble). In numpy, a whole stack at once: its uint8 bit operations are ~100x torch's here."""
    import numpy as np

    codes = q.numpy()
    if kernel:
        *lead, N, half = codes.shape
        pairs = codes.reshape(-1, N // 64, half, 2, 32)  # (weight, block, column pair, even / odd column, row)
        even, odd = pairs[:, :, :, 0], pairs[:, :, :, 1]
        plain = np.empty((pairs.shape[0], N // 64, 64, half), np.uint8)
        plain[:, :, :32] = ((even & np.uint8(15)) | ((odd & np.uint8(15)) << np.uint8(4))).transpose(0, 1, 3, 2)
        plain[:, :, 32:] = ((even >> np.uint8(4)) | (odd & np.uint8(0xF0))).transpose(0, 1, 3, 2)
        codes = plain.reshape(*lead, N, half)
    return codes ^ np.uint8(0x88)  # value + 8 -> value, in each nibble


def plain_scales(scales: torch.Tensor, kernel: bool):
    """Scales (one weight's, or a stack's) -> a (..., N, K/32) fp16 numpy array (the kernel layout keeps
    (..., K/32, N, 2) scale and zero)."""
    return (scales[..., 0].transpose(-1, -2) if kernel else scales).to(torch.float16).contiguous().numpy()


def regroup(codes, scales, group: int):
    """Plain signed codes (N, K/2) and fp16 scales (N, K/32) -> the same weight quantised again in groups of
    `group` (dgemma's quantiser, its clip search included, over the dequantised values): numpy arrays in the
    same forms, (N, K/group) scales."""
    import numpy as np

    from dgemma.quant.formats import dequantize_tensor, quantize_tensor

    nibbles = torch.from_numpy(codes ^ np.uint8(0x88))  # back to dgemma's value + 8
    dense = dequantize_tensor(nibbles, torch.from_numpy(scales), "int4", torch.float32)
    q, s = quantize_tensor(dense, "int4", group)
    return q.numpy() ^ np.uint8(0x88), s.numpy()


def library_stack(q: torch.Tensor, scales: torch.Tensor, kernel: bool, group: int):
    """A stack of E weights' codes and scales (dgemma's, `kernel` as in `plain_codes`) -> plain signed codes
    (E, N, K/2) and fp16 scales (E, N, K/group), the arrays a graph's constants read. In dgemma's groups: the
    whole stack in one conversion. Wider groups: expert by expert into the two arrays, so that beside dgemma's
    codes only the regrouped stack and one expert's temporaries exist (a whole plain stack as well would be
    ~0.4 GiB more of the hand-over's peak per 26B layer)."""
    import numpy as np

    if group == GROUP:
        return plain_codes(q, kernel), plain_scales(scales, kernel)
    E, N, half = q.shape
    codes, s = np.empty((E, N, half), np.uint8), np.empty((E, N, 2 * half // group), np.float16)
    for e in range(E):
        codes[e], s[e] = regroup(plain_codes(q[e], kernel), plain_scales(scales[e], kernel), group)
    return codes, s


def compile_config(threads: int, group: int) -> dict:
    """The CPU plugin's settings for a graph of int4 weights in groups of `group`. Where OpenVINO quantises the
    activations to int8 on the fly (on a Zen 4 under the bf16 hint too: `activations` asks), it does so
    per group of DYNAMIC_QUANTIZATION_GROUP_SIZE, and only where that group divides the weights' (a group of 64
    over weights in groups of 32 multiplies them unquantised, about twice as slow): so the weights' own group.
    For the 26B's experts, regrouped to 64 on a 24 GB machine (`plan`), that is 64, not 32: an expert's 16 rows
    0.25 + 0.15 against 0.31 + 0.18 ms on a Zen 4, the whole step 5.8 against 6.6 s (benchmarks/README.md)."""
    return {"INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": group, "INFERENCE_PRECISION_HINT": "bf16"}


@functools.cache
def activations(dtype: torch.dtype, group: int) -> str:
    """What OpenVINO's fully connected layers multiply int4 weights in groups of `group` by, for inputs in `dtype`
    (a `_Graph`'s: bf16 or fp32) with `compile_config`, as the start line names it: asked of a probe, since the
    plugin does not say (its precision hint reads bf16 on an AVX512_BF16 CPU whose products then run on int8
    activations). A one-row input of 1 and 1/1024 in the same group: quantised to int8 per group (symmetric or
    not), 1/1024 rounds to 0, and the output is that of 1 alone."""
    import numpy as np
    import openvino.opset13 as ops

    N, K = 256, 2 * group
    codes = np.random.default_rng(0).integers(0, 256, (N, K // 2), dtype=np.uint8)
    graph = _Graph(dtype, group)
    x = ops.parameter([-1, K], graph.io_type, name="x")
    w = graph.weight(codes, np.full((N, K // group), 1 / 16, dtype=np.float16))
    graph.compile(ops.matmul(ops.convert(x, graph.ov.Type.f32), w, False, True), [x], 1, "probe")
    rows = torch.zeros(2, K, dtype=graph.dtype)
    rows[:, 0], rows[1, 1] = 1.0, 1 / 1024
    outputs = [graph.run(rows[i : i + 1], out_features=N) for i in range(2)]
    hint = str(graph.compiled.get_property("INFERENCE_PRECISION_HINT")).lower()  # e.g. "<Type: 'bfloat16'>"
    precision = "bf16" if "bf16" in hint or "bfloat16" in hint else "fp32"
    return "int8 (quantised on the fly)" if torch.equal(*outputs) else precision


class _Graph:
    """What both kinds share: building int4 weights into a graph, compiling it, calling it on torch tensors."""

    def __init__(self, dtype: torch.dtype, group: int):
        import openvino as ov

        self.ov, self.group = ov, group
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.io_type = ov.Type.bf16 if self.dtype == torch.bfloat16 else ov.Type.f32
        self.keep = []  # the arrays the graph's constants read, alive until its first run has repacked them

    def weight(self, codes, s):
        """One weight's plain codes (N, K/2) and fp16 scales (N, K/group) (`plain_codes`, `plain_scales`,
        `library_stack`) -> the graph's (N, K) fp32 weight: i4 codes (N, G, group) -> f16 -> times the (N, G, 1)
        scales -> (N, K), the pattern OpenVINO compresses (it never makes the dense copy)."""
        import numpy as np
        import openvino.opset13 as ops

        ov = self.ov
        N, G = s.shape
        self.keep.extend((codes, s))  # (views of) the arrays the constants read, until the first run
        w = ops.constant(ov.Tensor(codes, ov.Shape([N, G, self.group]), ov.Type.i4), shared_memory=True)
        w = ops.multiply(ops.convert(w, ov.Type.f16), ops.constant(ov.Tensor(s.reshape(N, G, 1)), shared_memory=True))
        return ops.convert(ops.reshape(w, ops.constant(np.array([N, G * self.group], dtype=np.int64)), False),
                           ov.Type.f32)

    def compile(self, outputs, inputs, threads: int, name: str):
        import openvino.opset13 as ops

        ov = self.ov
        y = ops.convert(outputs, self.io_type)
        self.compiled = compiled = ov.Core().compile_model(ov.Model([y], inputs, name), "CPU",
                                                          compile_config(threads, self.group))
        self.request = compiled.create_infer_request()

    @property
    def activations(self) -> str:
        """What its products multiply the weights by (`activations`)."""
        return activations(self.dtype, self.group)

    def tensor(self, t: torch.Tensor):
        """A torch tensor as an OpenVINO one over the same memory."""
        ov = self.ov
        if t.dtype == torch.bfloat16:
            return ov.Tensor(t.view(torch.int16).numpy(), ov.Shape(list(t.shape)), ov.Type.bf16)
        return ov.Tensor(t.numpy(), shared_memory=True)

    def bind(self, x: torch.Tensor, *others: torch.Tensor, out: torch.Tensor):
        """The next call's input, other inputs and output, as views of these tensors (contiguous, `self.dtype`)."""
        self.request.set_input_tensor(0, self.tensor(x))
        for i, other in enumerate(others, start=1):
            self.request.set_input_tensor(i, self.tensor(other))
        self.request.set_output_tensor(self.tensor(out))

    def done(self, rows: int):
        """After a call of `rows` rows: a canvas call hands its intermediate tensors back (see RELEASE_ROWS)."""
        if rows >= RELEASE_ROWS:
            self.compiled.release_memory()

    def run(self, x: torch.Tensor, *others: torch.Tensor, out_features: int) -> torch.Tensor:
        x = x.to(self.dtype).contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=self.dtype)
        self.bind(x, *others, out=out)
        self.request.infer()
        self.done(x.shape[0])
        return out

    def repacked(self):
        """After the first run: OpenVINO holds its own copy; the arrays its constants read can go."""
        self.keep.clear()


class _ExpertsGraph(_Graph):
    """Experts first..last-1 of a stack as one compiled graph: x (R, H) sorted by expert, offsets (last - first + 1,)
    -> (R, H) (see the module docstring)."""

    def __init__(self, plain: dict, dtype: torch.dtype, group: int, first: int, last: int, threads: int):
        import numpy as np
        import openvino.opset13 as ops

        super().__init__(dtype, group)
        self.first, self.last = first, last
        H = 2 * plain["gate_up_proj"][0].shape[-1]
        x = ops.parameter([-1, H], self.io_type, name="x")
        offsets = ops.parameter([last - first + 1], self.ov.Type.i64, name="offsets")
        rows = ops.convert(x, self.ov.Type.f32)

        def product(inputs, name: str, e: int):
            codes, s = plain[name]
            return ops.matmul(inputs, self.weight(codes[e], s[e]), False, True)

        def index(i: int):
            return ops.constant(np.array([i], dtype=np.int64))

        outputs = []
        for j, e in enumerate(range(first, last)):
            start = ops.slice(offsets, index(j), index(j + 1), index(1))
            stop = ops.slice(offsets, index(j + 1), index(j + 2), index(1))
            gate, up = ops.split(product(ops.slice(rows, start, stop, index(1), index(0)), "gate_up_proj", e),
                                 ops.constant(np.int64(1)), 2).outputs()
            outputs.append(product(ops.multiply(ops.gelu(gate, "tanh"), up), "down_proj", e))
        self.compile(ops.concat(outputs, 0), [x, offsets], threads, "experts")


class LibraryExperts:
    """A QuantExperts' E experts as compiled graphs over consecutive experts, as many as the threads, each on one
    thread, run side by side (see the module docstring); releases the module's codes."""

    def __init__(self, module: nn.Module, threads: int, group: int = GROUP):
        E, two_i, half_h = module.gate_up_proj_q.shape
        kernel = bool(module.kernel_layout)
        plain = {name: library_stack(getattr(module, f"{name}_q"), getattr(module, f"{name}_scales"), kernel, group)
                 for name in ("gate_up_proj", "down_proj")}
        count = max(1, min(threads, E))
        each = max(1, threads // count)
        bounds = [E * i // count for i in range(count + 1)]
        self.graphs = [_ExpertsGraph(plain, module.compute_dtype, group, first, last, each)
                       for first, last in zip(bounds, bounds[1:])]
        self.num_experts, self.hidden, self.group = E, 2 * half_h, group
        self.dtype, self.activations = self.graphs[0].dtype, self.graphs[0].activations
        sizes = sorted({graph.last - graph.first for graph in self.graphs})
        experts = f"{'-'.join(map(str, sizes))} expert{'s' if sizes[-1] > 1 else ''}"
        threads_each = f"{each} thread{'s' if each > 1 else ''}"
        self.layout = ("one graph per layer" if count == 1 else
                       f"{count} graphs per layer, {experts} and {threads_each} each, side by side")
        self(torch.zeros(E, self.hidden, dtype=self.dtype), [1] * E)  # one row per expert: every graph repacks
        for graph in self.graphs:
            graph.repacked()
        release(module, ("gate_up_proj_q", "down_proj_q", "gate_up_proj_scales", "down_proj_scales"))

    @torch.compiler.disable
    def __call__(self, grouped_x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """grouped_x (R, H), rows sorted by expert (counts[e] rows each) -> the experts' outputs (R, H). Each graph
        reads and writes its experts' rows in place (views); they run at once and the call waits for all."""
        x = grouped_x.to(self.dtype).contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=self.dtype)
        starts = [0, *itertools.accumulate(counts)]
        running = []
        for graph in self.graphs:
            a, b = starts[graph.first], starts[graph.last]
            if a == b:
                continue  # none of its experts has a row
            offsets = torch.tensor(starts[graph.first : graph.last + 1], dtype=torch.int64).sub_(a)
            graph.bind(x[a:b], offsets, out=out[a:b])
            graph.request.start_async()
            running.append((graph, offsets))  # the offsets stay alive until the graph has read them
        for graph, offsets in running:
            graph.request.wait()
            graph.done(int(offsets[-1]))
        return out.to(grouped_x.dtype)


class LibraryLinear(_Graph):
    """One compiled graph for a QuantLinear, x (..., K) -> (..., N), in dgemma's groups of 32; releases the
    module's codes."""

    def __init__(self, module: nn.Module, threads: int):
        import openvino.opset13 as ops

        super().__init__(module.compute_dtype, GROUP)
        K, N = module.in_features, module.out_features
        x = ops.parameter([-1, K], self.io_type, name="x")
        kernel = bool(module.kernel_layout)
        w = self.weight(plain_codes(module.qweight, kernel), plain_scales(module.scales, kernel))
        self.compile(ops.matmul(ops.convert(x, self.ov.Type.f32), w, False, True), [x], threads, "linear")
        self.in_features, self.out_features = K, N
        self.layout = "one graph per weight"
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
    """Give the library the parts it takes (`takes`) that `plan` fits in memory, module by module, each module's
    own copy released as soon as the library holds its own; one note on stderr where memory kept any on
    torch's kernels. `required`: not installed is an error. Returns {part: modules handed over, "left": modules
    memory kept, "group": the experts' group size}."""
    import sys

    if unavailable():
        if required:
            raise ValueError(unavailable())
        return {}
    chosen = [(m, part) for m in model.modules() if (part := takes(m, everything))]
    if not chosen:
        return {}
    group, taken, bound = plan(chosen, model.config)
    if taken:
        processes.limit_malloc_arenas(MALLOC_ARENAS)  # before the graphs' threads exist
    if len(taken) < len(chosen):
        print(f"note: {len(chosen) - len(taken)} of {len(chosen)} int4 weights stay on torch's kernels: OpenVINO's "
              f"copy of them would not fit the memory (the process may use {bound})", file=sys.stderr)
    counts = dict.fromkeys(PARTS, 0)
    for module, part in taken:
        if part == "experts":
            module.library = LibraryExperts(module, threads, group)
        else:
            module.library = LibraryLinear(module, threads)
        module.int8 = None  # int8 compute's per-weight state read the released codes
        counts[part] += 1
        if part == "experts":  # what its hand-over freed (the released codes, a regrouping's dequantised
            processes.release_freed_memory()  # values) back to the kernel now: glibc kept ~0.3 GiB a layer
    return {part: n for part, n in counts.items() if n} | {"left": len(chosen) - len(taken), "group": group}


def refuse(what: str):
    """The one line a path that needs dgemma's copy of library-held weights raises."""
    raise WeightsInLibrary(
        f"{what} needs dgemma's own int4 weights, and this model handed them to OpenVINO (its only copy, "
        "dgemma.quant.openvino): load it with DGEMMA_CPU_KERNELS=torch (or --cpu-int8-compute off) for that")


def in_library(model: nn.Module) -> bool:
    """Whether any module's weights are held by the library only."""
    return any(getattr(m, "weights_in_library", False) for m in model.modules())
