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
the shards (`dgemma.model.parallel_load`) and quantises it into dgemma's int8/int4 modules, which are
not DTensor-aware, and a DTensor's per-op dispatch would sit on each of a denoising step's few hundred
small ops. The process group comes from a DeviceMesh (`torch.distributed.device_mesh.init_device_mesh`).
Under torch.compile (`dgemma.model.compilation.compile_model`, on every rank alike) the same calls are
torch's functional collectives, which dynamo traces into the graph, and a rank's share of the routed
experts is one opaque op (which of its entries fall on this rank's experts depends on the routing's values);
every rank compiles the same graph, so the compiled ranks meet at the same collectives as eager ones do.

The split keeps every module and parameter name, so a checkpoint's keys map one to one onto slices; the
split classes below are the network's own classes with forwards that add the collectives, swapped in
place on a meta-device model (`module.__class__ = ...`, as FSDP2's `fully_shard` does).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from dgemma.config import ModelConfig
from dgemma.model.experts import Experts
from dgemma.model.network import Attention, Block, DiffusionGemma
from dgemma.model.quant import GROUP_SIZE


# How long a collective may wait for the other ranks before this one gives up (a dead or hung rank). The
# engine's ranks meet at least every few seconds even when idle (dgemma.engine.lockstep), so this bounds
# how long a failure goes unnoticed.
DEFAULT_TIMEOUT_S = 30.0
# ... except in a compiled call that compiled: the ranks compile the same graph, but not in the same time,
# and the first to finish waits in the graph's first collective for the others (`TensorParallel.compiled_call`)
COMPILE_TIMEOUT_S = 3600.0
# Every rank stamps the group's store with the time this often from a thread of its own (`_heartbeat`), so that
# when a collective fails the ranks can say which rank went silent (a hung or stopped process stamps nothing).
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 5.0


class SplitError(ValueError):
    """A number of ranks the model (or its stored quantised layout) cannot be split over; one line naming
    the constraint."""


# -- the plan: which slice of every tensor a rank holds ----------------------------------------------
@dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of `size` along `dim`, scaled to the tensor at hand: a dense weight's slice and
    the same slice of its int8/int4 codes (two int4 codes a byte) and scales (one per group), which
    group-aligned bounds keep in step."""

    dim: int
    start: int
    stop: int
    size: int

    def index(self, shape) -> tuple[slice, ...]:
        n = shape[self.dim]
        return (*(slice(None),) * self.dim, slice(self.start * n // self.size, self.stop * n // self.size))


def even(dim: int, part: int, parts: int, size: int) -> Slice:
    """Part `part` of `parts` equal chunks of a dim `size` long."""
    return Slice(dim, part * size // parts, (part + 1) * size // parts, size)


def kv_slice(kv_heads: int, ranks: int, rank: int, head_dim: int) -> Slice:
    """Which KV heads rank `rank` keeps: kv / N of them where there are >= N, else the one its query heads
    read (query heads are grouped contiguously onto KV heads)."""
    if kv_heads >= ranks:
        return even(0, rank, ranks, kv_heads * head_dim)
    return even(0, rank * kv_heads // ranks, kv_heads, kv_heads * head_dim)


def mlp_slice(intermediate: int, ranks: int, rank: int, quantization: str | None) -> tuple[int, int]:
    """This rank's columns [start, stop) of the dense MLP: as even as whole quantisation groups allow (the
    26B's 2112 over 4 ranks in int4: 544, 544, 512, 512), so down_proj's row split falls on group bounds."""
    unit = quant_group(intermediate, quantization) if quantization else 1
    units = intermediate // unit
    return rank * units // ranks * unit, (rank + 1) * units // ranks * unit


def quant_group(in_features: int, fmt: str) -> int:
    """The input-dim group of dgemma's int8/int4 layout for a weight `in_features` wide (quant.py)."""
    return GROUP_SIZE[fmt] if in_features % GROUP_SIZE[fmt] == 0 else in_features


def check_split(config: ModelConfig, ranks: int, quantization: str | None = None, device: str = "cpu"):
    """SplitError naming the first constraint `ranks` breaks; reads nothing but the config.

    quantization: the int8/int4 layout the weights are stored in or will be quantised to: a row-split
    weight (o_proj, the dense down_proj) splits along its input dim, which must fall on group bounds so
    that every rank's groups are the groups of one process."""
    if ranks < 1:
        raise SplitError(f"--tensor-parallel must be >= 1, got {ranks}")
    if device.startswith("cuda") and ranks > torch.cuda.device_count():
        raise SplitError(f"--tensor-parallel {ranks} needs {ranks} GPUs, torch sees {torch.cuda.device_count()}")
    if ranks == 1:
        return
    c = config
    needs = [(c.num_heads, "attention heads (num_attention_heads)"),
             (c.num_experts, "routed experts (num_experts)")]  # the vocabulary is padded (`vocab_rows`)
    for count, what in needs:
        if count % ranks:
            raise SplitError(f"--tensor-parallel {ranks} does not divide the {count} {what}")
    for kv, what in ((c.num_kv_heads, "sliding"), (c.num_global_kv_heads, "full")):
        if kv % ranks and ranks % kv:
            raise SplitError(f"--tensor-parallel {ranks} neither divides nor is a multiple of the {kv} KV heads of "
                             f"the {what} attention layers")
    widths = {c.num_heads * c.head_dim: "o_proj (sliding layers)"}
    if any(not c.is_sliding(i) for i in range(c.num_layers)):
        widths[c.num_heads * c.global_head_dim] = "o_proj (full layers)"
    for width, name in widths.items() if quantization else ():
        group = quant_group(width, quantization)
        if (width // ranks) % group:
            raise SplitError(f"{quantization} weights of {name} ({width} inputs in groups of {group}) cannot split "
                             f"into {ranks} slices on group bounds; use another --tensor-parallel")
    group = quant_group(c.intermediate_size, quantization) if quantization else 1
    if c.intermediate_size // group < ranks:
        how = f" in {quantization} groups of {group}" if quantization else ""
        raise SplitError(f"the dense MLP's {c.intermediate_size} columns{how} cannot split over {ranks} ranks")


def vocab_rows(vocab_size: int, ranks: int) -> int:
    """The embedding rows each rank holds: the vocabulary padded to a multiple of `ranks`, over `ranks`."""
    return -(-vocab_size // ranks)


def parameter_slices(config: ModelConfig, ranks: int, rank: int, quantization: str | None = None) -> dict[str, Slice]:
    """Our dense parameter name -> the slice rank `rank` holds; names not listed are replicated."""
    inner = config.intermediate_size
    rows = vocab_rows(config.vocab_size, ranks)  # the last rank's slice may reach past V (its padding rows)
    out: dict[str, Slice] = {"embed_tokens.weight": Slice(0, rank * rows, (rank + 1) * rows, config.vocab_size)}
    start, stop = mlp_slice(inner, ranks, rank, quantization)
    for i in range(config.num_layers):
        p, d = f"layers.{i}.", config.layer_head_dim(i)
        kv = kv_slice(config.layer_kv_heads(i), ranks, rank, d)
        out[p + "self_attn.q_proj.weight"] = even(0, rank, ranks, config.num_heads * d)
        out[p + "self_attn.k_proj.weight"] = kv
        if config.is_sliding(i):
            out[p + "self_attn.v_proj.weight"] = kv
        out[p + "self_attn.o_proj.weight"] = even(1, rank, ranks, config.num_heads * d)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = Slice(0, start, stop, inner)
        out[p + "mlp.down_proj.weight"] = Slice(1, start, stop, inner)
        out[p + "experts.gate_up_proj"] = out[p + "experts.down_proj"] = even(0, rank, ranks, config.num_experts)
    return out


def stored_slice(name: str, slices: dict[str, Slice]) -> Slice | None:
    """The slice of a stored tensor: a dense weight's own, or that of the weight whose int8/int4 codes or
    scales it holds (`QuantLinear.qweight/.scales`, `QuantExperts.<name>_q/_scales`)."""
    if name in slices:
        return slices[name]
    prefix, leaf = name.rsplit(".", 1)
    if leaf in ("qweight", "scales"):
        return slices.get(prefix + ".weight")
    for base in ("gate_up_proj", "down_proj"):
        if leaf in (f"{base}_q", f"{base}_scales"):
            return slices.get(f"{prefix}.{base}")
    return None


# -- the collectives ----------------------------------------------------------------------------------
@dataclass(eq=False)
class TensorParallel:
    """This rank's place in the split: its process group, rank and the number of ranks."""

    group: dist.ProcessGroup
    rank: int
    ranks: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    # the same ranks again, for compiled graphs and for the thread that compiles them (`use_compile_group`): a
    # server's engine thread keeps stepping eagerly over `group` while every rank's compile thread warms up
    # its compiled step over this one, and collectives of two threads on one group would meet out of order
    compile_group: dist.ProcessGroup | None = None
    # the thread whose call is compiling: the compile group's timeout is COMPILE_TIMEOUT_S until that call ends
    patient: threading.Thread | None = None
    local: threading.local = field(default_factory=threading.local)

    def set_timeout(self, seconds: float):
        from datetime import timedelta

        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), self.compile_group or self.group)

    def use_compile_group(self):
        """From now on this thread's eager collectives go over the compile group too (a compile thread)."""
        self.local.group = self.compile_group

    def _group(self) -> dist.ProcessGroup:
        # is_dynamo_compiling, not is_compiling: the latter is a process-wide flag, True on every thread while
        # one thread compiles, and a server's engine thread steps eagerly meanwhile
        if torch.compiler.is_dynamo_compiling():  # a compiled graph's collectives: always the compile group
            return self.compile_group or self.group
        return getattr(self.local, "group", None) or self.group

    def silent_ranks(self) -> list[tuple[int, float]]:
        """(rank, seconds since its last stamp) of the ranks silent for more than SILENT_AFTER_S; [] when the
        store cannot say (it lived in a rank that is gone)."""
        try:
            store, now, out = dist.distributed_c10d._get_default_store(), time.time(), []
            for rank in range(self.ranks):
                key = f"dgemma/alive/{rank}"
                if rank != self.rank and store.check([key]):
                    silent = now - float(store.get(key))
                    if silent > SILENT_AFTER_S:
                        out.append((rank, silent))
            return out
        except Exception:  # the store's own connection failed: nothing to add
            return []

    def describe_lost(self, error: BaseException) -> str:
        """One line for a failed collective: the ranks that went silent, if any did, and what failed."""
        silent = self.silent_ranks()
        which = ", ".join(f"rank {r} of {self.ranks} silent for {s:.0f} s (hung or stopped)" for r, s in silent)
        return f"{which}: {describe_failure(error)}" if which else describe_failure(error)

    @contextlib.contextmanager
    def compiled_call(self):
        """Around a call of the compiled step: when dynamo compiles in it (`_compiling_started` made the
        group patient), its collectives wait up to COMPILE_TIMEOUT_S for ranks that compile slower; the
        group's own timeout is back once the call is over."""
        try:
            yield
        finally:
            if self.patient is threading.current_thread():
                self.patient = None
                self.set_timeout(self.timeout_s)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():  # traced into the compiled graph (a new tensor, not in place)
            return funcol.all_reduce(t, "sum", self._group())
        dist.all_reduce(t, group=self._group())
        return t

    def all_gather_last(self, t: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Every rank's `t` (..., n) -> (..., N n), concatenated in rank order along the last dim; with `keep`,
        only the first `keep` of those columns (the padded vocabulary's real tokens), in the one copy."""
        if torch.compiler.is_dynamo_compiling():  # traced into the compiled graph: gathered along dim 0, then split
            parts = list(funcol.all_gather_tensor(t.contiguous(), 0, self._group()).chunk(self.ranks))
        else:
            parts = [torch.empty_like(t) for _ in range(self.ranks)]
            dist.all_gather(parts, t.contiguous(), group=self._group())
        if keep is not None:
            n = t.shape[-1]
            parts = [p[..., : max(0, keep - i * n)] for i, p in enumerate(parts)]
        return torch.cat(parts, dim=-1)


class SplitAttention(Attention):
    """This rank's query heads (and their KV heads); o_proj's partial sums all-reduced."""

    tp: TensorParallel

    def attend(self, q, k, v, mask, pack=None):
        return self.tp.all_reduce(super().attend(q, k, v, mask, pack=pack))  # collective: all-reduce of o_proj


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



_JOINED: "weakref.WeakSet[TensorParallel]" = weakref.WeakSet()


def _compiling_started(*_):  # dynamo passes its callback trigger
    """dynamo's compile-start callback: this process's split groups wait for slower compiling ranks."""
    for tp in list(_JOINED):
        if tp.patient is None:
            tp.patient = threading.current_thread()
            tp.set_timeout(COMPILE_TIMEOUT_S)


def join(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """This process's place among the ranks torch.distributed's launcher started (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT in the environment): NCCL on CUDA, gloo on a CPU, every collective bounded by
    `timeout_s` (a rank that died or hangs ends the others' waits with an error instead of a hang)."""
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    tp = TensorParallel(group, dist.get_rank(), dist.get_world_size(), timeout_s,
                        compile_group=dist.new_group(dist.get_process_group_ranks(group),
                                                     timeout=timedelta(seconds=timeout_s)))
    beat = threading.Thread(target=_heartbeat, args=(dist.distributed_c10d._get_default_store(), tp.rank),
                            name="dgemma-rank-heartbeat", daemon=True)
    beat.start()
    atexit.register(_stop_heartbeat, beat)
    if not _JOINED:
        torch._dynamo.callback.callback_handler.register_start_callback(_compiling_started)
    _JOINED.add(tp)
    return tp


_HEARTBEAT_STOP = threading.Event()


def _heartbeat(store, rank: int):
    """This rank's stamp in the store every HEARTBEAT_S, for as long as the process runs (and is not stopped)."""
    key = f"dgemma/alive/{rank}"
    while not _HEARTBEAT_STOP.is_set():
        try:
            store.set(key, repr(time.time()))
        except Exception:  # the store went away with the group: nothing more to stamp
            return
        _HEARTBEAT_STOP.wait(HEARTBEAT_S)


def _stop_heartbeat(beat: threading.Thread):
    """At exit, while torch's C++ objects still stand: the heartbeat ends, so that no stamp is in flight in the
    store's client while the interpreter tears the store and the group down."""
    _HEARTBEAT_STOP.set()
    beat.join(HEARTBEAT_S + 1)


def describe_failure(error: BaseException) -> str:
    """What a failed collective says, in one line, without gloo's source location and advice: 'Connection
    closed by peer [127.0.0.1]:48837'."""
    text = (str(error).splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0] or type(error).__name__


def local_config(config: ModelConfig, ranks: int) -> ModelConfig:
    """The config with this rank's head counts (the same on every rank)."""
    return config.replace(num_heads=config.num_heads // ranks, num_kv_heads=max(1, config.num_kv_heads // ranks),
                          num_global_kv_heads=max(1, config.num_global_kv_heads // ranks))


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


def plan_bytes(config: ModelConfig, ranks: int) -> dict[str, int]:
    """Weight bytes one rank holds, by format: bf16, int8 and int4 (quantised as dgemma quantises: every
    linear and expert tensor but the router and the vision tower, one fp16 scale per group; the embedding
    stays bf16). Rank 0's share, the largest (uneven MLP splits put the extra groups first)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    cost = {"bf16": 2.0, "int8": 1 + 2 / GROUP_SIZE["int8"], "int4": 0.5 + 2 / GROUP_SIZE["int4"]}  # + fp16 scales
    out = {}
    for fmt, per_weight in cost.items():
        slices = parameter_slices(config, ranks, 0, None if fmt == "bf16" else fmt)
        total = 0.0
        for name, p in model.named_parameters():
            n = p.numel() * (slices[name].stop - slices[name].start) // slices[name].size if name in slices \
                else p.numel()
            quantised = p.dim() >= 2 and "router" not in name and not name.startswith(
                ("vision_tower", "embed_vision", "embed_tokens"))
            total += n * per_weight if quantised else 2 * n
        out[fmt] = round(total)
    return out
