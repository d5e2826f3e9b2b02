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
setting that changes the math is either mapped or refused: `dgemma.weights.gemma4_config`), every stored tensor is accounted for (mapped,
dropped on request, or refused as unknown), and shapes are compared with what the config implies, all
from the safetensors headers (`dgemma.weights.checkpoint.read_headers`). Only then are tensors streamed
one at a time from the memory-mapped source into safetensors files (`dgemma.weights.shards`, the writer
`save_pretrained` uses) written in a temporary folder, which is renamed into place at the end; a failure
or Ctrl-C removes the temporary folder and leaves nothing behind. Peak memory is one tensor (two while
casting), never a second copy of the model.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dgemma.config import FULL, SLIDING, ConfigError, ModelConfig
from dgemma.model.network import DiffusionGemma
from dgemma.weights.checkpoint import CheckpointError, checkpoint_key, move_into_place, read_headers
from dgemma.weights.gemma4_config import check_text_config, generation_config, output_config, read_source_config
from dgemma.weights.shards import DTYPES, TensorSpec, human_bytes, pack_shards, parse_size, write_shards

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

# Tensors (names relative to the text model) that belong to per-layer embeddings.
PLE_TENSOR = re.compile(
    r"(?:embed_tokens_per_layer\.weight|per_layer_model_projection\.weight|per_layer_projection_norm\.weight"
    r"|layers\.\d+\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\.weight)"
)
# The attention tensors a KV-shared ("consumer") layer lacks in Gemma 4, relative to `layers.N.`.
KV_TENSORS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")

# The floating formats a source may store (safetensors' codes) and an output may be written in.
SOURCE_DTYPES = ("F32", "BF16", "F16")
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class SourceTensor:
    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class PlannedTensor(TensorSpec):
    """One tensor of the DiffusionGemma checkpoint (`key`: its stored name): copied from a source tensor
    or made fresh."""

    source: SourceTensor | None = None
    make: Callable[[], torch.Tensor] | None = None


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


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------
def _source_tensors(src: Path) -> dict[str, SourceTensor]:
    """Every stored tensor with its file, shape and dtype, from the safetensors headers only (the
    checkpoint module's reader, which also checks the index against the shards)."""
    tensors = {}
    for name, stored in read_headers(src).items():
        if stored.dtype not in SOURCE_DTYPES:
            raise CheckpointError(f"{stored.file}: {name} is stored as {stored.dtype}; only float32/bfloat16/float16 "
                                  "weights convert (quantized checkpoints do not)")
        tensors[name] = SourceTensor(stored.file, name, stored.shape, DTYPES[stored.dtype])
    return tensors


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
    top, text_given = read_source_config(src)
    layout = check_text_config(top, text_given, config_file)
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

    plan.hf_config = output_config(config, top, layout, keep_vision, dtype or embed.dtype)
    plan.generation_config = generation_config(src, config, layout)
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


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _load_source_tensor(handle, name: str) -> torch.Tensor:
    """One tensor out of a memory-mapped safetensors file (its own buffer; the only copy in RAM)."""
    return handle.get_tensor(name)


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
        raise CheckpointError(f"{parent}: {human_bytes(plan.total_bytes)} needed, {human_bytes(free)} free")
    return out


def write_conversion(plan: ConversionPlan, out, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     overwrite: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Write the planned checkpoint to `out` atomically (temporary folder beside it, then a rename)."""
    out = check_output(plan, out, overwrite=overwrite)
    parent = out.parent
    # Read in source-file order; new tensors (self-conditioning) go last.
    order = sorted(plan.tensors, key=lambda t: (t.source is None, str(t.source.file) if t.source else "", t.key))
    shards = pack_shards(((t, t.nbytes) for t in order), max_shard_bytes)
    handles: dict[Path, object] = {}

    def read(t: PlannedTensor) -> torch.Tensor:  # one tensor, released by the writer before the next
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
        write_shards(tmp, shards, lambda shard: (shard, read), progress)
        handles.clear()
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
        f"size             {human_bytes(plan.total_bytes)}",
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
