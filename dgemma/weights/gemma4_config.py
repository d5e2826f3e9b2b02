"""Gemma 4's config.json, read and checked for `dgemma convert gemma4`: each setting that changes the math is
mapped to DiffusionGemma's config or refused with a message naming it, and the converted folder's
config.json and generation_config.json are written from the result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dgemma.config import FULL, SLIDING, ModelConfig, SamplingConfig
from dgemma.weights.checkpoint import CheckpointError, read_json

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

def read_source_config(src: Path) -> tuple[dict, dict]:
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


# ---------------------------------------------------------------------------------------------
# Config: map or refuse every setting that changes the math
# ---------------------------------------------------------------------------------------------
@dataclass
class TextLayout:
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


def check_text_config(top: dict, given: dict, config_file: Path) -> TextLayout:
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
    return TextLayout(text, dg_text, producers, present)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def output_config(config: ModelConfig, top: dict, layout: TextLayout, keep_vision: bool, dtype) -> dict:
    """config.json for `DiffusionGemmaForBlockDiffusion`: our ModelConfig's fields, plus what transformers
    needs beyond the text path (vision tower config and image token ids when the vision tower is kept)."""
    out = config.to_hf_dict()  # a minimal vision config that transformers builds but dgemma never runs
    text = out["text_config"]
    for key in ("use_bidirectional_attention", "attention_dropout"):
        if layout.text.get(key) is not None:
            text[key] = layout.text[key]
    text["eos_token_id"] = layout.dg_text["eos_token_id"]  # keep a list of ids as a list
    text["dtype"] = out["dtype"] = dtype_name(dtype)
    if keep_vision and top.get("vision_config"):
        out["vision_config"] = top["vision_config"]
        for key in ("boi_token_id", "eoi_token_id", "image_token_id"):
            if top.get(key) is not None:
                out[key] = top[key]
    return out


def generation_config(src: Path, config: ModelConfig, layout: TextLayout) -> dict:
    """The released sampler defaults, with the end-of-turn ids of the source (its generation_config.json
    lists every id that ends a turn, e.g. <eos> and <turn|>)."""
    eos = layout.dg_text["eos_token_id"]
    gen_file = src / "generation_config.json"
    if gen_file.is_file():
        eos = read_json(gen_file).get("eos_token_id", eos)
    ids = tuple(eos) if isinstance(eos, list) else (eos,)
    sampling = SamplingConfig(eos_token_ids=ids, pad_token_id=config.pad_token_id)
    return {**sampling.to_hf_dict(), "bos_token_id": config.bos_token_id}
