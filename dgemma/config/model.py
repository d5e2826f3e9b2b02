"""The model's shape: `ModelConfig` holds the text backbone of DiffusionGemma in flat, readable fields and
`VisionConfig` its vision tower; `from_hf_dict` / `to_hf_dict` translate to and from the nested `config.json`
that Hugging Face checkpoints carry (`text_config`, `per_layer_config`, `rope_parameters`, `layer_types`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    """A config that cannot describe a DiffusionGemma text model."""


@dataclass
class ModelConfig:
    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112  # dense GeGLU MLP, every layer (also the self-conditioning MLP)
    num_layers: int = 30
    num_heads: int = 16
    # sliding-window layers
    num_kv_heads: int = 8
    head_dim: int = 256
    sliding_window: int = 1024
    rope_theta: float = 10_000.0
    # full-attention layers: own head dim and KV heads, K = V (no v_proj), partial "proportional" RoPE
    global_head_dim: int = 512
    num_global_kv_heads: int = 2
    global_rope_theta: float = 1_000_000.0
    global_partial_rotary_factor: float = 0.25
    layer_types: tuple[str, ...] = ((SLIDING,) * 5 + (FULL,)) * 5
    # mixture of experts, in parallel with the dense MLP
    num_experts: int = 128
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 262_144
    canvas_length: int = 256
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2
    initializer_range: float = 0.02
    # images: the vision tower (None: a text-only model) and the prompt tokens that frame an image's soft tokens
    vision: VisionConfig | None = None
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    # "vision": in the encoder, the soft tokens of one image attend to each other both ways (text stays causal)
    use_bidirectional_attention: str | None = None

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types)
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ConfigError(f"use_bidirectional_attention={self.use_bidirectional_attention!r} is not supported "
                              "(None or 'vision'; a fully bidirectional encoder, 'all', is not)")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {SLIDING, FULL}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        for heads in (self.num_kv_heads, self.num_global_kv_heads):
            if heads <= 0 or self.num_heads % heads:
                raise ConfigError(f"num_heads={self.num_heads} is not a multiple of kv heads {heads}")
        if not 1 <= self.top_k_experts <= self.num_experts:
            raise ConfigError(f"top_k_experts={self.top_k_experts} outside 1..num_experts={self.num_experts}")

    # -- per-layer geometry -------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_kv_heads if self.is_sliding(layer) else self.num_global_kv_heads

    # -- parameter arithmetic -----------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts by group, as stored in the checkpoint (tied embedding once). "total" and
        "active" are the text model's; a model with a vision tower also has "vision", counted apart."""
        h, v = self.hidden_size, self.vocab_size
        attn = 0
        for i in range(self.num_layers):
            hd, kv = self.layer_head_dim(i), self.layer_kv_heads(i)
            q = h * self.num_heads * hd
            k = h * kv * hd
            vproj = k if self.is_sliding(i) else 0
            o = self.num_heads * hd * h
            attn += q + k + vproj + o + 2 * hd  # + q_norm, k_norm
        dense = self.num_layers * 3 * h * self.intermediate_size
        one_expert = 3 * h * self.moe_intermediate_size
        experts = self.num_layers * self.num_experts * one_expert
        router = self.num_layers * (h * self.num_experts + h + self.num_experts)
        norms = self.num_layers * 7 * h + h  # seven RMSNorms per layer + final norm
        embedding = v * h
        self_cond = 3 * h * self.intermediate_size + h
        total = attn + dense + experts + router + norms + embedding + self_cond
        active_experts = self.num_layers * self.top_k_experts * one_expert
        # per token through the backbone: everything but the inactive experts, the tied embedding counted
        # once (as the LM head), the decoder-only self-conditioning MLP left out (as the published 3.8B does).
        active = total - experts + active_experts - self_cond
        return {
            "attention": attn,
            "dense_mlp": dense,
            "experts": experts,
            "router": router,
            "norms": norms,
            "embedding": embedding,
            "self_conditioning": self_cond,
            "total": total,
            "active": active,
            # the vision tower and its projection, outside total and active: it runs once per image
            **({"vision": self.vision.param_count(h)} if self.vision is not None else {}),
        }

    # -- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a DiffusionGemma `config.json` (top level with `text_config`, or a bare text config)."""
        text = cfg.get("text_config", cfg)
        if text is None:
            raise ConfigError("config.json has no text_config")
        num_layers = text.get("num_hidden_layers", 30)
        layer_types = text.get("layer_types") or [
            SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)
        ]
        layer_types = list(layer_types)
        if layer_types and layer_types[-1] != FULL:  # the reference forces this too
            layer_types[-1] = FULL
        full_idx = [i for i, t in enumerate(layer_types) if t == FULL]
        base_kv = text.get("num_key_value_heads", 8)
        if "per_layer_config" in text:
            # transformers saves only the fields that differ from the base layer (often nothing)
            per_layer = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
            over = per_layer.get(full_idx[0], {}) if full_idx else {}
            global_head_dim = over.get("head_dim", text.get("head_dim", 256))
            num_global_kv = over.get("num_key_value_heads", base_kv)
        else:  # a hand-written config: the constructor's keyword defaults apply
            per_layer = {}
            global_head_dim = text.get("global_head_dim", 512)
            num_global_kv = text.get("num_global_key_value_heads") or base_kv
            over = {}
        if "per_layer_config" in text:  # a full layer without an entry has the base shape
            for i in full_idx:
                o = per_layer.get(i, {})
                shape = (o.get("head_dim", text.get("head_dim", 256)), o.get("num_key_value_heads", base_kv))
                if shape != (global_head_dim, num_global_kv):
                    raise ConfigError("full-attention layers with different shapes are not supported")
        rope = text.get("rope_parameters") or {}
        rs = rope.get(SLIDING) or {"rope_theta": 10_000.0}
        rf = rope.get(FULL) or {"rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
        for name, r in ((SLIDING, rs), (FULL, rf)):
            kind = r.get("rope_type", "default")
            if kind not in ("default", "proportional") or r.get("factor", 1.0) != 1.0:
                raise ConfigError(f"unsupported rope for {name}: {r}")
        if rs.get("rope_type", "default") != "default" or rs.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"unsupported rope for sliding layers: {rs}")
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"unsupported activation {text.get('hidden_activation')}")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias=True is not supported")
        eos = text.get("eos_token_id", 1)
        return cls(
            vocab_size=text.get("vocab_size", 262_144),
            hidden_size=text.get("hidden_size", 2816),
            intermediate_size=text.get("intermediate_size", 2112),
            num_layers=num_layers,
            num_heads=text.get("num_attention_heads", 16),
            num_kv_heads=text.get("num_key_value_heads", 8),
            head_dim=text.get("head_dim", 256),
            sliding_window=text.get("sliding_window", 1024),
            rope_theta=rs.get("rope_theta", 10_000.0),
            global_head_dim=global_head_dim,
            num_global_kv_heads=num_global_kv,
            global_rope_theta=rf.get("rope_theta", 1_000_000.0),
            global_partial_rotary_factor=(
                rf.get("partial_rotary_factor", 1.0) if rf.get("rope_type") == "proportional" else 1.0
            ),
            layer_types=tuple(layer_types),
            num_experts=text.get("num_experts") or 128,
            top_k_experts=text.get("top_k_experts") or 8,
            moe_intermediate_size=text.get("moe_intermediate_size") or 704,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=_softcap(text.get("final_logit_softcapping", 30.0)),
            max_position_embeddings=text.get("max_position_embeddings", 262_144),
            canvas_length=cfg.get("canvas_length", 256) or 256,
            pad_token_id=text.get("pad_token_id", 0) if text.get("pad_token_id") is not None else 0,
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            bos_token_id=text.get("bos_token_id", 2) if text.get("bos_token_id") is not None else 2,
            initializer_range=text.get("initializer_range", 0.02),
            vision=VisionConfig.from_hf_dict(cfg["vision_config"]) if cfg.get("vision_config") else None,
            image_token_id=_id_or(cfg.get("image_token_id"), 258_880),
            boi_token_id=_id_or(cfg.get("boi_token_id"), 255_999),
            eoi_token_id=_id_or(cfg.get("eoi_token_id"), 258_882),
            use_bidirectional_attention=text.get("use_bidirectional_attention"),
        )

    def to_hf_dict(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """A `config.json` that transformers' `DiffusionGemmaForBlockDiffusion` loads.

        `base` is the config the model was loaded from; its other keys are kept as they were (also its
        vision_config when this model runs without the tower, as transformers always builds one).
        """
        out = copy.deepcopy(base) if base else _default_top_level()
        text = out.setdefault("text_config", {}) or {}
        out["text_config"] = text
        full_over = {"head_dim": self.global_head_dim, "num_key_value_heads": self.num_global_kv_heads}
        text.update(
            {
                "model_type": "diffusion_gemma_text",
                "vocab_size": self.vocab_size,
                **_shape_keys(self),
                "sliding_window": self.sliding_window,
                "layer_types": list(self.layer_types),
                "per_layer_config": {str(i): dict(full_over) for i, t in enumerate(self.layer_types) if t == FULL},
                "rope_parameters": {
                    SLIDING: {"rope_type": "default", "rope_theta": self.rope_theta},
                    FULL: {
                        "rope_type": "proportional",
                        "rope_theta": self.global_rope_theta,
                        "partial_rotary_factor": self.global_partial_rotary_factor,
                    },
                },
                "num_experts": self.num_experts,
                "top_k_experts": self.top_k_experts,
                "moe_intermediate_size": self.moe_intermediate_size,
                "rms_norm_eps": self.rms_norm_eps,
                "final_logit_softcapping": self.final_logit_softcapping,
                "max_position_embeddings": self.max_position_embeddings,
                "hidden_activation": "gelu_pytorch_tanh",
                "pad_token_id": self.pad_token_id,
                "bos_token_id": self.bos_token_id,
                "tie_word_embeddings": True,
                "initializer_range": self.initializer_range,
                "use_bidirectional_attention": self.use_bidirectional_attention,
            }
        )
        if self.vision is not None:
            out["vision_config"] = {**(out.get("vision_config") or {}), **self.vision.to_hf_dict()}
        out.update(image_token_id=self.image_token_id, boi_token_id=self.boi_token_id, eoi_token_id=self.eoi_token_id)
        text.setdefault("eos_token_id", self.eos_token_id)
        text.pop("global_head_dim", None)
        text.pop("num_global_key_value_heads", None)
        out["canvas_length"] = self.canvas_length
        out["tie_word_embeddings"] = True
        out["model_type"] = "diffusion_gemma"
        out["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class VisionConfig:
    """The Gemma 4 vision tower (`vision_config` in config.json): a ViT over square pixel patches with 2-D RoPE,
    whose outputs are average-pooled `pooling_kernel_size` x `pooling_kernel_size` into soft tokens."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 16
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10_240  # rows of the learned x and y position tables
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False  # linears clamp their input and output to stored ranges
    standardize: bool = False  # soft tokens get (x - std_bias) * std_scale

    def __post_init__(self):
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(f"vision num_heads={self.num_heads} is not a multiple of kv heads {self.num_kv_heads}")
        if self.head_dim % 4:  # half of each head turns with x, half with y, each in rotating pairs
            raise ConfigError(f"vision head_dim={self.head_dim} must be a multiple of 4 (2-D RoPE)")
        if self.patch_size < 1 or self.pooling_kernel_size < 1:
            raise ConfigError("vision patch_size and pooling_kernel_size must be >= 1")

    @classmethod
    def from_hf_dict(cls, vision: dict[str, Any]) -> "VisionConfig":
        if vision.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ConfigError(f"unsupported vision tower {vision.get('model_type')!r} (expected gemma4_vision)")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"unsupported vision rope {rope}")
        if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"unsupported vision activation {vision.get('hidden_activation')}")
        if vision.get("attention_bias"):
            raise ConfigError("vision attention_bias=True is not supported")
        if vision.get("output_proj_dims", vision.get("hidden_size")) != vision.get("hidden_size"):
            raise ConfigError("vision output_proj_dims different from hidden_size is not supported")
        d = cls()
        return cls(
            hidden_size=vision.get("hidden_size", d.hidden_size),
            intermediate_size=vision.get("intermediate_size", d.intermediate_size),
            num_layers=vision.get("num_hidden_layers", d.num_layers),
            num_heads=vision.get("num_attention_heads", d.num_heads),
            num_kv_heads=vision.get("num_key_value_heads", d.num_kv_heads),
            head_dim=vision.get("head_dim") or d.head_dim,
            patch_size=vision.get("patch_size", d.patch_size),
            pooling_kernel_size=vision.get("pooling_kernel_size", d.pooling_kernel_size),
            position_embedding_size=vision.get("position_embedding_size", d.position_embedding_size),
            rope_theta=rope.get("rope_theta", d.rope_theta),
            rms_norm_eps=vision.get("rms_norm_eps", d.rms_norm_eps),
            use_clipped_linears=bool(vision.get("use_clipped_linears", d.use_clipped_linears)),
            standardize=bool(vision.get("standardize", d.standardize)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "model_type": "gemma4_vision",
            **_shape_keys(self),
            "patch_size": self.patch_size,
            "pooling_kernel_size": self.pooling_kernel_size,
            "position_embedding_size": self.position_embedding_size,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "use_clipped_linears": self.use_clipped_linears,
            "standardize": self.standardize,
            "hidden_activation": "gelu_pytorch_tanh",
        }

    def param_count(self, text_hidden_size: int) -> int:
        """Parameters of the tower and of the projection into the text model (buffers not counted)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * hd  # q, k, v, o + q_norm, k_norm
        block = attn + 3 * d * self.intermediate_size + 4 * d  # + gated MLP + four norms
        patches = 3 * self.patch_size**2 * d + 2 * self.position_embedding_size * d
        return patches + self.num_layers * block + d * text_hidden_size


def _shape_keys(c: ModelConfig | VisionConfig) -> dict[str, int]:
    """The config.json keys a text and a vision config share, from our field names."""
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim}


def _id_or(value, default: int) -> int:
    return default if value is None else int(value)


def _softcap(value) -> float:
    # transformers fixes DiffusionGemma's final soft-cap at 30; a config without it means that value
    if value is None:
        return 30.0
    if not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"final_logit_softcapping must be a positive number, got {value!r}")
    return float(value)


def _default_top_level() -> dict[str, Any]:
    # A minimal vision tower description for a text-only model: transformers builds one from it (and no
    # weights for it are stored); dgemma builds none.
    return {
        "model_type": "diffusion_gemma",
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "text_config": {},
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
        },
        "tie_word_embeddings": True,
        "canvas_length": 256,
    }
