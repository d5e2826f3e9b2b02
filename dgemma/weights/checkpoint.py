"""Loading and saving the Hugging Face checkpoint format (safetensors only, never pickle).

Layout, as transformers 5.23 writes `DiffusionGemmaForBlockDiffusion`: the shared backbone is stored
once, under the decoder's names (`model.decoder.<our parameter name>`); the LM head is tied to the
embedding and not stored; the per-layer buffer `layer_scalar` is stored once per stack
(`model.decoder.layers.N.layer_scalar` and `model.encoder.language_model.layers.N.layer_scalar`), and
the two copies may differ: transformers ties the stacks' weights, not these buffers. Vision-tower
weights sit under `model.encoder.`.

Every key of a checkpoint is accounted for (`plan_load`): each is read into the model, or skipped or
refused with a message that names it. Loading builds the model on the meta device and fills it shard
by shard from memory-mapped files, closing each shard before opening the next, so a checkpoint never
needs two copies in RAM and a quantised load peaks near the quantised size plus one shard.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dgemma.config import STEP_CACHE_KEYS, ConfigError, ModelConfig, SamplingConfig
from dgemma.model.network import DiffusionGemma
from dgemma.quant import openvino
from dgemma.quant.quantize import (
    FORMATS,
    GROUP_SIZE,
    is_kernel_layout,
    load_dense_into,
    quantised_tensors,
    swap_modules,
    use_cpu_int4_kernel,
)
from dgemma.weights.shards import INDEX_FILE, SINGLE_FILE, TensorSpec, pack_shards, write_shards

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
MULTIMODAL = "model.encoder."  # vision_tower.*, embed_vision.*
VISION_PREFIXES = ("vision_tower.", "embed_vision.")
QUANT_METHOD = "dgemma"  # config.json's quantization_config.quant_method of a folder saved quantised
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "processor_config.json", "preprocessor_config.json")


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


def model_config(path: Path) -> tuple[dict, ModelConfig]:
    """config.json of a model folder, raw and as our `ModelConfig`."""
    cfg = read_config(path)
    try:
        return cfg, ModelConfig.from_hf_dict(cfg)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def stored_quantization(hf_config: dict) -> str | None:
    """"int8" / "int4" when the folder holds weights dgemma saved quantised (`save_pretrained` of a quantised
    model: codes and scales in dgemma's layout, see dgemma.quant.quantize), None for plain weights."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    fmt = q.get("format") if isinstance(q, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD or fmt not in FORMATS \
            or q.get("group_size") != GROUP_SIZE[fmt]:
        raise CheckpointError(f"config.json: quantization_config {q} is not a format dgemma reads (only its own "
                              f"int8 / int4 saves); load the unquantised weights, with --quantize if wanted")
    return fmt


def model_shape(model_path: str | None, quantize: str | None = None) -> tuple[int | None, str | None]:
    """What the default dtype depends on (`devices.default_dtype`), read from a model folder's config.json: its
    hidden size, and how its weights run (`quantize`, else the format they were saved in: "int8", "int4" or
    None); (None, quantize) when the folder cannot be read here (loading it then says why)."""
    if model_path is None:
        return None, quantize
    try:
        raw, config = model_config(Path(model_path))
        return config.hidden_size, quantize or stored_quantization(raw)
    except CheckpointError:
        return None, quantize


def quantization_config(fmt: str) -> dict:
    """config.json's entry for weights saved in dgemma's `fmt` (transformers does not read these folders)."""
    return {"quant_method": QUANT_METHOD, "format": fmt, "group_size": GROUP_SIZE[fmt]}


# -- names --------------------------------------------------------------------------------------------
def checkpoint_key(name: str) -> str:
    """Our state-dict name -> the key transformers stores that tensor under."""
    if name.endswith("encoder_layer_scalar"):
        return ENCODER + name.removesuffix("encoder_layer_scalar") + "layer_scalar"
    if name.startswith(VISION_PREFIXES):
        return MULTIMODAL + name
    return DECODER + name


# -- what a folder holds (headers only) -----------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]


def read_headers(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint folder from the safetensors headers alone (no weights are read).

    Checks what a load would trip over later: the index names shards that exist, every shard's header
    parses and covers the file exactly (a truncated shard fails here), every key of the index is in the
    shard the index names, and no shard holds a key the index does not list.
    """
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index (no weight_map of key -> file)")
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, shard in weight_map.items():
            by_file[shard].append(name)
        files = sorted(by_file)
    else:
        single = path / SINGLE_FILE
        if not single.is_file():
            if any(path.glob("*.safetensors")):
                raise CheckpointError(f"{path}: several .safetensors files but no {INDEX_FILE} to say which holds what")
            if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
                raise CheckpointError(f"{path}: only pickle weights found; dgemma loads safetensors only (never pickle)")
            raise CheckpointError(f"{single}: missing (and no {INDEX_FILE})")
        by_file, files = None, [SINGLE_FILE]

    tensors: dict[str, StoredTensor] = {}
    for shard in files:
        file = path / shard
        if not file.is_file():
            first = by_file[shard][0]
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} is missing (holds {first})")
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    tensors[name] = StoredTensor(file, piece.get_dtype(), tuple(piece.get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
        if by_file is not None:
            in_header = {n for n, t in tensors.items() if t.file == file}
            listed = set(by_file[shard])
            if listed - in_header:
                raise CheckpointError(f"{index}: lists {sorted(listed - in_header)[0]} in {shard}, which does not hold it")
            if in_header - listed:
                raise CheckpointError(f"{file}: holds {sorted(in_header - listed)[0]}, which {INDEX_FILE} does not list")
    return tensors


def without_missing_vision(config: ModelConfig, stored: dict[str, StoredTensor]) -> ModelConfig:
    """transformers' config.json always describes a vision tower; a checkpoint that stores none is text-only."""
    vision_keys = tuple(MULTIMODAL + p for p in VISION_PREFIXES)
    if config.vision is not None and not any(key.startswith(vision_keys) for key in stored):
        return config.replace(vision=None)
    return config


# -- what to do with each key -----------------------------------------------------------------------
@dataclass
class LoadPlan:
    """sources: our state-dict name -> checkpoint key it is read from; report: every checkpoint key ->
    "read" or "skipped: <why>"."""

    sources: dict[str, str]
    report: dict[str, str]

    def skipped(self) -> dict[str, list[str]]:
        """reason -> keys, for the notes printed while loading."""
        out: dict[str, list[str]] = defaultdict(list)
        for key, decision in self.report.items():
            if decision.startswith("skipped: "):
                out[decision.removeprefix("skipped: ")].append(key)
        return out


def plan_load(stored: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], hf_config: dict,
              where: Path) -> LoadPlan:
    """Decide, for every stored key, whether it is read (and into which of our `expected` names, with
    shapes checked), skipped or refused. Raises CheckpointError naming the first key that cannot be
    used and the first tensor the model needs that is missing."""
    sources: dict[str, str] = {}
    for name, shape in expected.items():
        key = checkpoint_key(name)
        if key not in stored and key.startswith(DECODER) and ENCODER + name in stored:
            key = ENCODER + name  # a checkpoint that kept only the encoder copy of the shared weights
        if key not in stored:
            raise CheckpointError(f"{where}: tensor {key} is missing from the checkpoint")
        if stored[key].shape != tuple(shape):
            raise CheckpointError(
                f"{stored[key].file}: {key} has shape {stored[key].shape}, the config implies {tuple(shape)}")
        sources[name] = key

    report = {key: "read" for key in sources.values()}
    has_vision = any(name.startswith(VISION_PREFIXES) for name in expected)
    tied = hf_config.get("tie_word_embeddings", hf_config.get("text_config", {}).get("tie_word_embeddings", True))
    unknown = []
    for key in stored:
        if key in report:
            continue
        if key.startswith(ENCODER) and DECODER + key.removeprefix(ENCODER) in report:
            report[key] = "skipped: the encoder's copy of a weight tied to the decoder's (read once)"
        elif key.startswith(DECODER) and ENCODER + key.removeprefix(DECODER) in report:
            report[key] = "skipped: the decoder's copy of a weight tied to the encoder's (read once)"
        elif key == "lm_head.weight" and tied:
            report[key] = "skipped: the LM head is tied to the embedding (tie_word_embeddings)"
        elif key.startswith(tuple(MULTIMODAL + p for p in VISION_PREFIXES)) and not has_vision:
            report[key] = "skipped: vision-tower weights (this model is loaded for text only)"
        else:
            unknown.append(key)
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        hint = " (an untied LM head is not supported)" if "lm_head.weight" in unknown else ""
        raise CheckpointError(f"{stored[unknown[0]].file}: {unknown[0]}{more}: not part of a DiffusionGemma "
                              f"checkpoint dgemma knows{hint}")
    return LoadPlan(sources, report)


def _meta_model(config: ModelConfig, hf_config: dict, dtype: torch.dtype,
                sampling: SamplingConfig | None = None) -> DiffusionGemma:
    """The model a folder describes, on the meta device in `dtype`; with quantised modules in place when the
    folder stores quantised weights (then `model.quantization` names the format)."""
    with torch.device("meta"):
        model = DiffusionGemma(config, sampling).to(dtype)  # quantised modules compute in the model dtype
    fmt = stored_quantization(hf_config)
    if fmt:
        swap_modules(model, fmt)
        model.quantization = fmt
    return model


def inspect_checkpoint(path) -> tuple[ModelConfig, dict[str, StoredTensor], LoadPlan, str | None]:
    """Everything `load_folder` checks before it reads a weight: config, shard headers, every key's fate, and
    the format the weights are stored in (None: unquantised)."""
    path = Path(path)
    cfg, config = model_config(path)
    stored = read_headers(path)
    config = without_missing_vision(config, stored)
    model = _meta_model(config, cfg, torch.float32)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return config, stored, plan_load(stored, expected, cfg, path), model.quantization


# -- loading --------------------------------------------------------------------------------------------
def open_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> tuple[DiffusionGemma, LoadPlan,
                                                                           dict[str, StoredTensor]]:
    """The model a folder describes, on the meta device in `dtype` (with its config files attached for
    saving), and the plan of which stored key fills which tensor; headers are checked, no weight is read."""
    path = Path(path)
    cfg, config = model_config(path)
    gen_file = path / "generation_config.json"
    gen = read_json(gen_file) if gen_file.is_file() else {}
    eos = cfg.get("text_config", cfg).get("eos_token_id", config.eos_token_id)
    sampling = SamplingConfig.from_hf_dict({"eos_token_id": eos, "pad_token_id": config.pad_token_id, **gen})

    stored = read_headers(path)
    config = without_missing_vision(config, stored)
    model = _meta_model(config, cfg, dtype, sampling)
    model.hf_config, model.hf_generation_config = cfg, gen
    model.source_dir = path
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    plan = plan_load(stored, expected, cfg, path)
    for reason, keys in plan.skipped().items():
        if not reason.startswith("the encoder's copy"):  # transformers' own saves never hold those
            print(f"note: {len(keys)} tensor(s) skipped ({keys[0]}{', ...' if len(keys) > 1 else ''}): {reason}",
                  file=sys.stderr)
    return model, plan, stored


def load_folder(path, device="cpu", dtype: torch.dtype = torch.float32, *, quantize: str | None = None,
               cpu_int4_kernel: bool = True):
    """Load a DiffusionGemma checkpoint folder into our `DiffusionGemma`. `model.load_report` keeps every
    checkpoint key's fate ("read" / "skipped: why").

    quantize: quantise the dense weights while reading them. A folder saved quantised (`save_pretrained` of
    a quantised model) loads in its own format with nothing to quantise. cpu_int4_kernel: repack a bf16 int4
    model on a CPU for torch's int4 matmul (False keeps dgemma's layout, which `save_pretrained` writes)."""
    path = Path(path)
    model, plan, stored = open_checkpoint(path, dtype)
    saved_as = model.quantization
    if saved_as and quantize not in (None, saved_as):
        raise CheckpointError(f"{path}: the weights are stored in {saved_as}; load them as they are (without "
                              f"--quantize) or quantise the unquantised checkpoint to {quantize}")
    quantised = swap_modules(model, quantize) if quantize and not saved_as else {}  # filled as they are read
    read_weights(model, path, plan, stored, device, dtype, quantised)
    model.quantization = saved_as or quantize
    if cpu_int4_kernel:
        use_cpu_int4_kernel(model)  # bf16 int4 on a CPU: torch's int4 matmul
    model.load_report = plan.report
    return model.eval()


def read_weights(model, path: Path, plan: LoadPlan, stored: dict[str, StoredTensor], device, dtype: torch.dtype,
                 quantised: dict[str, torch.nn.Module],
                 part: Callable[[str], tuple[slice, ...] | None] = lambda name: None):
    """Fill a meta-device model from the shards, one shard open at a time. `quantised`: our name -> the module
    that quantises that dense tensor as it is read; codes and scales a folder stores are read in their own
    dtypes. `part(name)`: the index of the part of the stored tensor to read (a tensor-parallel rank's
    slice, read through `get_slice`), or None for all of it."""
    raw = quantised_tensors(model) if model.quantization else {}  # stored codes and scales
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, key in plan.sources.items():
        by_file[stored[key].file].append(name)
    loaded: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():  # one shard open at a time: its pages leave RSS when it closes
        try:
            with safe_open(str(file), "pt", device="cpu") as f:
                for name in names:
                    key, index = plan.sources[name], part(name)
                    try:
                        tensor = f.get_tensor(key) if index is None else f.get_slice(key)[index]
                    except (SafetensorError, OSError, RuntimeError) as e:
                        raise CheckpointError(f"{file}: cannot read {key} ({e})") from None
                    target = raw.get(name) or (dtype if tensor.is_floating_point() else tensor.dtype)
                    if name in quantised:
                        load_dense_into(quantised[name], name, tensor.to(device=device, dtype=target))
                    else:
                        # a copy: the tensor safetensors returns lives in the shard's memory map, and one kept
                        # view would keep every page of the shard read so far resident
                        loaded[name] = tensor.to(device=device, dtype=target, copy=True)
                    del tensor
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    missing, unexpected = model.load_state_dict(loaded, assign=True, strict=False)
    left = [k for k in missing if not k.endswith(("qweight", "scales", "_q"))]
    if left or unexpected:
        raise CheckpointError(f"{path}: internal mismatch loading {left or unexpected}")


# -- saving ---------------------------------------------------------------------------------------------
@dataclass
class LazyWeights:
    """Weights to save, read only when their shard is written: sizes (our name -> bytes, in save order)
    and read(names) -> {name: tensor}."""

    sizes: dict[str, int]
    read: Callable[[list[str]], dict[str, torch.Tensor]]


def save_pretrained(model, out_dir, *, max_shard_bytes: int | None = None, weights: LazyWeights | None = None):
    """Write config.json, generation_config.json and safetensors weights (sharded above max_shard_bytes),
    plus the tokenizer and processor files of the folder the model was loaded from. `weights` replaces the
    model's own state dict (the model may then be on the meta device): each shard's tensors are read when
    that shard is written, so saving holds one shard at a time.

    Written into a temporary folder beside `out_dir`, then renamed into place: a crash never leaves a
    half-written checkpoint, and an existing `out_dir` is replaced only once the new one is complete.
    """
    fmt = model.quantization
    if weights is None and openvino.in_library(model):
        openvino.refuse("saving the model")
    if fmt and is_kernel_layout(model):
        raise ValueError("this int4 model is repacked for torch's CPU int4 matmul; load it with "
                         "cpu_int4_kernel=False to save it")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if weights is None:
            state = model.state_dict()
            weights = LazyWeights({n: t.numel() * t.element_size() for n, t in state.items()},
                                  lambda names: {n: state[n] for n in names})
        config = model.config.to_hf_dict(model.hf_config)
        config.pop("quantization_config", None)
        if fmt:  # codes and scales in dgemma's layout, read back by `load_folder`
            config["quantization_config"] = quantization_config(fmt)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = dict(model.hf_generation_config or {})
        sampling = model.sampling_config.to_hf_dict()
        # dgemma's own section: the sampler's step cache settings as they are now, the rest (what training
        # recorded about the model) as read
        section = {k: v for k, v in (gen.get("dgemma") or {}).items() if k not in STEP_CACHE_KEYS}
        section.update(sampling.pop("dgemma", {}))
        gen.update(sampling)
        gen.pop("dgemma", None)
        if section:
            gen["dgemma"] = section
        gen.setdefault("bos_token_id", model.config.bos_token_id)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        _write_weights(weights, tmp, max_shard_bytes)
        src = model.source_dir
        for extra in TOKENIZER_FILES:
            if src and (Path(src) / extra).is_file():
                shutil.copy2(Path(src) / extra, tmp / extra)
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_weights(weights: LazyWeights, folder: Path, max_shard_bytes: int | None):
    """Each shard's tensors are read (`weights.read`) when that shard is written, then streamed to its file."""

    def open_shard(names: list[str]):
        tensors = {checkpoint_key(n): t for n, t in weights.read(names).items()}
        return [TensorSpec.of(key, t) for key, t in tensors.items()], lambda spec: tensors.pop(spec.key)

    write_shards(folder, pack_shards(weights.sizes.items(), max_shard_bytes), open_shard)
