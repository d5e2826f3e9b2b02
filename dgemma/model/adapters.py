"""LoRA adapters in PEFT's format, and several of them served beside the base model, one per batch row.

PEFT's format (what `peft.PeftModel.from_pretrained` reads onto transformers' DiffusionGemmaForBlockDiffusion):
  adapter_config.json        peft_type LORA, r, lora_alpha, target_modules (the exact module paths)
  adapter_model.safetensors  base_model.model.<module>.lora_A.weight (r, in), ....lora_B.weight (out, r)
transformers keeps the encoder's layers and the decoder's as two module trees with tied weights
(model.encoder.language_model.layers.* and model.decoder.layers.*); dgemma runs both through one. A layer's
adapter is therefore written under both paths, and on reading the two must agree. The fused experts have
no PEFT form (PEFT adapts modules, not an (E, out, in) bank), so an adapter of the experts is not written.
Beside PEFT's files, dgemma_adapter.json records the base model's config hash, so that serving refuses
an adapter trained on another base model.

Serving (`RowLoRALinear`): each adapted linear keeps every served adapter stacked, index 0 the base
model (zeros); a forward over rows r1..rn adds, per row, scale[a] * B[a] @ A[a] x for that row's adapter a:

    y = base(x) + ((x @ A[ids]^T) @ B[ids]^T) * scale[ids]      x (n, T, in), A (N+1, r, in), B (N+1, out, r)

The rows' adapter ids are set by the engine's runner around each forward (`AdapterRows`); outside one
(None) the layer is its base. Adapters of different ranks are zero-padded to the largest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from dgemma.model.checkpoint import checkpoint_key

PEFT_PREFIX = "base_model.model."
ENCODER_LAYERS, DECODER_LAYERS = "model.encoder.language_model.layers.", "model.decoder.layers."
CONFIG_FILE, WEIGHTS_FILE, DGEMMA_FILE = "adapter_config.json", "adapter_model.safetensors", "dgemma_adapter.json"


class AdapterError(ValueError):
    """An adapter folder that cannot be read or does not fit the model."""


def base_fingerprint(config) -> str:
    """The base model's config, hashed: what an adapter records and serving compares."""
    fields = dataclasses.asdict(config)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def transformers_paths(module: str) -> list[str]:
    """dgemma's module name -> the transformers module path(s) that hold it: a layer's module is in the
    decoder and, tied, in the encoder."""
    path = checkpoint_key(module + ".weight").removesuffix(".weight")
    if path.startswith(DECODER_LAYERS):
        return [path, ENCODER_LAYERS + path.removeprefix(DECODER_LAYERS)]
    return [path]


# -- writing and reading PEFT's format --------------------------------------------------------------------

def write_peft_adapter(out: Path, adapters: dict[str, torch.Tensor], *, rank: int, alpha: float, dropout: float,
                       base_model: str, config) -> Path:
    """`adapters`: the training model's names (`<module>.lora_A` (r, in), `<module>.lora_B` (out, r)) -> out/."""
    from safetensors.torch import save_file

    modules = sorted({n.removesuffix(".lora_A") for n in adapters if n.endswith(".lora_A")})
    if any(".lora_gate_up_" in n or ".lora_down_" in n for n in adapters):
        raise AdapterError("the experts' adapters have no PEFT form (PEFT adapts modules, not an expert bank)")
    tensors, paths = {}, []
    for module in modules:
        for path in transformers_paths(module):
            paths.append(path)
            for half in ("lora_A", "lora_B"):
                tensors[f"{PEFT_PREFIX}{path}.{half}.weight"] = adapters[f"{module}.{half}"].float().clone()  # one copy per path
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "r": rank,
                   "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(paths), "bias": "none",
                   "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                   "init_lora_weights": True, "inference_mode": True}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    (out / DGEMMA_FILE).write_text(json.dumps({"base_config_hash": base_fingerprint(config)}) + "\n")
    return out


@dataclass
class Adapter:
    name: str
    scale: float  # lora_alpha / r (PEFT's rsLoRA: / sqrt(r))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # dgemma module -> (A (r, in), B (out, r))
    base_config_hash: str | None  # None: a PEFT folder made elsewhere (only shapes are checked)


def read_peft_adapter(name: str, folder: Path) -> Adapter:
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{folder}: not a PEFT adapter folder (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: only plain LoRA adapters (no DoRA, no bias) are served")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
    by_path: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        path, _, half = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if half not in ("lora_A", "lora_B"):
            raise AdapterError(f"{folder}: unexpected tensor {key}")
        by_path.setdefault(path, {})[half] = tensor.float()
    weights = {}
    for path, pair in by_path.items():
        if path.startswith(ENCODER_LAYERS):
            twin = by_path.get(DECODER_LAYERS + path.removeprefix(ENCODER_LAYERS))
            if twin is None or any(not torch.equal(pair[h], twin[h]) for h in pair):
                raise AdapterError(f"{folder}: {path} differs from its decoder twin; dgemma runs one module for both")
            continue
        if not path.startswith("model.decoder."):
            raise AdapterError(f"{folder}: {path} is not a module of the text model")
        weights[path.removeprefix("model.decoder.")] = (pair["lora_A"], pair["lora_B"])
    marker = folder / DGEMMA_FILE
    fingerprint = json.loads(marker.read_text()).get("base_config_hash") if marker.is_file() else None
    return Adapter(name, scale, weights, fingerprint)


# -- serving several adapters at once -----------------------------------------------------------------------

class AdapterRows:
    """The adapter index of each row of the forward being run, (n,) long on the model's device, or None."""

    def __init__(self):
        self.ids: torch.Tensor | None = None

    @contextlib.contextmanager
    def set(self, ids: torch.Tensor | None):
        self.ids = ids
        try:
            yield
        finally:
            self.ids = None


class RowLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rows: AdapterRows, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.base, self.rows = base, rows
        self.register_buffer("A", A.to(base.weight.dtype), persistent=False)  # (N+1, r, in), [0] zeros
        self.register_buffer("B", B.to(base.weight.dtype), persistent=False)  # (N+1, out, r)
        self.register_buffer("scale", scale.to(base.weight.dtype), persistent=False)  # (N+1,)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ids = self.rows.ids
        if ids is None:
            return y
        low = torch.matmul(torch.matmul(x, self.A[ids].transpose(1, 2)), self.B[ids].transpose(1, 2))  # (n, T, out)
        return y + low * self.scale[ids][:, None, None]


def install_adapters(model: nn.Module, adapters: list[Adapter]) -> AdapterRows:
    """Wrap every module some adapter adapts in a RowLoRALinear holding all of them (adapter i is index
    i + 1; 0 is the base). Raises AdapterError, before changing anything, for an adapter of another base
    model: a different config hash, a module the model lacks, or a shape that does not fit."""
    fingerprint = base_fingerprint(model.config)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
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
        setattr(parent, attr, RowLoRALinear(base, rows, A.to(base.weight.device), B.to(base.weight.device),
                                            scale.to(base.weight.device)))
    model.adapter_rows = rows
    return rows
