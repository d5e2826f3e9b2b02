"""The split plan of a model over N ranks: which slice of every tensor a rank holds, the constraints a number
of ranks must meet (`check_split`), and the bytes a rank holds (`plan_bytes`). Pure functions of the config;
the modules that run a split are in `dgemma.parallel.modules`, the process group in `dgemma.parallel.group`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.config import ModelConfig
from dgemma.model.network import DiffusionGemma
from dgemma.quant.quantize import FORMATS, bytes_per_weight, group_size


class SplitError(ValueError):
    """A number of ranks the model (or its stored quantised layout) cannot be split over; one line naming
    the constraint."""



@dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of `size` along `dim`, scaled to the tensor at hand: a dense weight's slice and
    the same slice of its int8/int4 codes (two int4 codes a byte) and scales (one per group), which
    group-aligned bounds keep in step."""

    dim: int
    start: int
    stop: int
    size: int

    def index(self, shape) -> tuple[slice, ...]:
        n = shape[self.dim]
        return (*(slice(None),) * self.dim, slice(self.start * n // self.size, self.stop * n // self.size))


def even(dim: int, part: int, parts: int, size: int) -> Slice:
    """Part `part` of `parts` equal chunks of a dim `size` long."""
    return Slice(dim, part * size // parts, (part + 1) * size // parts, size)


def kv_slice(kv_heads: int, ranks: int, rank: int, head_dim: int) -> Slice:
    """Which KV heads rank `rank` keeps: kv / N of them where there are >= N, else the one its query heads
    read (query heads are grouped contiguously onto KV heads)."""
    if kv_heads >= ranks:
        return even(0, rank, ranks, kv_heads * head_dim)
    return even(0, rank * kv_heads // ranks, kv_heads, kv_heads * head_dim)


def mlp_slice(intermediate: int, ranks: int, rank: int, quantization: str | None) -> tuple[int, int]:
    """This rank's columns [start, stop) of the dense MLP: as even as whole quantisation groups allow (the
    26B's 2112 over 4 ranks in int4: 544, 544, 512, 512), so down_proj's row split falls on group bounds."""
    unit = group_size(intermediate, quantization) if quantization else 1
    units = intermediate // unit
    return rank * units // ranks * unit, (rank + 1) * units // ranks * unit


def check_split(config: ModelConfig, ranks: int, quantization: str | None = None, device: str = "cpu"):
    """SplitError naming the first constraint `ranks` breaks; reads nothing but the config.

    quantization: the int8/int4 layout the weights are stored in or will be quantised to: a row-split
    weight (o_proj, the dense down_proj) splits along its input dim, which must fall on group bounds so
    that every rank's groups are the groups of one process."""
    if ranks < 1:
        raise SplitError(f"--tensor-parallel must be >= 1, got {ranks}")
    if device.startswith("cuda") and ranks > torch.cuda.device_count():
        raise SplitError(f"--tensor-parallel {ranks} needs {ranks} GPUs, torch sees {torch.cuda.device_count()}")
    if ranks == 1:
        return
    c = config
    needs = [(c.num_heads, "attention heads (num_attention_heads)"),
             (c.num_experts, "routed experts (num_experts)")]  # the vocabulary is padded (`vocab_rows`)
    for count, what in needs:
        if count % ranks:
            raise SplitError(f"--tensor-parallel {ranks} does not divide the {count} {what}")
    for kv, what in ((c.num_kv_heads, "sliding"), (c.num_global_kv_heads, "full")):
        if kv % ranks and ranks % kv:
            raise SplitError(f"--tensor-parallel {ranks} neither divides nor is a multiple of the {kv} KV heads of "
                             f"the {what} attention layers")
    widths = {c.num_heads * c.head_dim: "o_proj (sliding layers)"}
    if any(not c.is_sliding(i) for i in range(c.num_layers)):
        widths[c.num_heads * c.global_head_dim] = "o_proj (full layers)"
    for width, name in widths.items() if quantization else ():
        group = group_size(width, quantization)
        if (width // ranks) % group:
            raise SplitError(f"{quantization} weights of {name} ({width} inputs in groups of {group}) cannot split "
                             f"into {ranks} slices on group bounds; use another --tensor-parallel")
    group = group_size(c.intermediate_size, quantization) if quantization else 1
    if c.intermediate_size // group < ranks:
        how = f" in {quantization} groups of {group}" if quantization else ""
        raise SplitError(f"the dense MLP's {c.intermediate_size} columns{how} cannot split over {ranks} ranks")


def vocab_rows(vocab_size: int, ranks: int) -> int:
    """The embedding rows each rank holds: the vocabulary padded to a multiple of `ranks`, over `ranks`."""
    return -(-vocab_size // ranks)


def parameter_slices(config: ModelConfig, ranks: int, rank: int, quantization: str | None = None) -> dict[str, Slice]:
    """Our dense parameter name -> the slice rank `rank` holds; names not listed are replicated."""
    inner = config.intermediate_size
    rows = vocab_rows(config.vocab_size, ranks)  # the last rank's slice may reach past V (its padding rows)
    out: dict[str, Slice] = {"embed_tokens.weight": Slice(0, rank * rows, (rank + 1) * rows, config.vocab_size)}
    start, stop = mlp_slice(inner, ranks, rank, quantization)
    for i in range(config.num_layers):
        p, d = f"layers.{i}.", config.layer_head_dim(i)
        kv = kv_slice(config.layer_kv_heads(i), ranks, rank, d)
        out[p + "self_attn.q_proj.weight"] = even(0, rank, ranks, config.num_heads * d)
        out[p + "self_attn.k_proj.weight"] = kv
        if config.is_sliding(i):
            out[p + "self_attn.v_proj.weight"] = kv
        out[p + "self_attn.o_proj.weight"] = even(1, rank, ranks, config.num_heads * d)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = Slice(0, start, stop, inner)
        out[p + "mlp.down_proj.weight"] = Slice(1, start, stop, inner)
        out[p + "experts.gate_up_proj"] = out[p + "experts.down_proj"] = even(0, rank, ranks, config.num_experts)
    return out


def stored_slice(name: str, slices: dict[str, Slice]) -> Slice | None:
    """The slice of a stored tensor: a dense weight's own, or that of the weight whose int8/int4 codes or
    scales it holds (`QuantLinear.qweight/.scales`, `QuantExperts.<name>_q/_scales`)."""
    if name in slices:
        return slices[name]
    prefix, leaf = name.rsplit(".", 1)
    if leaf in ("qweight", "scales"):
        return slices.get(prefix + ".weight")
    for base in ("gate_up_proj", "down_proj"):
        if leaf in (f"{base}_q", f"{base}_scales"):
            return slices.get(f"{prefix}.{base}")
    return None


def local_config(config: ModelConfig, ranks: int) -> ModelConfig:
    """The config with this rank's head counts (the same on every rank)."""
    return config.replace(num_heads=config.num_heads // ranks, num_kv_heads=max(1, config.num_kv_heads // ranks),
                          num_global_kv_heads=max(1, config.num_global_kv_heads // ranks))


def plan_bytes(config: ModelConfig, ranks: int) -> dict[str, int]:
    """Weight bytes one rank holds, by format: bf16, int8 and int4 (quantised as dgemma quantises: every
    linear and expert tensor but the router and the vision tower, one fp16 scale per group; the embedding
    stays bf16). Rank 0's share, the largest (uneven MLP splits put the extra groups first)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    out = {}
    for fmt in ("bf16", *FORMATS):
        per_weight = bytes_per_weight(fmt)  # a quantised weight: its code and its share of its group's scale
        slices = parameter_slices(config, ranks, 0, None if fmt == "bf16" else fmt)
        total = 0.0
        for name, p in model.named_parameters():
            n = p.numel() * (slices[name].stop - slices[name].start) // slices[name].size if name in slices \
                else p.numel()
            quantised = p.dim() >= 2 and "router" not in name and not name.startswith(
                ("vision_tower", "embed_vision", "embed_tokens"))
            total += n * (per_weight if quantised else bytes_per_weight("bf16"))
        out[fmt] = round(total)
    return out
