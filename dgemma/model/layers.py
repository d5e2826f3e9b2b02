"""Building blocks shared by the network, the routed experts and the vision tower: RMSNorm, the tanh GELU
and the gated MLP (whose fused gate|up copy for compiled graphs lives in `dgemma.model.compilation`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.model.compilation import FusedLinears, fused_inside_graphs


class RMSNorm(nn.Module):
    """x / rms(x) [* weight], computed in fp32. `with_scale=False` is the scale-free variant."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one pass instead of the five elementwise ops of the textbook form
        weight = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).type_as(x)


_GELU_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation. Inside a compiled graph it is written as x * sigmoid(2u), the same
    function as 0.5 x (1 + tanh(u)) (to ~1e-6), because inductor's CPU sigmoid is ~2x faster than its
    tanh; eagerly, torch's one fused kernel is faster than the five ops of that form."""
    if torch.compiler.is_dynamo_compiling():
        x32 = x.float()
        return (x32 * torch.sigmoid(_GELU_SCALE * (x32 + 0.044715 * x32 * x32 * x32))).to(x.dtype)
    return F.gelu(x, approximate="tanh")


def gated_gelu(gate_up: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(..., 2I, ...) fused gate and up projections along `dim` -> gelu(gate) * up (..., I, ...)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return gelu(gate) * up


class GatedMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)): the dense MLP of every layer and of the self-conditioning block."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.fused_gate_up: FusedLinears | None = None  # see FusedLinears

    def forward(self, x):
        if fused_inside_graphs(self.fused_gate_up):
            gate, up = self.fused_gate_up(x)
            return self.down_proj(gelu(gate) * up)
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))
