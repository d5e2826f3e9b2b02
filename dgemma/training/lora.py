"""LoRA: low-rank adapters on chosen linear layers and, optionally, on the fused experts.

    W' = W + (alpha / r) * B @ A,   A (r, in) random,  B (out, r) zero  -> training starts at W' = W.

Targets are matched against module names by suffix: "q_proj" adapts every `*.q_proj`, "mlp.down_proj"
only the dense MLP's (not the self-conditioning block's), "experts" every fused expert bank, which gets
one (A, B) pair per expert and per matrix through `Experts.expert_weights(e)`.

Merging is a pure function of a state dict (`merge_lora_state`), so it works the same on a plain model
and on the full state dict gathered from FSDP shards.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.config import ConfigError
from dgemma.model.experts import Experts
from dgemma.training.config import DEFAULT_TARGETS


def lora_init_(A: torch.Tensor, generator: torch.Generator | None = None):
    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)  # the usual LoRA init for A; B starts at zero


class LoRALinear(nn.Module):
    """base(x) + scale * B(A(dropout(x))); the base layer is frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.scale = alpha / rank
        kw = dict(device=base.weight.device, dtype=torch.float32)  # adapters learn: fp32 even on a bf16 base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        lora_init_(self.lora_A)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale


class LoRAExperts(Experts):
    """Fused experts with per-expert adapters: gate_up (E, 2I, H) += scale * B_gu[e] @ A_gu[e], same for down."""

    grouped = False  # the adapter term is added in `project`, on the padded grid

    def __init__(self, base: Experts, rank: int, alpha: float):
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj  # shared, frozen
        self.gate_up_proj.requires_grad_(False)
        self.down_proj.requires_grad_(False)
        self.scale = alpha / rank
        E, two_i, H = self.gate_up_proj.shape
        I = self.down_proj.shape[2]
        kw = dict(device=self.gate_up_proj.device, dtype=torch.float32)  # adapters learn: fp32 even on a bf16 base
        self.lora_gate_up_A = nn.Parameter(torch.empty(E, rank, H, **kw))
        self.lora_gate_up_B = nn.Parameter(torch.zeros(E, two_i, rank, **kw))
        self.lora_down_A = nn.Parameter(torch.empty(E, rank, I, **kw))
        self.lora_down_B = nn.Parameter(torch.zeros(E, H, rank, **kw))
        for e in range(E):
            lora_init_(self.lora_gate_up_A.data[e])
            lora_init_(self.lora_down_A.data[e])

    def expert_weights(self, e: int):
        gate_up = self.gate_up_proj[e] + self.scale * (self.lora_gate_up_B[e] @ self.lora_gate_up_A[e])
        down = self.down_proj[e] + self.scale * (self.lora_down_B[e] @ self.lora_down_A[e])
        return gate_up, down

    def project(self, name: str, columns: torch.Tensor) -> torch.Tensor:
        """Batched path: the frozen product plus scale * B[e] @ (A[e] @ columns[e]), never a merged weight."""
        A, B = getattr(self, f"lora_{name[:-5]}_A"), getattr(self, f"lora_{name[:-5]}_B")  # "gate_up", "down"
        low_rank = torch.bmm(B, torch.bmm(A, columns.to(A.dtype)))
        return super().project(name, columns) + (self.scale * low_rank).to(columns.dtype)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, *, rank: int, alpha: float, targets=DEFAULT_TARGETS, dropout: float = 0.0) -> int:
    """Freeze the model and wrap every target in an adapter. Returns the number of adapted modules.

    Raises ConfigError (before anything is changed) for a target that matches no module.
    """
    if rank < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ConfigError(f"LoRA needs rank >= 1, alpha > 0, 0 <= dropout < 1 (got {rank}, {alpha}, {dropout})")
    targets = tuple(targets)
    if not targets:
        raise ConfigError("LoRA needs at least one target")
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    chosen: dict[str, nn.Module] = {}
    for target in targets:
        pool = experts if target == "experts" else linear
        hits = {n: m for n, m in pool.items() if _matches(n, target)}
        if not hits:
            example = sorted({n.split(".")[-1] for n in linear})
            raise ConfigError(
                f"LoRA target {target!r} matches no module; targets are name suffixes such as "
                f"{', '.join(example)}, mlp.gate_proj, or 'experts'"
            )
        chosen.update(hits)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, Experts):
            wrapped = LoRAExperts(module, rank, alpha)
        else:
            wrapped = LoRALinear(module, rank, alpha, dropout)
        setattr(parent, attr, wrapped)
    return len(chosen)


# ---------------------------------------------------------------------------------------------
# Merging (export): adapter state dict -> plain DiffusionGemma state dict
# ---------------------------------------------------------------------------------------------
def merge_lora_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Fold adapters into their base weights and restore the plain parameter names.

    `x.base.weight` + `x.lora_A` + `x.lora_B` -> `x.weight`; fused experts get W[e] += scale * B[e] @ A[e]
    for both matrices (a batched matmul). Other entries pass through unchanged (not copied).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith((".lora_A", ".lora_B")) or ".lora_gate_up_" in name or ".lora_down_" in name:
            continue
        if name.endswith(".base.weight"):
            prefix = name[: -len(".base.weight")]
            A, B = state[prefix + ".lora_A"], state[prefix + ".lora_B"]
            out[prefix + ".weight"] = (tensor.float() + scale * (B.float() @ A.float())).to(tensor.dtype)
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and (
            name.rpartition(".")[0] + ".lora_down_A" in state
        ):
            prefix, _, which = name.rpartition(".")
            kind = "gate_up" if which == "gate_up_proj" else "down"
            A, B = state[f"{prefix}.lora_{kind}_A"], state[f"{prefix}.lora_{kind}_B"]
            out[name] = (tensor.float() + scale * torch.bmm(B.float(), A.float())).to(tensor.dtype)
        else:
            out[name] = tensor
    return out
