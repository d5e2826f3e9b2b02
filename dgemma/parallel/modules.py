"""The network split over N ranks of a torch.distributed process group (tensor and expert parallel).

Per layer, after transformers' `base_model_tp_plan` / `base_model_ep_plan` for DiffusionGemma:
  attention   -- by query heads: q_proj column-split, o_proj row-split, one all-reduce of o_proj's partial
                 sums. KV heads are split where a layer has at least N of them; where it has fewer, each
                 rank keeps the one KV head its query heads read (a KV head replicated over N / kv ranks:
                 the 26B's full layers have 2 global KV heads).
  dense MLP   -- gate/up column-split, down row-split (partial sums).
  experts     -- expert parallel: rank r holds experts [r E/N, (r+1) E/N); the router is replicated (as
                 in both plans: every rank routes every token the same way) and each rank runs only the
                 (token, choice) entries of its own experts. The dense MLP's and the experts' partial
                 sums go through ONE all-reduce per layer (stacked), because each is normed before they
                 are added.
  vocabulary  -- the tied embedding is split by rows, padded to a multiple of N (Vp = N ceil(V / N); rank r:
                 tokens [r Vp/N, (r+1) Vp/N), the rows past V zero): a lookup zeroes the tokens other ranks
                 hold and all-reduces (vLLM's VocabParallelEmbedding), the LM head all-gathers the ranks'
                 logits and drops the padded ones (logits are (..., V): nothing past V is ever sampled,
                 scored or counted), and the self-conditioning soft embedding multiplies each rank's
                 columns of the probabilities by its rows and all-reduces. Any vocabulary splits.
Replicated: norms, router, the self-conditioning MLP (outside the plans' `layers.*`), the vision tower.

The collectives are hand-written c10d calls, each named where it runs, rather than DTensor's
`parallelize_module`: the weights are plain local tensors because each rank loads only its slice from
the shards (`dgemma.parallel.load`) and quantises it into dgemma's int8/int4 modules, which are
not DTensor-aware, and a DTensor's per-op dispatch would sit on each of a denoising step's few hundred
small ops. The process group comes from a DeviceMesh (`torch.distributed.device_mesh.init_device_mesh`).
Under torch.compile (`dgemma.compilation.steps.compile_model`, on every rank alike) the same calls are
torch's functional collectives, which dynamo traces into the graph, and a rank's share of the routed
experts is one opaque op (which of its entries fall on this rank's experts depends on the routing's values);
every rank compiles the same graph, so the compiled ranks meet at the same collectives as eager ones do.

The split keeps every module and parameter name, so a checkpoint's keys map one to one onto slices; the
split classes below are the network's own classes with forwards that add the collectives, swapped in
place on a meta-device model (`module.__class__ = ...`, as FSDP2's `fully_shard` does).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.config import ModelConfig
from dgemma.model.block import Attention, Block
from dgemma.model.experts import Experts
from dgemma.model.network import DiffusionGemma
from dgemma.parallel.group import TensorParallel
from dgemma.parallel.plan import check_split, local_config, mlp_slice, vocab_rows


class SplitAttention(Attention):
    """This rank's query heads (and their KV heads); o_proj's partial sums all-reduced."""

    tp: TensorParallel

    def attend(self, q, k, v, mask, pack=None, read=None):
        # collective: all-reduce of o_proj (a step cache's attention read is summed once, by `gather_read`)
        return self.tp.all_reduce(super().attend(q, k, v, mask, pack=pack, read=read))


class SplitBlock(Block):
    """A block whose dense MLP is this rank's columns and whose experts are this rank's E/N."""

    tp: TensorParallel
    first_expert: int

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (n, H)
        dense = self.mlp(self.pre_feedforward_layernorm(x)).reshape_as(flat)  # partial sum over ranks
        weights, experts = self.router(flat)  # replicated: every rank routes alike
        normed = self.pre_feedforward_layernorm_2(flat)
        if torch.compiler.is_dynamo_compiling():  # one opaque op in the graph (its shapes follow the routing)
            routed = split_local_experts(self.op_key, normed, weights, experts)
        else:
            routed = self._local_experts(normed, weights, experts)  # partial sum
        # collective: ONE all-reduce of the dense MLP's and the experts' partial sums, stacked
        dense, routed = self.tp.all_reduce(torch.stack([dense, routed])).unbind(0)
        dense = self.post_feedforward_layernorm_1(dense.view_as(x))
        routed = self.post_feedforward_layernorm_2(routed.view_as(x))
        return x + self.post_feedforward_layernorm(dense + routed)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (n, H), weights/experts (n, k) over all E experts -> (n, H): the weighted sum of the choices that
        fall on this rank's experts (zero rows for tokens with none). One host read: which entries are ours."""
        k = experts.shape[1]
        local = experts.reshape(-1) - self.first_expert  # (n k,) expert id among ours
        mine = ((local >= 0) & (local < self.experts.gate_up_proj.shape[0])).nonzero()[:, 0]
        out = torch.zeros_like(x)
        if mine.numel():
            tokens = mine // k
            y = self.experts(x[tokens], weights.reshape(-1)[mine, None], local[mine, None])  # (m, H), k = 1 each
            out.index_add_(0, tokens, y)
        return out


    def prepare_for_compile(self):
        """Called by `compile_model` before tracing: the key `split_local_experts` finds this block by."""
        _SPLIT_BLOCKS[id(self)] = self
        self.op_key = id(self)


# Under torch.compile a rank's routed experts run as one custom op, found through this registry (as
# dgemma.model.experts does for a whole model's experts).
_SPLIT_BLOCKS: "weakref.WeakValueDictionary[int, SplitBlock]" = weakref.WeakValueDictionary()


@torch.library.custom_op("dgemma::split_local_experts", mutates_args=())
def split_local_experts(key: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return _SPLIT_BLOCKS[key]._local_experts(x, weights, experts)


@split_local_experts.register_fake
def _(key, x, weights, experts):
    return torch.empty_like(x)


class SplitDiffusionGemma(DiffusionGemma):
    """The network over this rank's slices; logits come out whole (all-gathered) on every rank."""

    tp: TensorParallel
    local_config: ModelConfig  # the heads this rank holds: what its KV cache is shaped by
    vocab_start: int

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed_tokens.weight.shape[0]
        local = ids - self.vocab_start
        ours = (local >= 0) & (local < rows)
        x = self.embed_tokens(local.clamp(0, rows - 1)) * ours[..., None].to(self.dtype)
        return self.tp.all_reduce(x) * self.embed_scale()  # collective: all-reduce of the vocabulary slices

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        normed, table = self.norm(hidden), self.int8_table  # int8 codes of this rank's rows (--cpu-int8-compute)
        if table is not None and not torch.is_grad_enabled():
            logits = table.logits(normed)  # (..., Vp/N) this rank's tokens
        else:
            logits = F.linear(normed, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        logits = torch.sigmoid(logits * (2.0 / cap)) * (2.0 * cap) - cap  # cap tanh(z / cap), see DiffusionGemma.head
        # collective: all-gather of the vocabulary slices, the padded rows' logits dropped: (..., V)
        return self.tp.all_gather_last(logits, keep=self.config.vocab_size)

    def soft_embedding_from_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (..., V) -> (..., H): this rank's columns (fewer than its rows on the rank holding the padding)
        times the matching rows of its table."""
        rows = self.embed_tokens.weight.shape[0]
        ours = probs[..., self.vocab_start : self.vocab_start + rows]
        if self.int8_table is not None and not torch.is_grad_enabled():  # the codes cover the padding rows too
            part = self.int8_table.soft_embedding(F.pad(ours, (0, rows - ours.shape[-1])), self.dtype)
        else:
            part = ours.to(self.dtype) @ self.embed_tokens.weight[: ours.shape[-1]]
        # collective: all-reduce of each rank's columns of the probabilities times its rows of the table
        return self.tp.all_reduce(part) * self.embed_scale()

    @property
    def cache_config(self) -> ModelConfig:
        return self.local_config  # the cache holds this rank's KV heads

    def gather_read(self, read: torch.Tensor):
        """The step cache's attention read (n, L), each rank's over its own query heads: summed over the ranks,
        so that every rank refreshes the same positions."""
        read.copy_(self.tp.all_reduce(read))  # collective: all-reduce of the read


def _linear(in_features: int, out_features: int, like: nn.Linear) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device=like.weight.device, dtype=like.weight.dtype)


@torch.no_grad()
def split_model(model: DiffusionGemma, tp: TensorParallel, quantization: str | None = None) -> SplitDiffusionGemma:
    """Reshape a (meta-device, unquantised) model in place into this rank's part, with the dense MLP split
    on the group bounds of `quantization`; returns it."""
    config, N, r = model.config, tp.ranks, tp.rank
    check_split(config, N, quantization)
    start, stop = mlp_slice(config.intermediate_size, N, r, quantization)
    mine = local_config(config, N)
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        q_heads, kv_heads = config.num_heads // N, mine.layer_kv_heads(i)
        h, d = config.hidden_size, attn.head_dim
        attn.q_proj = _linear(h, q_heads * d, attn.q_proj)
        attn.k_proj = _linear(h, kv_heads * d, attn.k_proj)
        if attn.v_proj is not None:
            attn.v_proj = _linear(h, kv_heads * d, attn.v_proj)
        attn.o_proj = _linear(q_heads * d, h, attn.o_proj)
        attn.num_heads, attn.num_kv_heads = q_heads, kv_heads
        attn.__class__, attn.tp = SplitAttention, tp
        mlp, inner = block.mlp, stop - start
        mlp.gate_proj, mlp.up_proj = _linear(h, inner, mlp.gate_proj), _linear(h, inner, mlp.up_proj)
        mlp.down_proj = _linear(inner, h, mlp.down_proj)
        experts = config.num_experts // N
        with torch.device(block.experts.gate_up_proj.device):  # the meta device: nothing allocated
            block.experts = Experts(config.replace(num_experts=experts)).to(block.experts.gate_up_proj.dtype)
        block.__class__, block.tp, block.first_expert = SplitBlock, tp, r * experts
    rows = vocab_rows(config.vocab_size, N)
    old = model.embed_tokens.weight
    model.embed_tokens = nn.Embedding(rows, config.hidden_size, device=old.device, dtype=old.dtype)
    model.__class__, model.tp, model.local_config, model.vocab_start = SplitDiffusionGemma, tp, mine, r * rows
    return model
