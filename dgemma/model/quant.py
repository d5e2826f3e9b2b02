"""Weight-only quantisation as a module swap (int8 and int4, symmetric, group-wise along the input dim).

Every `nn.Linear` and the fused 3-D expert tensors are replaced; the common quantisers skip the latter,
which is where 90% of DiffusionGemma's weights live. The tied embedding / LM head stays in the model
dtype: the entropy-bound sampler accepts tokens by the entropy of these logits, and 4-bit logits make
it run many more steps (seen in the MLX port), while the table is only 3% of the weights.

Quantising happens while loading (`load_model(..., quantize="int4")`): modules are swapped on the meta
device first and each dense tensor is quantised the moment it is read, so peak memory stays near the
quantised size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.model.experts import Experts

FORMATS = ("int8", "int4")
GROUP_SIZE = {"int8": 64, "int4": 32}  # weights per scale; int4 needs finer groups for the same error


def quantize_tensor(w: torch.Tensor, fmt: str, group_size: int | None = None):
    """w (..., out, in) -> (q, scales). int8: q int8 (..., out, in); int4: q uint8 (..., out, in/2), two
    nibbles per byte. scales (..., out, in/group) fp16 with w ≈ q * scale per group (2 bytes a group:
    int4 costs 0.5625 bytes a weight with groups of 32)."""
    *lead, out_f, in_f = w.shape
    group_size = group_size or GROUP_SIZE[fmt]
    if in_f % group_size:
        group_size = in_f  # fall back to one group per row for odd widths
    qmax = 127 if fmt == "int8" else 7
    qmin = -qmax - 1 if fmt == "int4" else -qmax
    groups = w.float().reshape(*lead, out_f, in_f // group_size, group_size)
    absmax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # int4 has 16 levels: clipping the largest weights a little lowers the error of all the others.
    # Per group, keep the clip ratio with the least squared error (int8 has enough levels not to need it).
    ratios = (1.0,) if fmt == "int8" else (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
    best_err = best_scale = None
    for r in ratios:
        scale = absmax * r / qmax
        err = (torch.round(groups / scale).clamp(qmin, qmax) * scale - groups).pow(2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    best_scale = best_scale.to(torch.float16).float()  # stored as fp16: quantise against what is stored
    q = torch.round(groups / best_scale).clamp(qmin, qmax).to(torch.int8)
    scales = best_scale.squeeze(-1).to(torch.float16)
    q = q.reshape(*lead, out_f, in_f)
    if fmt == "int4":
        nibbles = (q + 8).to(torch.uint8)  # 0..15
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return q, scales


def dequantize_tensor(q: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if fmt == "int4":
        low = (q & 0x0F).to(torch.int8) - 8
        high = (q >> 4).to(torch.int8) - 8
        q = torch.stack([low, high], dim=-1).flatten(-2)
    *lead, out_f, in_f = q.shape
    groups = scales.shape[-1]
    w = q.reshape(*lead, out_f, groups, in_f // groups).float() * scales.float()[..., None]
    return w.reshape(*lead, out_f, in_f).to(dtype)


class QuantLinear(nn.Module):
    """A bias-free linear layer with quantised weights, dequantised per call."""

    def __init__(self, in_features: int, out_features: int, fmt: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.compute_dtype = in_features, out_features, fmt, dtype
        packed_in = in_features // 2 if fmt == "int4" else in_features
        group = GROUP_SIZE[fmt] if in_features % GROUP_SIZE[fmt] == 0 else in_features
        self.register_buffer("qweight", torch.empty(out_features, packed_in, dtype=torch.uint8 if fmt == "int4" else torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, in_features // group, dtype=torch.float16,
                                                   device=device))

    def load_dense(self, weight: torch.Tensor):
        # the dense tensor's device wins: while loading, this module still sits on the meta device
        self.qweight, self.scales = quantize_tensor(weight, self.fmt)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_tensor(self.qweight, self.scales, self.fmt, self.compute_dtype)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class QuantExperts(Experts):
    """Fused experts with quantised (E, out, in) tensors; one expert is dequantised when it runs."""

    batched = False  # dequantising every expert at once would cost the memory quantisation saved

    def __init__(self, base: Experts, fmt: str, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.fmt, self.compute_dtype = fmt, dtype
        E, two_i, h = base.gate_up_proj.shape
        self.num_experts = E
        for name, (out_f, in_f) in (("gate_up_proj", (two_i, h)), ("down_proj", (h, two_i // 2))):
            packed = in_f // 2 if fmt == "int4" else in_f
            group = GROUP_SIZE[fmt] if in_f % GROUP_SIZE[fmt] == 0 else in_f
            qdtype = torch.uint8 if fmt == "int4" else torch.int8
            self.register_buffer(f"{name}_q", torch.empty(E, out_f, packed, dtype=qdtype, device=base.gate_up_proj.device))
            self.register_buffer(f"{name}_scales", torch.empty(E, out_f, in_f // group, dtype=torch.float16,
                                                               device=base.gate_up_proj.device))

    def load_dense(self, name: str, tensor: torch.Tensor):
        q, s = quantize_tensor(tensor, self.fmt)
        setattr(self, f"{name}_q", q)
        setattr(self, f"{name}_scales", s)

    def expert_weights(self, e: int):
        return (
            dequantize_tensor(self.gate_up_proj_q[e], self.gate_up_proj_scales[e], self.fmt, self.compute_dtype),
            dequantize_tensor(self.down_proj_q[e], self.down_proj_scales[e], self.fmt, self.compute_dtype),
        )

    @property
    def gate_up_proj(self):  # Experts.forward reads the expert count from this tensor's first dim
        return self.gate_up_proj_q


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
    dense = {name: t for name, t in model.state_dict().items()}
    for name, module in swap_modules(model, fmt).items():
        load_dense_into(module, name, dense[name])
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (what the weights cost in memory)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
