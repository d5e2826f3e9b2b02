"""Loading and saving the Hugging Face checkpoint format (safetensors only, never pickle).

Layout, as transformers writes `DiffusionGemmaForBlockDiffusion`: the shared backbone is stored once,
under the decoder's names (`model.decoder.<our parameter name>`); the LM head is tied to the embedding
and not stored; `layer_scalar` is stored for the encoder too; the vision tower and its projection are
stored under `model.encoder.<our parameter name>` (`vision_tower.*`, `embed_vision.*`).
Loading builds the model on the meta device and fills it tensor by tensor from memory-mapped files,
so a checkpoint never needs two copies in RAM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dgemma.config import ConfigError, ModelConfig, SamplingConfig

PREFIX = "model.decoder."
ENCODER_PREFIX = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def stored_name(name: str) -> str:
    """Our parameter or buffer name -> its name in the checkpoint."""
    return "model.encoder." + name if name.startswith(("vision_tower.", "embed_vision.")) else PREFIX + name


class CheckpointError(Exception):
    """A checkpoint folder that cannot be loaded; the message names the file (and key)."""


def read_json(path: Path, error: type[Exception] = CheckpointError) -> dict:
    """A JSON object from a file, or one `error` naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def move_into_place(tmp: Path, out: Path):
    """Rename a finished temporary folder to `out`; an existing `out` is replaced only at this moment."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model folder")
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (not a Hugging Face model folder)")
    cfg = read_json(config_file)
    model_type = cfg.get("model_type")
    if model_type not in ("diffusion_gemma", "diffusion_gemma_text"):
        raise CheckpointError(
            f"{config_file}: model_type is {model_type!r}, expected 'diffusion_gemma' "
            "(a Gemma 4 checkpoint can be converted with `dgemma convert gemma4`)"
        )
    return cfg


def _weight_files(path: Path) -> dict[str, Path]:
    """Map every stored tensor name to the file that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = {}
        for name, shard in weight_map.items():
            shard_path = path / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: shard listed in {INDEX_FILE} is missing (holds {name})")
            files[name] = shard_path
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise CheckpointError(f"{path}: only pickle weights found; dgemma loads safetensors only")
        raise CheckpointError(f"{single}: missing (and no {INDEX_FILE})")
    try:
        with safe_open(str(single), "pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from None


def without_missing_vision(config: ModelConfig, path: Path) -> ModelConfig:
    """transformers' config.json always describes a vision tower; a checkpoint that stores none is text-only."""
    try:
        names = _weight_files(path)
    except CheckpointError:  # no weights to look at (`dgemma info` on a bare config): as the config says
        return config
    if config.vision is not None and not any(name.startswith(VISION_PREFIXES) for name in names):
        return config.replace(vision=None)
    return config


def load_model(path, device="cpu", dtype: torch.dtype = torch.float32, *, quantize: str | None = None):
    """Load a DiffusionGemma checkpoint folder into our `DiffusionGemma`."""
    from dgemma.model.network import DiffusionGemma

    path = Path(path)
    cfg = read_config(path)
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    gen_file = path / "generation_config.json"
    gen = read_json(gen_file) if gen_file.is_file() else {}
    eos = cfg.get("text_config", cfg).get("eos_token_id", config.eos_token_id)
    sampling = SamplingConfig.from_hf_dict(
        {"eos_token_id": eos, "pad_token_id": config.pad_token_id, **gen}
    )

    config = without_missing_vision(config, path)
    files = _weight_files(path)
    with torch.device("meta"):
        model = DiffusionGemma(config, sampling)
    model.hf_config, model.hf_generation_config = cfg, gen
    model.source_dir = path

    expected = dict(model.state_dict())  # meta tensors: names and shapes
    takers = {}
    if quantize:
        from dgemma.model.quant import feed_dense, swap_modules

        takers = swap_modules(model, quantize)  # quantised twins, filled as their tensors are read
    handles: dict[Path, object] = {}
    loaded: dict[str, torch.Tensor] = {}
    try:
        for name, meta in expected.items():
            stored = stored_name(name)
            if stored not in files and ENCODER_PREFIX + name in files:
                stored = ENCODER_PREFIX + name  # checkpoints that kept only the encoder copy
            if stored not in files:
                raise CheckpointError(f"{path}: tensor {stored} is missing from the checkpoint")
            file = files[stored]
            if file not in handles:
                try:
                    handles[file] = safe_open(str(file), "pt", device="cpu")
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
            try:
                tensor = handles[file].get_tensor(stored)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{file}: cannot read {stored} ({e})") from None
            if tuple(tensor.shape) != tuple(meta.shape):
                raise CheckpointError(
                    f"{file}: {stored} has shape {tuple(tensor.shape)}, the config implies {tuple(meta.shape)}"
                )
            tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            if name in takers:
                feed_dense(takers[name], name, tensor)
            else:
                loaded[name] = tensor
            del tensor
    finally:
        handles.clear()
    missing, unexpected = model.load_state_dict(loaded, assign=True, strict=False)
    left = [k for k in missing if not k.endswith(("qweight", "scales", "_q"))]
    if left or unexpected:
        raise CheckpointError(f"{path}: internal mismatch loading {left or unexpected}")
    del loaded
    model.quantization = quantize
    return model.eval()


def _state_for_saving(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous().cpu()
        out[stored_name(name)] = t
        if name.endswith("layer_scalar"):  # transformers stores this buffer for the encoder too
            out[ENCODER_PREFIX + name] = t.clone()
    return out


def save_pretrained(model, out_dir, *, max_shard_bytes: int | None = None):
    if getattr(model, "quantization", None):
        raise ValueError("a quantised model cannot be saved in the checkpoint format; save the original")
    """Write config.json, generation_config.json and safetensors weights (sharded above max_shard_bytes).

    Written into a temporary folder beside `out_dir`, then renamed into place: a crash never leaves a
    half-written checkpoint, and an existing `out_dir` is replaced only once the new one is complete.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        state = _state_for_saving(model)
        config = model.config.to_hf_dict(model.hf_config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = dict(model.hf_generation_config or {})
        gen.update(model.sampling_config.to_hf_dict())
        gen.setdefault("bos_token_id", model.config.bos_token_id)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        metadata = {"format": "pt"}
        if max_shard_bytes is None:
            save_file(state, str(tmp / SINGLE_FILE), metadata=metadata)
        else:
            shards: list[dict[str, torch.Tensor]] = [{}]
            size = 0
            for name, t in state.items():
                nbytes = t.numel() * t.element_size()
                if shards[-1] and size + nbytes > max_shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][name] = t
                size += nbytes
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=metadata)
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            src = getattr(model, "source_dir", None)
            if src and (Path(src) / extra).is_file():
                shutil.copy2(Path(src) / extra, tmp / extra)
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
