"""Building blocks shared by the network, the routed experts and the vision tower: RMSNorm, the tanh GELU,
the gated MLP, and the fused copy of projections that read the same input (`FusedLinears`), which compiled
graphs on a CPU run as one matmul (`dgemma.compilation.steps.compile_model` makes them)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """x / rms(x) [* weight], computed in fp32. `with_scale=False` is the scale-free variant."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        x32 = x.float()
        if x.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_dynamo_compiling():
            # torch's kernel: fused on a GPU; autograd and compiled graphs take it whole
            return F.rms_norm(x32, (x.shape[-1],), weight, self.eps).type_as(x)
        # eagerly on a CPU: torch's rms_norm there is these ops in this order (the same bits), but its
        # out-of-place broadcast product by the scale is ~5x slower than multiplying it in place (256 x 2,816
        # fp32: 2.1 against 0.4 ms; ~11 norms a layer)
        out = x32.mul(torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps)))
        return (out if weight is None else out.mul_(weight)).type_as(x)


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


class FusedLinears:
    """Bias-free Linear layers of one module that read the same input, as one (sum of outs, in) weight: one
    matmul instead of several (on 2 CPU cores at a canvas's 256 rows, q|k|v ~90 us faster per layer than
    three matmuls, gate|up ~30 us). A copy beside the layers' own weights (bench-20m: 6.9 MB more, 17% of
    its weights; the routed experts, most of a large MoE, are not copied), used by compiled graphs on a CPU
    (`compile_model` makes it), and made again by `refresh` whenever a weight changed in
    place (its version counter), was replaced, or its layer is no longer a plain nn.Linear (LoRA,
    quantised): then `weight` is None and the layers run one by one. (Views into one fused tensor would
    save the copy, but safetensors refuses to save weights that share memory.)"""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.weight: torch.Tensor | None = None
        self.splits = ()
        self._stamp = None
        self.refresh()

    def refresh(self):
        """Called eagerly before each compiled call; rebuilds only when a weight changed. The check reads the
        module's own dicts: through nn.Module's attribute lookup and a no_grad context it took ~23 us per
        copy (0.4 ms a bench-20m step for its 17 copies), this way ~3.5 us."""
        layers = [self.owner._modules[name] for name in self.names]
        if not all(type(layer) is nn.Linear and layer._parameters["bias"] is None for layer in layers):
            self.weight, self._stamp = None, None
            return
        weights = [layer._parameters["weight"] for layer in layers]
        stamp = [(w.data_ptr(), w._version, w.dtype) for w in weights]
        if stamp != self._stamp:
            self._rebuild(weights)
            self._stamp = stamp

    @torch.no_grad()
    def _rebuild(self, weights: list[torch.Tensor]):
        fused = torch.cat(weights)
        if self.weight is not None and self.weight.shape == fused.shape and self.weight.dtype == fused.dtype:
            self.weight.copy_(fused)  # the same tensor, so the compiled graph's guards still hold
        else:
            self.weight = fused
        self.splits = tuple(w.shape[0] for w in weights)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.splits, dim=-1)


def fused_inside_graphs(fused: FusedLinears | None) -> bool:
    """Whether to run the one fused matmul: inside a compiled graph, with a fused copy in place."""
    return fused is not None and fused.weight is not None and torch.compiler.is_dynamo_compiling()
