"""Turn a Gemma 4 text checkpoint (Hugging Face format) into a DiffusionGemma checkpoint.

DiffusionGemma is the Gemma 4 MoE text backbone used twice (a causal encoder and a bidirectional canvas
decoder, same weights) plus one new decoder-only block, the self-conditioning MLP. So the conversion is
mostly a renaming:

    Gemma 4 (`Gemma4ForCausalLM`: `model.`, `Gemma4ForConditionalGeneration`: `model.language_model.`)
        <prefix>embed_tokens.weight, <prefix>norm.weight, <prefix>layers.N.*   -> model.decoder.<same>
        <prefix>layers.N.layer_scalar                    -> also model.encoder.language_model.layers.N.layer_scalar
        model.vision_tower.*, model.embed_vision.*       -> model.encoder.vision_tower.*, model.encoder.embed_vision.*
    new: model.decoder.self_conditioning.{pre_norm.weight = 1, gate_proj/up_proj ~ N(0, initializer_range),
         down_proj = 0}: the self-conditioning signal is exactly zero until training moves down_proj, while
         gate/up are random so that down_proj receives a gradient from the first step.

Everything is decided before anything is written: the config is checked field by field (each Gemma 4
setting that changes the math is either mapped or refused), every stored tensor is accounted for (mapped,
dropped on request, or refused as unknown), and shapes are compared with what the config implies, all
from the safetensors headers. Only then are tensors streamed one at a time from the memory-mapped source
into safetensors files written in a temporary folder, which is renamed into place at the end; a failure
or Ctrl-C removes the temporary folder and leaves nothing behind. Peak memory is one tensor (two while
casting), never a second copy of the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dgemma.config import FULL, SLIDING, ConfigError, ModelConfig, SamplingConfig
from dgemma.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    checkpoint_key,
    move_into_place,
    read_json,
)

# Parts of Gemma 4 that DiffusionGemma has no place for; `--drop` names them to convert without them.
DROPPABLE = {
    "per-layer-embeddings": "per-layer embeddings",
    "kv-sharing": "KV sharing between layers",
    "audio": "audio tower",
    "vision": "vision tower",
}

# Files that travel unchanged: the tokenizer and chat template are the same for the diffusion model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# `Gemma4TextConfig` defaults for the fields that change the math: a config.json written by transformers
# lists every field, but a hand-written one may not, and then Gemma 4's defaults (not DiffusionGemma's)
# are what the source model actually ran with.
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# Settings from other Gemma generations that Gemma 4 does not have. transformers' Gemma 4 would silently
# ignore them, but a config that declares one was made for a model that uses it: converting would change
# its outputs without a word, so they are refused.
FOREIGN_SETTINGS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "query_pre_attn_scalar": "a query pre-attention scalar (Gemma 4 and DiffusionGemma use scaling 1.0)",
    "rope_scaling": "legacy rope_scaling",
}

# Tensors (names relative to the text model) that belong to per-layer embeddings.
PLE_TENSOR = re.compile(
    r"(?:embed_tokens_per_layer\.weight|per_layer_model_projection\.weight|per_layer_projection_norm\.weight"
    r"|layers\.\d+\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\.weight)"
)
# The attention tensors a KV-shared ("consumer") layer lacks in Gemma 4, relative to `layers.N.`.
KV_TENSORS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")

# safetensors dtype codes of the floating formats we read and write.
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class SourceTensor:
    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PlannedTensor:
    """One tensor of the DiffusionGemma checkpoint: copied from a source tensor or made fresh."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: SourceTensor | None = None
    make: Callable[[], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class ConversionPlan:
    src: Path
    config: ModelConfig
    hf_config: dict  # the config.json to write
    generation_config: dict
    tensors: list[PlannedTensor]
    dropped: dict[str, int] = field(default_factory=dict)  # feature -> number of source tensors left out
    ignored: list[str] = field(default_factory=list)  # source tensors left out for a stated reason
    tokenizer_files: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def parse_drop(value: str | Iterable[str] | None) -> frozenset[str]:
    """'--drop a,b' -> {'a', 'b'}; unknown names raise ValueError naming the valid ones."""
    if value is None:
        return frozenset()
    names = value.split(",") if isinstance(value, str) else list(value)
    names = {n.strip() for n in names if n.strip()}
    unknown = sorted(names - set(DROPPABLE))
    if unknown:
        raise ValueError(f"unknown --drop name(s) {', '.join(unknown)}; choose from {', '.join(DROPPABLE)}")
    return frozenset(names)


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '20KB' -> 2e4, '1GiB' -> 2**30, '123' -> 123 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"cannot read size {text!r} (examples: 5GB, 500MB, 2GiB)")
    number, unit = float(m.group(1)), m.group(2)
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit else 1000
    size = int(number * base ** powers[unit.rstrip("IB")])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------
def _read_source_config(src: Path) -> tuple[dict, dict]:
    """-> (top-level config, text config) of a Gemma 4 folder."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such model folder")
    config_file = src / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (not a Hugging Face model folder)")
    top = read_json(config_file)
    model_type = top.get("model_type")
    if model_type == "gemma4":
        text = top.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{config_file}: model_type 'gemma4' but no text_config")
    elif model_type == "gemma4_text":
        text = top
    elif model_type in ("diffusion_gemma", "diffusion_gemma_text"):
        raise CheckpointError(f"{config_file}: this is already a DiffusionGemma checkpoint; nothing to convert")
    else:
        raise CheckpointError(
            f"{config_file}: model_type is {model_type!r}; `dgemma convert gemma4` reads Gemma 4 checkpoints "
            "(model_type 'gemma4' or 'gemma4_text')"
        )
    return top, text


def _source_tensors(src: Path) -> dict[str, SourceTensor]:
    """Every stored tensor with its file, shape and dtype, read from the safetensors headers only."""
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (no weight_map)")
        files = sorted({src / f for f in weight_map.values()})
    elif (src / SINGLE_FILE).is_file():
        weight_map, files = None, [src / SINGLE_FILE]
    elif list(src.glob("*.safetensors")):
        raise CheckpointError(f"{src}: several .safetensors files but no {INDEX_FILE} to say which holds what")
    elif any(src.glob("*.bin")) or any(src.glob("*.pt")) or any(src.glob("*.pth")):
        raise CheckpointError(f"{src}: only pickle weights found; dgemma reads safetensors only (never pickle)")
    else:
        raise CheckpointError(f"{src / SINGLE_FILE}: missing (and no {INDEX_FILE})")

    tensors: dict[str, SourceTensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} is missing")
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    code = view.get_dtype()
                    if code not in ST_DTYPES:
                        raise CheckpointError(
                            f"{file}: {name} is stored as {code}; only float32/bfloat16/float16 weights convert "
                            "(quantized checkpoints do not)"
                        )
                    tensors[name] = SourceTensor(file, name, tuple(view.get_shape()), ST_DTYPES[code])
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].file != src / shard:
                raise CheckpointError(f"{index}: lists {name} in {shard}, which does not hold it")
    return tensors


# ---------------------------------------------------------------------------------------------
# Config: map or refuse every setting that changes the math
# ---------------------------------------------------------------------------------------------
@dataclass
class _TextLayout:
    """What the checks decided about the Gemma 4 text model."""

    text: dict  # the text config with Gemma 4 defaults filled in
    dg_text: dict  # DiffusionGemma text fields for ModelConfig.from_hf_dict
    kv_producer: dict[int, int]  # KV-shared layer -> the layer whose K/V projections it used
    present: dict[str, str]  # droppable feature -> how the config shows it


def _layer_geometry(text: dict, layer_types: list[str], problems: list[str]) -> tuple[int, int]:
    """Head dim and KV heads of the full-attention layers, from `per_layer_config` (what transformers
    writes) or `global_head_dim` / `num_global_key_value_heads` (hand-written configs)."""
    base = (text["head_dim"], text["num_key_value_heads"])
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        # Gemma 4 applies num_global_key_value_heads only together with K = V (checked elsewhere).
        return text["global_head_dim"], text["num_global_key_value_heads"] or base[1]
    if not isinstance(per_layer, dict):
        problems.append("per_layer_config is not a mapping")
        return base
    shapes = {}
    for i, kind in enumerate(layer_types):
        over = per_layer.get(str(i), per_layer.get(i)) or {}
        extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if extra:
            problems.append(f"per_layer_config overrides {', '.join(extra)} on layer {i} (not representable)")
        shape = (over.get("head_dim", base[0]), over.get("num_key_value_heads", base[1]))
        if kind == SLIDING and shape != base:
            problems.append(f"sliding layer {i} has its own attention shape {shape} (only full layers may differ)")
        shapes.setdefault(kind, set()).add(shape)
    full = shapes.get(FULL, {base})
    if len(full) > 1:
        problems.append(f"full-attention layers have different shapes {sorted(full)}")
    return sorted(full)[0]


def _kv_producers(layer_types: list[str], shared: int, problems: list[str]) -> dict[int, int]:
    """Gemma 4 KV sharing: the last `shared` layers reuse the K/V of the last earlier layer of their type."""
    if shared <= 0:
        return {}
    first = len(layer_types) - shared
    out = {}
    for i in range(max(first, 0), len(layer_types)):
        earlier = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not earlier:
            problems.append(f"KV-shared layer {i} has no earlier {layer_types[i]} layer to share with")
            return {}
        out[i] = earlier[-1]
    return out


def _check_text_config(top: dict, given: dict, config_file: Path) -> _TextLayout:
    text = {**GEMMA4_TEXT_DEFAULTS, **given}
    n_layers = text["num_hidden_layers"]
    layer_types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)])
    if layer_types and layer_types[-1] != FULL:  # Gemma 4 forces this too
        layer_types[-1] = FULL
    rope = {**DEFAULT_ROPE, **(text.get("rope_parameters") or {})}

    problems: list[str] = []  # what no flag can fix
    if not text["enable_moe_block"]:
        problems.append(
            "dense-only Gemma 4 (enable_moe_block=false): DiffusionGemma layers run routed experts beside the "
            "dense MLP, so only the MoE layout (e.g. gemma-4-26B-A4B) converts"
        )
    elif None in (text["num_experts"], text["top_k_experts"], text["moe_intermediate_size"]):
        problems.append("enable_moe_block=true but num_experts / top_k_experts / moe_intermediate_size is unset")
    if not text["attention_k_eq_v"]:
        problems.append(
            "full-attention layers have their own v_proj (attention_k_eq_v=false, DiffusionGemma's full "
            "layers use K = V)"
        )
    cap = text["final_logit_softcapping"]
    if cap is None:
        problems.append("final_logit_softcapping is unset (DiffusionGemma always soft-caps its logits)")
    elif not cap > 0:
        problems.append(f"final_logit_softcapping={cap} (a soft-cap must be positive)")
    if text["hidden_activation"] != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation={text['hidden_activation']!r} (DiffusionGemma uses gelu_pytorch_tanh)")
    if text["attention_bias"]:
        problems.append("attention_bias=true (DiffusionGemma's projections have no bias)")
    if text["use_bidirectional_attention"] == "all":
        problems.append("use_bidirectional_attention='all' (a bidirectional encoder, DiffusionGemma's is causal)")
    if not (text["tie_word_embeddings"] and top.get("tie_word_embeddings", True)):
        problems.append("tie_word_embeddings=false (DiffusionGemma's LM head is the embedding)")
    bad_types = sorted(set(layer_types) - {SLIDING, FULL})
    if bad_types:
        problems.append(f"layer types {bad_types}")
    for kind in (SLIDING, FULL):
        r = rope.get(kind) or {}
        kinds_ok = ("default",) if kind == SLIDING else ("default", "proportional")
        partial_ok = kind == FULL or r.get("partial_rotary_factor", 1.0) == 1.0
        if r.get("rope_type", "default") not in kinds_ok or r.get("factor", 1.0) != 1.0 or not partial_ok:
            problems.append(f"{kind} rope_parameters {r} (supported: {' or '.join(kinds_ok)} RoPE without scaling)")
    sources = (given,) if given is top else (given, top)
    for source in sources:
        for key, what in FOREIGN_SETTINGS.items():
            if source.get(key) is not None:
                problems.append(f"{key}={source[key]!r} ({what}, which Gemma 4 and DiffusionGemma do not have)")
    if any(source.get("quantization_config") for source in sources):
        problems.append("quantization_config is set (convert the unquantized weights instead)")
    full_head_dim, full_kv_heads = _layer_geometry(text, layer_types, problems)
    producers = _kv_producers(layer_types, text["num_kv_shared_layers"], problems)
    if producers and text["use_double_wide_mlp"]:
        problems.append(
            "use_double_wide_mlp=true (KV-shared layers get a twice-as-wide MLP, DiffusionGemma has one width)"
        )

    present = {}
    if text["hidden_size_per_layer_input"]:
        present["per-layer-embeddings"] = f"hidden_size_per_layer_input={text['hidden_size_per_layer_input']}"
    if producers:
        present["kv-sharing"] = f"num_kv_shared_layers={text['num_kv_shared_layers']}"
    if top.get("audio_config"):
        present["audio"] = "audio_config"

    if problems:
        raise CheckpointError(f"{config_file}: cannot convert to DiffusionGemma: {'; '.join(problems)}")

    eos = text["eos_token_id"]
    dg_text = {
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": text["num_attention_heads"],
        "num_key_value_heads": text["num_key_value_heads"],
        "head_dim": text["head_dim"],
        "global_head_dim": full_head_dim,
        "num_global_key_value_heads": full_kv_heads,
        "sliding_window": text["sliding_window"],
        "layer_types": layer_types,
        "rope_parameters": rope,
        "num_experts": text["num_experts"],
        "top_k_experts": text["top_k_experts"],
        "moe_intermediate_size": text["moe_intermediate_size"],
        "rms_norm_eps": text["rms_norm_eps"],
        "final_logit_softcapping": text["final_logit_softcapping"],
        "max_position_embeddings": text["max_position_embeddings"],
        "hidden_activation": text["hidden_activation"],
        "pad_token_id": text["pad_token_id"] if text["pad_token_id"] is not None else 0,
        "eos_token_id": eos if eos is not None else 1,
        "bos_token_id": text["bos_token_id"] if text["bos_token_id"] is not None else 2,
        "initializer_range": text["initializer_range"],
    }
    return _TextLayout(text, dg_text, producers, present)


# ---------------------------------------------------------------------------------------------
# Planning: every output tensor and where it comes from
# ---------------------------------------------------------------------------------------------
def _find_prefixes(tensors: dict[str, SourceTensor], src: Path) -> tuple[str, str]:
    """-> (text prefix, outer prefix) for the transformers layouts of Gemma 4:
    Gemma4ForConditionalGeneration `model.language_model.`, Gemma4Model `language_model.`,
    Gemma4ForCausalLM `model.`, Gemma4TextModel no prefix."""
    layouts = (("model.language_model.", "model."), ("language_model.", ""), ("model.", "model."), ("", ""))
    for text_prefix, outer in layouts:
        if text_prefix + "embed_tokens.weight" in tensors:
            return text_prefix, outer
    raise CheckpointError(
        f"{src}: no Gemma 4 text weights found (expected model.language_model.embed_tokens.weight or "
        "model.embed_tokens.weight)"
    )


def _new_self_conditioning(config: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Self-conditioning starts as an exact no-op: down_proj = 0 makes its output zero whatever the
    previous logits. gate/up are random (not zero) so down_proj gets a gradient from the first step;
    with all three at zero the block could never learn."""
    h, inner, std = config.hidden_size, config.intermediate_size, config.initializer_range

    def normal(shape, offset):
        gen = torch.Generator().manual_seed(seed + offset)  # each tensor reproducible on its own
        return lambda: (torch.randn(shape, generator=gen) * std).to(dtype)

    return {
        "self_conditioning.pre_norm.weight": lambda: torch.ones(h, dtype=dtype),
        "self_conditioning.gate_proj.weight": normal((inner, h), 0),
        "self_conditioning.up_proj.weight": normal((inner, h), 1),
        "self_conditioning.down_proj.weight": lambda: torch.zeros(h, inner, dtype=dtype),
    }


def plan_conversion(
    src,
    *,
    drop: Iterable[str] = (),
    canvas_length: int = 256,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> ConversionPlan:
    """Check a Gemma 4 folder and decide every output tensor; reads headers only, writes nothing.

    Raises CheckpointError (one line, naming the file and setting or tensor) for anything that cannot
    be converted, or that could be converted only by dropping a part not named in `drop`.
    """
    src = Path(src)
    drop = parse_drop(list(drop))
    if canvas_length < 1:
        raise CheckpointError(f"canvas_length must be >= 1, got {canvas_length}")
    config_file = src / "config.json"
    top, text_given = _read_source_config(src)
    layout = _check_text_config(top, text_given, config_file)
    tensors = _source_tensors(src)
    text_prefix, outer = _find_prefixes(tensors, src)
    # Sort the stored tensors into parts before judging the config's droppable features, because a
    # checkpoint can carry a part (e.g. audio weights) its config does not mention.
    parts = _sort_into_parts(tensors, text_prefix, outer)
    _check_parts(src, tensors, parts, layout, drop)

    try:
        config = ModelConfig.from_hf_dict({"text_config": layout.dg_text, "canvas_length": canvas_length})
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    embed = tensors[text_prefix + "embed_tokens.weight"]
    planned, used = _plan_network(src, config, tensors, text_prefix, layout, dtype, dtype or embed.dtype, seed)
    plan = ConversionPlan(src, config, {}, {}, planned)
    _account_for_leftovers(plan, tensors, parts, used, text_prefix, layout, drop)

    keep_vision = bool(parts["vision"]) and "vision" not in drop
    if keep_vision and not top.get("vision_config"):
        raise CheckpointError(f"{config_file}: the checkpoint holds vision weights but no vision_config; "
                              "pass --drop vision to convert the text model alone")
    if keep_vision:
        for name in sorted(parts["vision"]):
            source = tensors[name]
            out_name = "model.encoder." + name[len(outer):]
            plan.tensors.append(PlannedTensor(out_name, source.shape, dtype or source.dtype, source=source))
    for feature in ("per-layer-embeddings", "audio") + (() if keep_vision else ("vision",)):
        if parts[feature]:
            plan.dropped[feature] = len(parts[feature])
    if layout.kv_producer:
        plan.dropped["kv-sharing"] = 0  # no tensors: the shared layers get their producer's projections

    plan.hf_config = _output_config(config, top, layout, keep_vision, dtype or embed.dtype)
    plan.generation_config = _generation_config(src, config, layout)
    plan.tokenizer_files = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    return plan


def _sort_into_parts(tensors: dict, text_prefix: str, outer: str) -> dict[str, list[str]]:
    """Stored tensor names by the part of Gemma 4 they belong to ("unknown": none of them)."""
    vision_prefixes = (outer + "vision_tower.", outer + "embed_vision.")
    audio_prefixes = (outer + "audio_tower.", outer + "embed_audio.")
    parts: dict[str, list[str]] = {"text": [], "per-layer-embeddings": [], "vision": [], "audio": [],
                                   "lm_head": [], "unknown": []}
    for name in tensors:
        if name.startswith(vision_prefixes):
            parts["vision"].append(name)
        elif name.startswith(audio_prefixes):
            parts["audio"].append(name)
        elif name.startswith(text_prefix) and PLE_TENSOR.fullmatch(name[len(text_prefix):]):
            parts["per-layer-embeddings"].append(name)
        elif name == "lm_head.weight":
            parts["lm_head"].append(name)
        elif name.startswith(text_prefix):
            parts["text"].append(name)
        else:
            parts["unknown"].append(name)
    return parts


def _check_parts(src: Path, tensors: dict, parts: dict[str, list[str]], layout, drop):
    """Refuse a part DiffusionGemma has no place for unless `drop` names it, and any unknown tensor."""
    present = dict(layout.present)
    if parts["per-layer-embeddings"]:
        present.setdefault("per-layer-embeddings", f"{len(parts['per-layer-embeddings'])} per-layer-embedding tensors")
    if parts["audio"]:
        present.setdefault("audio", f"{len(parts['audio'])} audio tensors")
    # Vision is different: DiffusionGemma has a Gemma 4 vision tower, so it is carried across unless dropped.
    missing_drops = [f for f in ("per-layer-embeddings", "kv-sharing", "audio") if f in present and f not in drop]
    if missing_drops:
        named = ", ".join(f"{DROPPABLE[f]} ({present[f]})" for f in missing_drops)
        raise CheckpointError(
            f"{src}: DiffusionGemma has no {named}; pass --drop {','.join(missing_drops)} to convert without "
            "them (the model then differs from the source and needs adaptation)"
        )
    if parts["unknown"]:
        sample = ", ".join(sorted(parts["unknown"])[:3])
        raise CheckpointError(
            f"{tensors[sorted(parts['unknown'])[0]].file}: {len(parts['unknown'])} tensor(s) outside the Gemma 4 "
            f"layout ({sample}); refusing rather than leaving them out silently"
        )


def _plan_network(src: Path, config: ModelConfig, tensors: dict, text_prefix: str, layout, dtype, new_dtype, seed: int
                  ) -> tuple[list[PlannedTensor], set[str]]:
    """Every tensor of the DiffusionGemma network: from its Gemma 4 source, or new (self-conditioning).
    Returns the planned tensors and the source names used."""
    from dgemma.model.network import DiffusionGemma

    with torch.device("meta"):
        expected = DiffusionGemma(config).state_dict()
    fresh = _new_self_conditioning(config, new_dtype, seed)

    planned: list[PlannedTensor] = []
    used: set[str] = set()
    for name, meta in expected.items():
        shape = tuple(meta.shape)
        if name in fresh:
            planned.append(PlannedTensor(checkpoint_key(name), shape, new_dtype, make=fresh[name]))
            continue
        # Gemma 4 has one layer scalar per layer; DiffusionGemma keeps one per stack, both start from it
        source_name = text_prefix + name.replace("encoder_layer_scalar", "layer_scalar")
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m and int(m.group(1)) in layout.kv_producer and m.group(2) in KV_TENSORS:
            # A KV-shared layer had no K/V projections of its own: it attended with the keys and values of
            # its producer layer. The closest own projections are the producer's.
            source_name = f"{text_prefix}layers.{layout.kv_producer[int(m.group(1))]}.{m.group(2)}"
        if source_name not in tensors:
            raise CheckpointError(f"{src}: tensor {source_name} is missing from the checkpoint")
        source = tensors[source_name]
        if source.shape != shape:
            raise CheckpointError(
                f"{source.file}: {source_name} has shape {source.shape}, the config implies {shape}"
            )
        used.add(source_name)
        out_dtype = dtype or source.dtype
        planned.append(PlannedTensor(checkpoint_key(name), shape, out_dtype, source=source))
    return planned, used


def _account_for_leftovers(plan: ConversionPlan, tensors: dict, parts: dict[str, list[str]], used: set[str],
                           text_prefix: str, layout, drop):
    """Text tensors the network did not take are either known to be unused (listed in plan.ignored) or
    an error: nothing is left out silently."""
    leftovers = sorted(set(parts["text"]) - used)
    if leftovers and "kv-sharing" in drop and layout.kv_producer:
        # Some writers store K/V weights for KV-shared layers; Gemma 4 never uses them.
        unused = [n for n in leftovers if _is_shared_kv_weight(n, text_prefix, layout.kv_producer)]
        plan.ignored += [f"{n} (KV-shared layer: Gemma 4 never used it)" for n in unused]
        leftovers = [n for n in leftovers if n not in unused]
    if leftovers:
        raise CheckpointError(
            f"{tensors[leftovers[0]].file}: {len(leftovers)} text tensor(s) DiffusionGemma has no place for "
            f"({', '.join(leftovers[:3])}); refusing rather than leaving them out silently"
        )
    if parts["lm_head"]:
        plan.ignored.append("lm_head.weight (tied to the embedding, as the config says)")


def _is_shared_kv_weight(name: str, text_prefix: str, producers: dict[int, int]) -> bool:
    m = re.fullmatch(re.escape(text_prefix) + r"layers\.(\d+)\.(.+)", name)
    return bool(m) and int(m.group(1)) in producers and m.group(2) in (*KV_TENSORS, "self_attn.v_norm.weight")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _output_config(config: ModelConfig, top: dict, layout: _TextLayout, keep_vision: bool, dtype) -> dict:
    """config.json for `DiffusionGemmaForBlockDiffusion`: our ModelConfig's fields, plus what transformers
    needs beyond the text path (vision tower config and image token ids when the vision tower is kept)."""
    out = config.to_hf_dict()  # a minimal vision config that transformers builds but dgemma never runs
    text = out["text_config"]
    for key in ("use_bidirectional_attention", "attention_dropout"):
        if layout.text.get(key) is not None:
            text[key] = layout.text[key]
    text["eos_token_id"] = layout.dg_text["eos_token_id"]  # keep a list of ids as a list
    text["dtype"] = out["dtype"] = _dtype_name(dtype)
    if keep_vision and top.get("vision_config"):
        out["vision_config"] = top["vision_config"]
        for key in ("boi_token_id", "eoi_token_id", "image_token_id"):
            if top.get(key) is not None:
                out[key] = top[key]
    return out


def _generation_config(src: Path, config: ModelConfig, layout: _TextLayout) -> dict:
    """The released sampler defaults, with the end-of-turn ids of the source (its generation_config.json
    lists every id that ends a turn, e.g. <eos> and <turn|>)."""
    eos = layout.dg_text["eos_token_id"]
    gen_file = src / "generation_config.json"
    if gen_file.is_file():
        eos = read_json(gen_file).get("eos_token_id", eos)
    ids = tuple(eos) if isinstance(eos, list) else (eos,)
    sampling = SamplingConfig(eos_token_ids=ids, pad_token_id=config.pad_token_id)
    return {**sampling.to_hf_dict(), "bos_token_id": config.bos_token_id}


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _load_source_tensor(handle, name: str) -> torch.Tensor:
    """One tensor out of a memory-mapped safetensors file (its own buffer; the only copy in RAM)."""
    return handle.get_tensor(name)


def _write_safetensors(path: Path, items: list[PlannedTensor], read: Callable[[PlannedTensor], torch.Tensor]):
    """Write a safetensors file tensor by tensor: the header (names, dtypes, shapes, offsets) is known from
    the plan, so each tensor is read, written and released before the next one is touched."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in items:
        header[t.name] = {
            "dtype": ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in items:
            tensor = read(t)
            if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
                raise CheckpointError(f"{path}: {t.name} came out as {tuple(tensor.shape)} {tensor.dtype}")
            # safetensors stores little-endian; every platform torch ships for is little-endian
            f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor
        f.flush()
        os.fsync(f.fileno())


def _human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    # Source order, so each output shard reads from as few source files as possible.
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def check_output(plan: ConversionPlan, out, *, overwrite: bool = False) -> Path:
    """Refuse an output folder that cannot or should not receive the plan (before anything is written)."""
    out = Path(out)
    if out.resolve() == plan.src.resolve() or plan.src.resolve() in out.resolve().parents:
        raise CheckpointError(f"{out}: the output folder must not be the source folder or inside it")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out}: folder exists and is not empty; pass --overwrite to replace it")
    parent = out.parent
    if not parent.is_dir():
        raise CheckpointError(f"{parent}: no such folder to write {out.name} into")
    free = shutil.disk_usage(parent).free
    if free < plan.total_bytes + (1 << 20):
        raise CheckpointError(f"{parent}: {_human_bytes(plan.total_bytes)} needed, {_human_bytes(free)} free")
    return out


def write_conversion(plan: ConversionPlan, out, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     overwrite: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Write the planned checkpoint to `out` atomically (temporary folder beside it, then a rename)."""
    out = check_output(plan, out, overwrite=overwrite)
    parent = out.parent
    # Read in source-file order; new tensors (self-conditioning) go last.
    order = sorted(plan.tensors, key=lambda t: (t.source is None, str(t.source.file) if t.source else "", t.name))
    shards = _shards(order, max_shard_bytes)
    handles: dict[Path, object] = {}

    def read(t: PlannedTensor) -> torch.Tensor:
        if t.source is None:
            return t.make()
        file = t.source.file
        if file not in handles:
            handles[file] = safe_open(str(file), "pt", device="cpu")
        try:
            tensor = _load_source_tensor(handles[file], t.source.name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read {t.source.name} ({e})") from None
        return tensor.to(t.dtype)  # no copy when the dtype is kept

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(tmp / fname, shard, read)
            weight_map.update({t.name: fname for t in shard})
            if progress:
                progress(f"wrote {fname} ({_human_bytes(sum(t.nbytes for t in shard))}, {len(shard)} tensors)")
        handles.clear()
        if len(shards) > 1:
            index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(plan.hf_config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(plan.generation_config, indent=2, sort_keys=True) + "\n")
        for name in plan.tokenizer_files:
            shutil.copy2(plan.src / name, tmp / name)
        move_into_place(tmp, out)
    except BaseException:
        handles.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert_gemma4(src, out, *, drop: Iterable[str] = (), canvas_length: int = 256,
                   dtype: torch.dtype | None = None, seed: int = 0,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                   progress: Callable[[str], None] | None = None) -> ConversionPlan:
    """Plan (all checks) then write. Returns the plan that was written."""
    plan = plan_conversion(src, drop=drop, canvas_length=canvas_length, dtype=dtype, seed=seed)
    write_conversion(plan, out, max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress)
    return plan


def describe(plan: ConversionPlan) -> list[str]:
    """Human-readable summary lines of a plan."""
    c = plan.config
    copied = sum(1 for t in plan.tensors if t.source is not None)
    lines = [
        f"source           {plan.src}",
        f"text backbone    {c.num_layers} layers ({c.layer_types.count(SLIDING)} sliding, {c.layer_types.count(FULL)} "
        f"full, K = V), hidden {c.hidden_size}, {c.num_experts} experts top-{c.top_k_experts}, vocab {c.vocab_size:,}",
        f"canvas           {c.canvas_length} tokens",
        f"tensors          {copied} copied, {len(plan.tensors) - copied} new (self-conditioning, down_proj = 0)",
        f"size             {_human_bytes(plan.total_bytes)}",
    ]
    for feature, n in plan.dropped.items():
        what = f"{n} tensors" if n else "shared layers get their producer's K/V projections"
        lines.append(f"dropped          {DROPPABLE[feature]} ({what})")
    lines += [f"ignored          {note}" for note in plan.ignored]
    if plan.tokenizer_files:
        lines.append(f"copied           {', '.join(plan.tokenizer_files)}")
    return lines


__all__ = ["DROPPABLE", "ConversionPlan", "plan_conversion", "check_output", "write_conversion", "convert_gemma4",
           "parse_drop", "parse_size", "describe"]
