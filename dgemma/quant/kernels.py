"""Which kernel multiplies each part of a model, and on what machine: what `dgemma bench` prints beside its
figures, so that a tokens/s figure says what ran.

The parts: the routed experts, the projections (attention q/k/v/o and the dense MLPs: every `nn.Linear` of a
layer) and the LM head. Which kernel runs depends on the rows a product sees (`dgemma.quant.int8_compute`
widens int4 codes to int8 only from `MIN_ROWS_TO_WIDEN` rows), so each is described for a row count: a
canvas step at batch 1 multiplies 256 rows by every projection, but an expert sees its share of them (~16
of 256 x top-8 over 128 experts), and an AR token 1 row.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dgemma import devices
from dgemma.model.experts import Experts
from dgemma.quant import int8_compute
from dgemma.quant.quantize import QuantExperts, QuantLinear

INT4_KERNEL = "torch int4 (_weight_int4pack_mm_for_cpu, {dtype} activations)"


def _quantised_kernel(module: nn.Module, rows: int, entries: int = 0) -> str:
    """What a QuantLinear / QuantExperts runs for a product of `rows` rows (experts: `entries` (token, choice)
    pairs in the layer, `rows` of them per expert)."""
    dtype = str(module.compute_dtype).replace("torch.", "")
    if getattr(module, "library", None) is not None and module.library.runs(entries):
        return "OpenVINO int4 x int8 (dynamic int8 activations, groups of 32; one graph per layer)"
    if module.int8 is not None:
        if module.fmt == "int8":
            return "int8 x int8 (torch._int_mm)"
        weights = (module.qweight if isinstance(module, QuantLinear) else module.gate_up_proj_q[0]).numel() * 2
        if int8_compute.widening_pays(rows, weights):
            return "int8 x int8 (int4 widened, torch._int_mm)"
    if module.kernel_layout:
        return INT4_KERNEL.format(dtype=dtype)
    return f"{module.fmt} dequantised to {dtype}, then a {dtype} matmul"


def kernels(model: nn.Module, rows: int) -> dict:
    """{part: kernel} for a forward over `rows` token rows (batch x positions) of `model`."""
    dtype = str(model.dtype).replace("torch.", "")
    c = model.config
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    linear = next((m for m in model.layers.modules() if isinstance(m, (nn.Linear, QuantLinear))
                   and not getattr(m, "out_features", 0) == c.num_experts), None)
    expert_rows = max(1, round(rows * c.top_k_experts / c.num_experts))
    out = {}
    if isinstance(experts, QuantExperts):
        out["experts"] = _quantised_kernel(experts, expert_rows, rows * c.top_k_experts)
    elif experts is not None:
        out["experts"] = f"{dtype} matmuls (grid or per expert)"
    out["projections"] = _quantised_kernel(linear, rows) if isinstance(linear, QuantLinear) else f"{dtype} matmul"
    head = "int8 x int8 table (torch._int_mm)" if model.int8_table is not None else f"{dtype} matmul"
    out["head"] = head
    out["expert_rows"] = expert_rows
    return out


def cpu() -> dict:
    """The CPU's name, the instruction sets the kernels above depend on, torch's kernel level and threads."""
    name, flags = devices.cpu_info()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"name": name, "flags": [f for f in wanted if f in flags], "torch_capability": devices.cpu_capability(),
            "threads": torch.get_num_threads(), "int8_dot_products": devices.cpu_has_int8_dot(),
            "cores": os.cpu_count()}


def load_average() -> float | None:
    """The 1-minute load average (Linux): other jobs' threads on these cores slow every figure down."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
