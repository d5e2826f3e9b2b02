"""LoRA adapters served beside the base model, several at once, one per batch row.

Each adapted linear (`RowLoRALinear`) keeps every served adapter stacked, index 0 the base model (zeros); a
forward over rows r1..rn adds, per row, scale[a] * B[a] @ A[a] x for that row's adapter a:

    y = base(x) + ((x @ A[ids]^T) @ B[ids]^T) * scale[ids]      x (n, T, in), A (N+1, r, in), B (N+1, out, r)

The rows' adapter ids are set by the engine's runner around each forward (`AdapterRows`); outside one
(None) the layer is its base. A packed forward (the step cache's, x (1, N, in) holding the active positions of
the n rows, `DiffusionGemma.decode_active`) also says each position's row (`AdapterRows.packed`), and every
position takes its row's adapter. Adapters of different ranks are zero-padded to the largest. Reading and
writing PEFT's adapter folders: `dgemma.weights.peft`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn as nn


class AdapterError(ValueError):
    """An adapter folder that cannot be read or does not fit the model."""


def base_fingerprint(config) -> str:
    """The base model's config, hashed: what an adapter records and serving compares."""
    fields = dataclasses.asdict(config)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class Adapter:
    name: str
    scale: float  # lora_alpha / r (PEFT's rsLoRA: / sqrt(r))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # dgemma module -> (A (r, in), B (out, r))
    base_config_hash: str | None  # None: a PEFT folder made elsewhere (only shapes are checked)


class AdapterRows:
    """The adapter index of each row of the forward being run, (n,) long on the model's device, or None; in a
    packed forward also each packed position's row, `row_of` (N,)."""

    def __init__(self):
        self.ids: torch.Tensor | None = None
        self.row_of: torch.Tensor | None = None

    @contextlib.contextmanager
    def set(self, ids: torch.Tensor | None):
        self.ids = ids
        try:
            yield
        finally:
            self.ids = None

    @contextlib.contextmanager
    def packed(self, row_of: torch.Tensor):
        self.row_of = row_of
        try:
            yield
        finally:
            self.row_of = None


def _dtype_and_device(base: nn.Module) -> tuple[torch.dtype, torch.device]:
    """A linear layer's compute dtype and device without reading its weight: a quantised one
    (dgemma.quant.quantize.QuantLinear, `compute_dtype`) would dequantise it for that, and one whose only copy
    a kernel library holds (its buffers are meta tensors) has none to read; such a library runs on the CPU."""
    dtype = getattr(base, "compute_dtype", None)
    if dtype is None:
        return base.weight.dtype, base.weight.device
    device = next(base.buffers()).device
    return dtype, torch.device("cpu") if device.type == "meta" else device


def _is_linear(module: nn.Module) -> bool:
    """A plain nn.Linear or a quantised one (it has in_features, out_features and a compute dtype)."""
    return isinstance(module, nn.Linear) or all(hasattr(module, a) for a in ("in_features", "out_features", "compute_dtype"))


class RowLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rows: AdapterRows, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.base, self.rows = base, rows
        dtype, _ = _dtype_and_device(base)
        self.register_buffer("A", A.to(dtype), persistent=False)  # (N+1, r, in), [0] zeros
        self.register_buffer("B", B.to(dtype), persistent=False)  # (N+1, out, r)
        self.register_buffer("scale", scale.to(dtype), persistent=False)  # (N+1,)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ids = self.rows.ids
        if ids is None:
            return y
        if self.rows.row_of is not None:  # x (1, N, in): packed positions, each with its row's adapter
            return y + self._packed(x[0], ids[self.rows.row_of])[None]
        low = torch.matmul(torch.matmul(x, self.A[ids].transpose(1, 2)), self.B[ids].transpose(1, 2))  # (n, T, out)
        return y + low * self.scale[ids][:, None, None]

    def _packed(self, x: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """x (N, in), own (N,) each position's adapter -> (N, out): every adapter's A on every position (one matmul
        of (N+1) r columns, small beside the base layer's), each position's own kept and scaled, then B."""
        stacked, rank, _ = self.A.shape
        low = (x @ self.A.reshape(stacked * rank, -1).T).view(-1, stacked, rank)  # (N, adapters, r)
        keep = torch.nn.functional.one_hot(own, stacked).to(x.dtype) * self.scale  # (N, adapters)
        return (low * keep[:, :, None]).flatten(1) @ self.B.transpose(1, 2).reshape(stacked * rank, -1)


def install_adapters(model: nn.Module, adapters: list[Adapter]) -> AdapterRows:
    """Wrap every module some adapter adapts in a RowLoRALinear holding all of them (adapter i is index
    i + 1; 0 is the base). Raises AdapterError, before changing anything, for an adapter of another base
    model: a different config hash, a module the model lacks, or a shape that does not fit."""
    fingerprint = base_fingerprint(model.config)
    linears = {n: m for n, m in model.named_modules() if _is_linear(m)}  # quantised ones too: base(x) runs as it is
    for adapter in adapters:
        if adapter.base_config_hash is not None and adapter.base_config_hash != fingerprint:
            raise AdapterError(f"adapter {adapter.name!r} was trained on another base model (its config differs "
                               f"from the served model's)")
        for module, (A, B) in adapter.weights.items():
            base = linears.get(module)
            if base is None:
                raise AdapterError(f"adapter {adapter.name!r}: the served model has no linear module {module}")
            if A.shape[1] != base.in_features or B.shape[0] != base.out_features or A.shape[0] != B.shape[1]:
                raise AdapterError(f"adapter {adapter.name!r}: {module} is {tuple(B.shape[:1]) + tuple(A.shape[1:])}"
                                   f" (out, in); the served model's is ({base.out_features}, {base.in_features})")
    rows = AdapterRows()
    rank = max((A.shape[0] for a in adapters for A, _ in a.weights.values()), default=0)
    scale = torch.tensor([0.0] + [a.scale for a in adapters])
    for module in sorted({m for a in adapters for m in a.weights}):
        base = linears[module]
        A = torch.zeros(len(adapters) + 1, rank, base.in_features)
        B = torch.zeros(len(adapters) + 1, base.out_features, rank)
        for i, adapter in enumerate(adapters, start=1):
            if module in adapter.weights:
                a, b = adapter.weights[module]
                A[i, : a.shape[0]], B[i, :, : b.shape[1]] = a, b
        parent_name, _, attr = module.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        _, device = _dtype_and_device(base)
        setattr(parent, attr, RowLoRALinear(base, rows, A.to(device), B.to(device), scale.to(device)))
    model.adapter_rows = rows
    return rows
