"""Weight-only quantisation as a module swap (int8 and int4, symmetric, group-wise along the input dim).

Every `nn.Linear` and the fused 3-D expert tensors are replaced; the common quantisers skip the latter,
which is where 90% of DiffusionGemma's weights live. The tied embedding / LM head stays in the model
dtype: the entropy-bound sampler accepts tokens by the entropy of these logits, and 4-bit logits make
it run many more steps (seen in the MLX port), while the table is only 3% of the weights.

Quantising happens while loading (`load_model(..., quantize="int4")`): modules are swapped on the meta
device first and each dense tensor is quantised the moment it is read, a chunk of rows at a time, so peak
memory stays near the quantised size plus one shard. `save_pretrained` of a quantised model writes the codes
and scales below (config.json: `quantization_config.quant_method` "dgemma"), which `load_model` reads back
as they are (`dgemma quantize`).

Running them: by default a weight is dequantised (through fp32) when its module runs, expert by expert for
the fused experts. On CUDA, experts serving many tokens are dequantised all at once into one shared buffer
(`QuantExperts.dequantize_all`). A bf16 int4 model on a CPU is repacked for torch's CPU int4 matmul
(`use_cpu_int4_kernel`), which never materialises the dense weight.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma import devices
from dgemma.model.experts import Experts
from dgemma.model.layers import gated_gelu
from dgemma.quant import int8_compute, openvino
from dgemma.quant.formats import (  # noqa: F401  (the formats' names, read from here by most callers)
    FORMATS,
    GROUP_SIZE,
    dequantize_tensor,
    fits_int4_kernel,
    group_size,
    quantize_tensor,
    random_quantized,
)

CODE_BYTES = {"int8": 1.0, "int4": 0.5}  # one weight's code (int4: two codes a byte)
SCALE_BYTES = 2  # one fp16 scale per group

# Dequantising a whole stack of experts goes through fp32 this many weights at a time.
DEQUANT_CHUNK_ELEMENTS = 1 << 26


class QuantLinear(nn.Module):
    """A bias-free linear layer with quantised weights, dequantised per call."""

    def __init__(self, in_features: int, out_features: int, fmt: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.compute_dtype = in_features, out_features, fmt, dtype
        packed_in = in_features // 2 if fmt == "int4" else in_features
        group = group_size(in_features, fmt)
        self.register_buffer("qweight", torch.empty(out_features, packed_in, dtype=torch.uint8 if fmt == "int4" else torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, in_features // group, dtype=torch.float16,
                                                   device=device))

    def load_dense(self, weight: torch.Tensor):
        # the dense tensor's device wins: while loading, this module still sits on the meta device
        self.qweight, self.scales = quantize_tensor(weight, self.fmt)

    kernel_layout = False  # True once `use_cpu_int4_kernel` repacked the weights for torch's CPU int4 matmul
    int8 = None  # what int8 compute needs once `int8_compute.enable` ran: channel scales or an Int4Widener
    library = None  # an `openvino.LibraryLinear` once `int8_compute.enable` gave the weights to it
    weights_in_library = False  # True once the library holds the only copy (the buffers are meta tensors)

    @property
    def weight(self) -> torch.Tensor:
        if self.weights_in_library:
            openvino.refuse("reading a layer's weights (dequantising, LoRA merging)")
        if self.kernel_layout:
            return _kernel_dequantize(self.qweight, self.scales, self.in_features, self.compute_dtype)
        return dequantize_tensor(self.qweight, self.scales, self.fmt, self.compute_dtype)

    def forward(self, x):
        if self.library is not None:
            return self.library(x)
        if self.int8 is not None:
            out = int8_compute.linear(self, x)
            if out is not None:
                return out
        if self.kernel_layout and x.dtype == self.compute_dtype:
            flat = x.reshape(-1, self.in_features).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, GROUP_SIZE["int4"], self.scales)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight.to(x.dtype))


class QuantExperts(Experts):
    """Fused experts with quantised (E, out, in) tensors.

    Two ways to run them:
      per expert  -- each active expert is dequantised when it runs (2 dequantisations per active expert):
                     the least memory, and what a few tokens (AR decoding) need;
      all at once -- both tensors of every expert are dequantised into one reusable (E, out, in) buffer
                     per shape, shared by all layers, then the dense paths run (the grouped GEMM on CUDA,
                     the padded grid elsewhere): a handful of dequantisation calls per layer instead of
                     up to 2 E small ones, at the cost of one layer's experts in the model dtype.
    `dequantize_all`: None picks all at once on CUDA when there are at least as many (token, choice)
    entries as experts; True / False force a way (tests force it on CPU).
    """

    batched = False  # the per-expert way; the dequantised view below is a plain `Experts`
    dequantize_all: bool | None = None

    def __init__(self, base: Experts, fmt: str, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.fmt, self.compute_dtype = fmt, dtype
        E, two_i, h = base.gate_up_proj.shape
        self.num_experts = E
        for name, (out_f, in_f) in (("gate_up_proj", (two_i, h)), ("down_proj", (h, two_i // 2))):
            packed = in_f // 2 if fmt == "int4" else in_f
            group = group_size(in_f, fmt)
            qdtype = torch.uint8 if fmt == "int4" else torch.int8
            self.register_buffer(f"{name}_q", torch.empty(E, out_f, packed, dtype=qdtype, device=base.gate_up_proj.device))
            self.register_buffer(f"{name}_scales", torch.empty(E, out_f, in_f // group, dtype=torch.float16,
                                                               device=base.gate_up_proj.device))

    def load_dense(self, name: str, tensor: torch.Tensor):
        q, s = quantize_tensor(tensor, self.fmt)
        setattr(self, f"{name}_q", q)
        setattr(self, f"{name}_scales", s)

    @property
    def gate_up_proj(self):  # Experts.forward reads the expert count from this tensor's first dim
        return self.gate_up_proj_q

    kernel_layout = False  # True once `use_cpu_int4_kernel` repacked the weights for torch's CPU int4 matmul
    int8 = None  # {"gate_up_proj": ..., "down_proj": ...} once `int8_compute.enable` ran
    library = None  # an `openvino.LibraryExperts` once `int8_compute.enable` gave the experts to it
    weights_in_library = False  # True once the library holds the only copy (the buffers are meta tensors)

    def _per_expert(self, grouped_x, counts: list[int]) -> torch.Tensor:
        if self.library is not None:  # every row count: its copy is the only one
            return self.library(grouped_x, counts)
        if self.int8 is not None:
            out = int8_compute.experts(self, grouped_x, counts, gated_gelu, self._one_expert)
            if out is not None:
                return out
        if not self._kernel_runs(grouped_x):
            return super()._per_expert(grouped_x, counts)
        sorted_out = torch.empty_like(grouped_x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sorted_out[start : start + n] = self._one_expert(e, grouped_x[start : start + n])
            start += n
        return sorted_out

    def _kernel_runs(self, x: torch.Tensor) -> bool:
        return self.kernel_layout and x.dtype == self.compute_dtype

    def _one_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows (n, H): torch's int4 kernel where it runs, else dequantised weights."""
        if self.weights_in_library:
            openvino.refuse("running an expert on torch's kernels")
        if not self._kernel_runs(rows):
            gate_up, down = self.expert_weights(e)
            return F.linear(gated_gelu(F.linear(rows, gate_up)), down)
        mm, group = torch.ops.aten._weight_int4pack_mm_for_cpu, GROUP_SIZE["int4"]
        hidden = gated_gelu(mm(rows, self.gate_up_proj_q[e], group, self.gate_up_proj_scales[e]))
        return mm(hidden.contiguous(), self.down_proj_q[e], group, self.down_proj_scales[e])

    def expert_weights(self, e: int):
        if self.weights_in_library:
            openvino.refuse("reading an expert's weights (dequantising, LoRA on the experts)")
        if self.kernel_layout:
            h = self.down_proj_q.shape[1]
            return (_kernel_dequantize(self.gate_up_proj_q[e], self.gate_up_proj_scales[e], h, self.compute_dtype),
                    _kernel_dequantize(self.down_proj_q[e], self.down_proj_scales[e], self.gate_up_proj_q.shape[1] // 2,
                                       self.compute_dtype))
        return (
            dequantize_tensor(self.gate_up_proj_q[e], self.gate_up_proj_scales[e], self.fmt, self.compute_dtype),
            dequantize_tensor(self.down_proj_q[e], self.down_proj_scales[e], self.fmt, self.compute_dtype),
        )

    def route(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        all_at_once = self.dequantize_all
        if all_at_once is None:
            all_at_once = x.is_cuda and experts.numel() >= self.num_experts
        if self.kernel_layout:
            all_at_once = False
        if not all_at_once:
            return super().route(x, experts)
        return _Dequantised(self.dequantized("gate_up_proj"), self.dequantized("down_proj")).route(x, experts)

    def dequantized(self, name: str) -> torch.Tensor:
        """All experts' `name` tensor (E, out, in) in the model dtype, in a buffer shared by every layer
        (valid until the next layer's call), dequantised a block of experts at a time."""
        if self.weights_in_library:
            openvino.refuse("dequantising the experts")
        q, scales = getattr(self, f"{name}_q"), getattr(self, f"{name}_scales")
        E, out_f = q.shape[:2]
        in_f = q.shape[2] * 2 if self.fmt == "int4" else q.shape[2]
        key = (name, E, out_f, in_f, self.compute_dtype, q.device)
        buffer = _DEQUANTIZED.get(key)
        if buffer is None:
            buffer = _DEQUANTIZED[key] = torch.empty(E, out_f, in_f, dtype=self.compute_dtype, device=q.device)
        step = max(1, DEQUANT_CHUNK_ELEMENTS // (out_f * in_f))
        for a in range(0, E, step):
            dequantize_tensor(q[a : a + step], scales[a : a + step], self.fmt, self.compute_dtype, out=buffer[a : a + step])
        return buffer


# (name, E, out, in, dtype, device) -> the buffer `QuantExperts.dequantized` fills, one per shape
_DEQUANTIZED: dict[tuple, torch.Tensor] = {}


class _Dequantised(Experts):
    """Plain experts over borrowed dense (E, out, in) tensors: the dense routing paths, unchanged."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = gate_up, down


# -- torch's CPU int4 matmul ------------------------------------------------------------------------------
# `aten._weight_int4pack_mm_for_cpu` multiplies bf16 activations by int4 weights in its own blocked layout,
# dequantising in registers: ~4-17x faster than dequantising a 26B expert (then a bf16 matmul) on 2 cores,
# and the only way the 26B-A4B shape runs at a usable speed on a CPU. Its scales are bf16 (ours fp16: the
# repacked weights round each group's scale once more, a relative 2^-9).
def cpu_int4_kernel_applies(model: nn.Module, device: torch.device | None = None, dtype=None) -> bool:
    """Whether `use_cpu_int4_kernel` applies: an int4 model in bf16 on a CPU (its device and dtype, or those
    given for a model still on the meta device)."""
    device, dtype = device or model.device, dtype or model.dtype
    return (model.quantization in ("int4", None) and device.type == "cpu"
            and dtype == torch.bfloat16 and devices.has_cpu_int4_kernel())


def kernel_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our fp16 scales (..., N, K/g) -> the kernel's (..., K/g, N, 2) scales and zero offsets (0: symmetric)."""
    scales = scales.transpose(-1, -2).to(dtype)
    return torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


def _to_kernel_layout(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """Ours (N, K/2) nibbles + (N, K/g) fp16 scales -> the kernel's (N, K/2) layout and scales."""
    codes = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2).to(torch.int32)  # (N, K) 0..15
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), kernel_scales(scales, dtype)


def _kernel_dequantize(packed: torch.Tensor, scale_zeros: torch.Tensor, in_features: int, dtype) -> torch.Tensor:
    """The kernel layout's weights (N, K) in `dtype`, read back through the kernel (identity activations)."""
    eye = torch.eye(in_features, dtype=scale_zeros.dtype, device=packed.device)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP_SIZE["int4"], scale_zeros).t().to(dtype)


@torch.no_grad()
def use_cpu_int4_kernel(model: nn.Module) -> bool:
    """Repack every int4 module of a bf16 CPU model for torch's CPU int4 matmul, tensor by tensor (expert by
    expert: never a second copy of the weights). Returns whether it applied (see `cpu_int4_kernel_applies`)."""
    if model.quantization != "int4" or not cpu_int4_kernel_applies(model):
        return False
    for module in model.modules():
        if module.__dict__.get("weights_in_library"):
            continue  # its only copy is the library's
        if isinstance(module, QuantLinear) and not module.kernel_layout and fits_int4_kernel(module.in_features):
            module.qweight, module.scales = _to_kernel_layout(module.qweight, module.scales, module.compute_dtype)
            module.kernel_layout = True
        elif isinstance(module, QuantExperts) and not module.kernel_layout:
            if not (fits_int4_kernel(module.down_proj_q.shape[-1] * 2) and fits_int4_kernel(module.gate_up_proj_q.shape[-1] * 2)):
                continue
            for name in ("gate_up_proj", "down_proj"):
                q, scales = getattr(module, f"{name}_q"), getattr(module, f"{name}_scales")
                for e in range(q.shape[0]):  # in place: the kernel's layout has the same (N, K/2) bytes
                    packed, scale_zeros = _to_kernel_layout(q[e], scales[e], module.compute_dtype)
                    q[e] = packed
                    if e == 0:
                        new_scales = scales.new_empty((q.shape[0], *scale_zeros.shape), dtype=scale_zeros.dtype)
                    new_scales[e] = scale_zeros
                setattr(module, f"{name}_scales", new_scales)
            module.kernel_layout = True
    return True


def swap_modules(model: nn.Module, fmt: str) -> dict[str, nn.Module]:
    """Replace linears (router and vision tower excepted) and fused experts with quantised twins.

    Returns {original parameter name: the quantised module that now takes that dense tensor}.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantisation {fmt!r}; choose from {', '.join(FORMATS)}")
    dtype = model.dtype
    quantised: dict[str, nn.Module] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if full.startswith(("vision_tower", "embed_vision")):
                continue  # a few percent of the weights, run once per image: kept in the model dtype
            if isinstance(child, nn.Linear) and not full.endswith("router.proj"):
                # (the router stays exact: a flipped top-k choice changes which experts run at all)
                new = QuantLinear(child.in_features, child.out_features, fmt, dtype, device=child.weight.device)
                setattr(parent, child_name, new)
                quantised[f"{full}.weight"] = new
            elif isinstance(child, Experts) and not isinstance(child, QuantExperts):
                new = QuantExperts(child, fmt, dtype)
                setattr(parent, child_name, new)
                quantised[f"{full}.gate_up_proj"] = new
                quantised[f"{full}.down_proj"] = new
    return quantised


def load_dense_into(module: nn.Module, name: str, tensor: torch.Tensor):
    """Quantise the dense tensor of parameter `name` into the module `swap_modules` put in its place."""
    if isinstance(module, QuantExperts):
        module.load_dense(name.rsplit(".", 1)[1], tensor)
    else:
        module.load_dense(tensor)


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str) -> nn.Module:
    """Quantise an already loaded model in place (tests, and models built in memory)."""
    if openvino.in_library(model):
        openvino.refuse("quantising the model again")
    dense = {name: t for name, t in model.state_dict().items()}
    for name, module in swap_modules(model, fmt).items():
        load_dense_into(module, name, dense[name])
    model.quantization = fmt
    return model


def quantised_tensors(model: nn.Module) -> dict[str, torch.dtype]:
    """The codes and scales buffers of every quantised module: state-dict name -> dtype."""
    return {f"{prefix}.{name}": buffer.dtype for prefix, module in model.named_modules()
            if isinstance(module, (QuantLinear, QuantExperts)) for name, buffer in module.named_buffers(recurse=False)}


def is_kernel_layout(model: nn.Module) -> bool:
    """Whether any module holds weights repacked for torch's CPU int4 matmul (`use_cpu_int4_kernel`)."""
    return any(getattr(module, "kernel_layout", False) for module in model.modules())


def bytes_per_weight(fmt: str) -> float:
    """What one weight costs stored in `fmt`: "bf16" 2 bytes; "int8" / "int4" its code plus its share of its
    group's fp16 scale (int8 1 + 2/64 = 1.03125 bytes, int4 0.5 + 2/32 = 0.5625). Every plan of weight bytes
    from a config asks here (dgemma.engine.memory, dgemma.parallel.plan)."""
    if fmt == "bf16":
        return 2.0
    return CODE_BYTES[fmt] + SCALE_BYTES / GROUP_SIZE[fmt]


def loaded_weight_bytes(model: nn.Module) -> int:
    """Bytes a loaded model's parameters and buffers hold (what its weights cost in memory, measured; meta
    tensors, the shapes of weights a kernel library holds, `dgemma.quant.openvino`, hold none)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
