"""The per-process memory plan of a training run, from the architecture alone (no weight is read).

    dgemma info --preset diffusiongemma-26b-a4b --train --lora --world-size 8 --batch 1 --seq 2048

Terms, per process, for FSDP2 over W processes (W = 1: one process holds everything):
  parameters   every parameter's shard (the largest, rank 0's: FSDP2 splits dim 0 in ceil(rows / W)
               chunks): fp32 master weights; a LoRA base in its storage dtype (bf16 under
               --precision bf16 or --mixed-precision bf16), its adapters fp32
  gradients    fp32, sharded like the parameters, for the weights that learn
  optimizer    AdamW's two fp32 moments per learning weight, sharded
  gathered     FSDP's unsharded copies while a unit runs: the root (embedding = LM head, final norm,
               self-conditioning) plus two blocks (the one running and the one prefetched), in the compute
               dtype, and one block's unsharded fp32 gradients before the reduce-scatter
  activations  what autograd keeps for the backward, per micro-batch row: the encoder over S tokens and
               the decoder's second pass over one canvas of L, every layer (with activation checkpointing:
               each layer's input, plus one layer recomputed), and the fp32 logits of both losses (upper
               bound: every position predicted). Attention is counted as flash/memory-efficient attention
               keeps it (O(S), no S x S scores).
The activation term is an estimate from the layer shapes; the others are exact byte counts of the
tensors the run allocates.
"""

from __future__ import annotations

import torch

from dgemma.config import ModelConfig

TERMS = ("parameters", "gradients", "optimizer", "gathered", "activations")


def plan_options(config, world_size: int, micro_batch: int, seq: int) -> dict:
    """memory_plan's keyword arguments for a TrainConfig."""
    from dgemma.training.model_setup import base_dtype

    lora = (dict(rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                 dropout=config.lora_dropout) if config.lora else None)
    return dict(world_size=world_size, micro_batch=micro_batch, seq=seq, lora=lora, objective=config.objective,
                train_router=config.train_router, lora_base_bf16=base_dtype(config) == torch.bfloat16,
                compute_bf16=config.precision == "bf16" or config.mixed_precision == "bf16",
                activation_checkpointing=config.activation_checkpointing)


def memory_plan(config: ModelConfig, *, world_size: int, micro_batch: int, seq: int, lora: dict | None = None,
                objective: str = "diffusion", train_router: bool = False, lora_base_bf16: bool = False,
                compute_bf16: bool = False, activation_checkpointing: bool = False) -> dict:
    """Bytes per process for each of TERMS and their total; see the module docstring."""
    from dgemma.model.network import DiffusionGemma
    from dgemma.training.model_setup import configure_trainable

    with torch.device("meta"):
        model = DiffusionGemma(config)  # a vision tower is held (frozen): training is text-only
    if lora is not None and lora_base_bf16:
        model.to(torch.bfloat16)
    trainable = configure_trainable(model, objective=objective, lora=lora, train_router=train_router)
    W = world_size
    params = list(model.parameters())
    learning = [p for p in params if p.requires_grad]
    compute = 2 if compute_bf16 else 4

    def gathered_bytes(module) -> int:
        return sum(p.numel() * (compute if p.is_floating_point() else p.element_size()) for p in module.parameters())

    block_bytes = max(gathered_bytes(b) for b in model.layers)
    block_grads = max(sum(p.numel() * 4 for p in b.parameters() if p.requires_grad) for b in model.layers)
    root_bytes = gathered_bytes(model) - sum(gathered_bytes(b) for b in model.layers)
    gathered = 0 if W == 1 else root_bytes + 2 * block_bytes + block_grads

    c = config
    H, L, V, S = c.hidden_size, c.canvas_length, c.vocab_size, seq
    q_dim = c.num_heads * max(c.head_dim, c.global_head_dim)
    kv_dim = 2 * max(c.num_kv_heads * c.head_dim, c.num_global_kv_heads * c.global_head_dim)
    k, I_moe = c.top_k_experts, c.moe_intermediate_size
    # elements autograd keeps per token and layer: norms/residuals (~10 H), q, k, v and the attention
    # output, the dense GeGLU (gate, up, activation, product), the router's fp32 scores (2 E in 2-byte
    # units), and per routed choice its input, gate/up/activation/product and output
    per_token_layer = (10 * H + 2 * q_dim + kv_dim + 4 * c.intermediate_size + 2 * c.num_experts
                       + k * (2 * H + 4 * I_moe)) * compute
    tokens = S + (L if objective == "diffusion" else 0)
    if activation_checkpointing:
        layers = c.num_layers * tokens * H * compute + tokens * per_token_layer
    else:
        layers = c.num_layers * tokens * per_token_layer
    # fp32 logits: the encoder's next-token loss (logits + softmax for the backward) and the decoder's
    # two passes (pass 1's logits feed self-conditioning; pass 2's logits and softmax)
    logits = 2 * S * V * 4 + (3 * L * V * 4 if objective == "diffusion" else 0)
    activations = micro_batch * (layers + logits)

    def shard(p, bytes_per_element: int) -> int:
        """Bytes of p's largest shard: FSDP2 splits dim 0 into chunks of ceil(rows / W) (rank 0's)."""
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // W) * (p.numel() // max(rows, 1)) * bytes_per_element

    plan = {
        "parameters": sum(shard(p, p.element_size()) for p in params),
        "gradients": sum(shard(p, 4) for p in learning),
        "optimizer": sum(shard(p, 8) for p in learning),
        "gathered": gathered,
        "activations": activations,
    }
    plan["total"] = sum(plan[t] for t in TERMS)
    plan.update(world_size=W, micro_batch=micro_batch, seq=seq, trainable_params=trainable,
                total_params=sum(p.numel() for p in params), activation_checkpointing=activation_checkpointing,
                compute_dtype="bf16" if compute_bf16 else "fp32", lora=lora is not None)
    return plan


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def plan_summary(plan: dict) -> str:
    return ", ".join(f"{t} {format_bytes(plan[t])}" for t in TERMS)
