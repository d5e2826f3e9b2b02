"""Which kernel multiplies each part of a model, and on what machine: what int8 compute's start line says
(`start_line`) and `dgemma bench` prints and records beside its figures, so that a tokens/s figure says what ran.

The parts: the routed experts, the attention projections (q/k/v/o), the dense MLPs (gate, up, down), the LM
head and the self-conditioning soft embedding. Which kernel runs depends on where each weight lives
(`dgemma.quant.openvino` holds the only copy of the int4 weights it takes) and on the rows a product sees
(`dgemma.quant.int8_compute` widens int4 codes to int8 only from `MIN_ROWS_TO_WIDEN` rows), so each is
described for a row count: a canvas step at batch 1 multiplies 256 rows by every projection, but an expert
sees its share of them (~16 of 256 x top-8 over 128 experts), and an AR token 1 row.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dgemma import devices, processes
from dgemma.model.experts import Experts
from dgemma.quant import int8_compute
from dgemma.quant.quantize import QuantExperts, QuantLinear

INT4_KERNEL = "torch int4 (_weight_int4pack_mm_for_cpu, {dtype} activations)"
PARTS = ("experts", "attention projections", "dense MLP", "head", "soft embedding")


def _quantised_kernel(module: nn.Module, rows: int) -> str:
    """What a QuantLinear / QuantExperts runs for a product of `rows` rows (experts: per expert)."""
    dtype = str(module.compute_dtype).replace("torch.", "")
    if module.library is not None:
        library = module.library
        return (f"OpenVINO int4 x {library.activations}, groups of {library.group} ({library.layout}; its copy "
                "is the only one)")
    if module.int8 is not None:
        if module.fmt == "int8":
            return "int8 x int8 (torch._int_mm)"
        weights = (module.qweight if isinstance(module, QuantLinear) else module.gate_up_proj_q[0]).numel() * 2
        if int8_compute.widening_pays(rows, weights):
            return "int8 x int8 (int4 widened, torch._int_mm)"
    if module.kernel_layout:
        return INT4_KERNEL.format(dtype=dtype)
    return f"{module.fmt} dequantised to {dtype}, then a {dtype} matmul"


def _described(modules: list, rows: int, dtype: str) -> str:
    """The kernel of a part held by these modules (one per layer); where the library holds some layers' weights
    and memory kept the others on dgemma's copy, both, with the count."""
    if not modules or not isinstance(modules[0], (QuantLinear, QuantExperts)):
        return f"{dtype} matmuls (grid or per expert)" if modules and isinstance(modules[0], Experts) else f"{dtype} matmul"
    on = [m for m in modules if m.library is not None]
    if not on or len(on) == len(modules):
        return _quantised_kernel(modules[0], rows)
    off = next(m for m in modules if m.library is None)
    return (f"{_quantised_kernel(on[0], rows)} in {len(on)} of {len(modules)} layers, the others "
            f"{_quantised_kernel(off, rows)}")


def kernels(model: nn.Module, rows: int) -> dict:
    """{part: kernel} for a forward over `rows` token rows (batch x positions) of `model`, and "expert_rows"."""
    dtype = str(model.dtype).replace("torch.", "")
    c = model.config
    expert_rows = max(1, round(rows * c.top_k_experts / c.num_experts))
    out = {}
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if experts:
        out["experts"] = _described(experts, expert_rows, dtype)
    for part, name in (("attention projections", "q_proj"), ("dense MLP", "gate_proj")):
        out[part] = _described([m for n, m in model.layers.named_modules() if n.rsplit(".", 1)[-1] == name], rows, dtype)
    table = "int8 x int8 table (torch._int_mm)" if model.int8_table is not None else f"{dtype} matmul"
    out["head"] = out["soft embedding"] = table
    out["expert_rows"] = expert_rows
    return out


def start_line(model: nn.Module, batch: int = 1) -> str:
    """One line: each part's kernel at a canvas step of `batch` rows and, where it differs, at an AR token."""
    canvas = kernels(model, batch * model.config.canvas_length)
    token = kernels(model, batch)
    parts = [f"{part} {canvas[part]}" + (f" (AR: {token[part]})" if token[part] != canvas[part] else "")
             for part in PARTS if part in canvas]
    return f"CPU kernels at a canvas step ({batch * model.config.canvas_length} rows): " + "; ".join(parts)


def cpu() -> dict:
    """The CPU's name, the instruction sets the kernels above depend on, torch's kernel level and threads, and how
    long torch's idle OpenMP threads spin (`processes.openmp_spin`, "default" where the environment leaves it to
    libgomp; see `processes.shorten_openmp_spin`)."""
    name, flags = devices.cpu_info()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    spin = processes.openmp_spin() or "default"
    return {"name": name, "flags": [f for f in wanted if f in flags], "torch_capability": devices.cpu_capability(),
            "threads": torch.get_num_threads(), "int8_dot_products": devices.cpu_has_int8_dot(),
            "cores": os.cpu_count(), "openmp_spin": spin}


def load_average() -> float | None:
    """The 1-minute load average (Linux): other jobs' threads on these cores slow every figure down."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
