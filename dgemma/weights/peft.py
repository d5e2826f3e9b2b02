"""LoRA adapters in PEFT's format: what `dgemma train --lora` writes and `dgemma serve --lora` reads.

PEFT's format (what `peft.PeftModel.from_pretrained` reads onto transformers' DiffusionGemmaForBlockDiffusion):
  adapter_config.json        peft_type LORA, r, lora_alpha, target_modules (the exact module paths)
  adapter_model.safetensors  base_model.model.<module>.lora_A.weight (r, in), ....lora_B.weight (out, r)
transformers keeps the encoder's layers and the decoder's as two module trees with tied weights
(model.encoder.language_model.layers.* and model.decoder.layers.*); dgemma runs both through one. A layer's
adapter is therefore written under both paths, and on reading the two must agree. The fused experts have
no PEFT form (PEFT adapts modules, not an (E, out, in) bank), so an adapter of the experts is not written.
Beside PEFT's files, dgemma_adapter.json records the base model's config hash, so that serving refuses
an adapter trained on another base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dgemma.model.adapters import Adapter, AdapterError, base_fingerprint
from dgemma.weights.checkpoint import checkpoint_key

PEFT_PREFIX = "base_model.model."
ENCODER_LAYERS, DECODER_LAYERS = "model.encoder.language_model.layers.", "model.decoder.layers."
CONFIG_FILE, WEIGHTS_FILE, DGEMMA_FILE = "adapter_config.json", "adapter_model.safetensors", "dgemma_adapter.json"


def transformers_paths(module: str) -> list[str]:
    """dgemma's module name -> the transformers module path(s) that hold it: a layer's module is in the
    decoder and, tied, in the encoder."""
    path = checkpoint_key(module + ".weight").removesuffix(".weight")
    if path.startswith(DECODER_LAYERS):
        return [path, ENCODER_LAYERS + path.removeprefix(DECODER_LAYERS)]
    return [path]


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


def read_peft_adapter(name: str, folder: Path) -> Adapter:
    """The adapter in a PEFT folder; AdapterError, one line naming the file, for a folder that is not one or
    whose files are damaged (JSON that does not parse, a truncated safetensors file, a half of a pair missing)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{folder}: not a PEFT adapter folder (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_json(folder / CONFIG_FILE)
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: only plain LoRA adapters (no DoRA, no bias) are served")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{folder / CONFIG_FILE}: r and lora_alpha must be numbers, got "
                           f"{config.get('r')!r} and {config.get('lora_alpha')!r}") from None
    scale = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
    try:
        stored = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: unreadable safetensors file ({e})") from None
    by_path: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in stored.items():
        path, _, half = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if half not in ("lora_A", "lora_B"):
            raise AdapterError(f"{folder}: unexpected tensor {key}")
        by_path.setdefault(path, {})[half] = tensor.float()
    for path, pair in by_path.items():
        if len(pair) < 2:
            raise AdapterError(f"{folder / WEIGHTS_FILE}: {path} has {next(iter(pair))} but not its other half")
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
    fingerprint = _read_json(marker).get("base_config_hash") if marker.is_file() else None
    return Adapter(name, scale, weights, fingerprint)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return value
