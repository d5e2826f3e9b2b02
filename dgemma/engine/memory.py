"""The memory generation takes, from the architecture alone (no weight is read): the weights in a storage
format, the engine's KV cache and the sampler's logits buffer. `dgemma info` prints it and `dgemma bench`
checks its runs against it; a training run's plan is dgemma/training/memory.py.

  weights         bf16: every parameter at 2 bytes. int8 / int4: the linears and the fused experts as
                  dgemma.quant.quantize stores them (`bytes_per_weight`: the code and its share of its
                  group's fp16 scale); the tied embedding / LM head, the routers, the norms and the vision
                  tower kept bf16
  KV cache        as dgemma.model.attention.KVCache lays it out (built on the meta device, which allocates
                  nothing): full layers one slot per position (K = V: keys only), sliding layers a ring of
                  window - 1 slots, both plus one canvas of slots the decoder writes its own keys into
  sampler buffer  one fp32 (batch, canvas, vocabulary) logits buffer
"""

from __future__ import annotations

import torch

from dgemma.config import ModelConfig
from dgemma.model.attention import KVCache
from dgemma.quant.quantize import CODE_BYTES, FORMATS, GROUP_SIZE, SCALE_BYTES, bytes_per_weight

WEIGHT_FORMATS = ("bf16", *FORMATS)  # the formats weights are planned in
KEPT = "embedding/LM head, routers, norms, vision tower"  # what a quantised model keeps in bf16


def weight_counts(config: ModelConfig) -> tuple[int, int]:
    """(weights quantised, weights kept bf16) of a model stored int8 or int4 (the vision tower with the kept)."""
    counts = config.param_counts()
    kept = counts["embedding"] + counts["router"] + counts["norms"] + config.hidden_size  # + self-conditioning's pre-norm
    return counts["total"] - kept, kept + counts.get("vision", 0)


def planned_weight_bytes(config: ModelConfig, fmt: str) -> int:
    """Bytes the weights take stored in `fmt` (bf16, int8 or int4), planned from the config."""
    quantised, kept = weight_counts(config)
    return int(quantised * bytes_per_weight(fmt) + kept * bytes_per_weight("bf16"))


def weight_arithmetic(config: ModelConfig, fmt: str) -> str:
    """`planned_weight_bytes` as a worked sum, for people."""
    quantised, kept = weight_counts(config)
    if fmt == "bf16":
        return f"{(quantised + kept) / 1e9:.3f}B x 2 B"
    return (f"{quantised / 1e9:.3f}B quantised x ({CODE_BYTES[fmt]} B + one {SCALE_BYTES} B scale per "
            f"{GROUP_SIZE[fmt]} = {bytes_per_weight(fmt):.4f} B) + {kept / 1e9:.3f}B kept bf16 ({KEPT}) x 2 B")


def kv_cache(config: ModelConfig, batch: int, context: int, dtype: torch.dtype = torch.bfloat16) -> KVCache:
    """The KV cache an engine of `batch` rows and `context` positions allocates, on the meta device: its
    layout (`capacity`, `canvas_slots`) and `nbytes()`, without its memory."""
    return KVCache(config, batch, context, device="meta", dtype=dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one position's keys and values take over every layer (a one-position cache that keeps all)."""
    return KVCache(config, 1, 1, keep_all=True, device="meta", dtype=dtype).nbytes()


def logits_buffer_bytes(config: ModelConfig, batch: int) -> int:
    """The sampler's one fp32 (batch, canvas, vocabulary) logits buffer."""
    return batch * config.canvas_length * config.vocab_size * torch.finfo(torch.float32).bits // 8


def generation_memory(config: ModelConfig, fmt: str, batch: int, context: int) -> dict:
    """A worked memory budget for generation: `fmt` weights, a bf16 KV cache of `batch` rows of `context`
    positions, and the sampler's buffer, in bytes."""
    weights = planned_weight_bytes(config, fmt)
    kv = kv_cache(config, batch, context).nbytes()
    logits = logits_buffer_bytes(config, batch)
    return {
        "format": fmt,
        "batch": batch,
        "context": context,
        "weight_bytes": weights,
        "kv_bytes_per_token_bf16": kv_bytes_per_token(config),
        "kv_cache_bytes": kv,
        "sampler_buffer_bytes": logits,
        "total_bytes": weights + kv + logits,
    }
