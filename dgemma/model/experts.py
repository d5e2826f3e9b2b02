"""Routed experts: E gated MLPs stored fused, and the ways of running a batch of tokens through them.

Each (token, choice) entry gets its rank among the entries of its expert (a running count, no sort);
with the per-expert counts that places it in any grouped layout. Then one of three ways:
  grouped    -- on CUDA in bf16, torch's grouped GEMM over the tokens in expert order: no padding, no
                host sync;
  batched    -- one batched matmul per projection over a grid padded to the busiest expert's C tokens,
                computed as W[e] @ grid[e].T (E, out, C): on a CPU, ~20% faster than grid @ W.T for these
                short grids, and ~2x faster than E small matmuls;
  per expert -- one matmul per active expert: for a few tokens on a few experts (AR decoding), for routing
                so skewed that the padding costs more than the loop, and when weights must be dequantised
                expert by expert.
A cost model picks between the last two; inside a compiled graph the grid is traced (CPU) or the whole
dispatch is one custom op (CUDA, quantised experts). Compiled training on a CPU (`trace_grid = False`)
leaves the dispatch to the cost model between two graphs instead: its thousands of unevenly routed tokens
would pad the traced grid to the busiest expert (benchmarks/README.md, training steps).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from dgemma.config import ModelConfig
from dgemma.model.layers import gated_gelu


class Experts(nn.Module):
    """E gated MLPs stored fused: gate_up_proj (E, 2I, H), down_proj (E, H, I); see the module docstring
    for how tokens reach them. Subclasses (quantised, LoRA) override `expert_weights` / `project`."""

    batched = True  # False in subclasses whose weights are not plain (E, out, in) tensors
    grouped = True  # False in subclasses that add their own term in `project`
    # Costs in grid rows: the grid pays for every expert's weights (~16 rows each), the loop pays a matmul
    # call, slices and an activation per active expert (~64 rows). Measured once on 2 CPU cores with 16
    # experts 256 wide over hidden 256.
    grid_rows_per_expert, loop_rows_per_expert = 16, 64
    grid_preference = 1.0  # the grid runs while its cost <= this * the loop's (0 forces the loop)
    # Where the grouped GEMM runs: CUDA in bf16. torch's CPU implementation of `_grouped_mm` is slower than
    # the grid there, but exact, so the tests force this path on CPU to check it, forward and backward.
    grouped_devices, grouped_dtypes = ("cuda",), (torch.bfloat16,)
    trace_grid = True  # in a compiled graph on a CPU: the traced grid (True), or `route` run eagerly (False)

    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def expert_weights(self, e: int):
        """(gate_up (2I, H), down (H, I)) for expert e; quantised subclasses dequantise here."""
        return self.gate_up_proj[e], self.down_proj[e]

    def project(self, name: str, columns: torch.Tensor) -> torch.Tensor:
        """All experts at once: weight[e] @ columns[e], (E, in, C) -> (E, out, C); adapters add their term."""
        return torch.bmm(getattr(self, name), columns)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, H), weights/experts (N, k) -> (N, H): the routing-weighted sum of each token's k experts."""
        if not torch.compiler.is_dynamo_compiling():
            outputs = self.route(x, experts)
        elif not self.trace_grid:
            outputs = _eager_route(self, x, experts)  # a graph break: the graphs end and resume around it
        elif self.batched and not x.is_cuda:
            outputs = self._traced_grid(x, experts)
        else:  # data-dependent shapes: one opaque op inside a compiled graph
            outputs = routed_experts(self.op_key, x, experts)
        return (outputs * weights.to(x.dtype)[..., None]).sum(dim=1)

    def _ranks(self, experts: torch.Tensor):
        """experts (N, k) -> per entry (token, choice): its expert (N*k,), its rank among that expert's
        entries (N*k,), and the entries per expert (E,): a running count, no sort."""
        flat_expert = experts.reshape(-1)
        num_experts = self.gate_up_proj.shape[0]
        seen = (flat_expert[:, None] == torch.arange(num_experts, device=experts.device)).cumsum(0)  # (N*k, E)
        return flat_expert, seen.gather(1, flat_expert[:, None])[:, 0] - 1, seen[-1]

    def _traced_grid(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The grid path as graph ops, for a compiled graph on CPU. The capacity is an unbacked size (known
        only when the graph runs), so inductor fuses the grid's scatter, the activation and the gather
        around the two batched matmuls, which the opaque op keeps apart.
        Always the grid, because choosing the loop needs the routing's values while tracing; the capacity is
        rounded up to 8 rows (few distinct buffer sizes; `_round_up` needs the value's bit length, which a
        traced size does not have)."""
        N, k = experts.shape
        flat_expert, rank, counts = self._ranks(experts)
        busiest = counts.max().item()
        torch._check(busiest >= 1)
        capacity = (busiest + 7) // 8 * 8
        return self._batched(x.repeat_interleave(k, dim=0), flat_expert, rank, capacity).view(N, k, -1)

    def prepare_for_compile(self):
        """Called by `dgemma.compilation.steps.compile_model` before tracing: see `register_for_compile`."""
        register_for_compile(self)

    def route(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, H), experts (N, k) -> (N, k, H): expert experts[n, j] applied to token n."""
        N, k = experts.shape
        num_experts = self.gate_up_proj.shape[0]
        flat_expert, rank, counts = self._ranks(experts)
        entries = x.repeat_interleave(k, dim=0)  # (N*k, H) the token of every entry
        # under autocast (bf16 training on a GPU) the products run in autocast's dtype, whatever x's
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        if self.batched and self.grouped and device in self.grouped_devices and dtype in self.grouped_dtypes \
                and hasattr(torch, "_grouped_mm"):
            out = self._in_expert_order(self._grouped, entries, flat_expert, rank, counts, counts, dtype)  # no sync
        else:
            busiest, active = int(counts.max()), int(counts.count_nonzero())
            grid_cost = num_experts * (busiest + self.grid_rows_per_expert)
            if self.batched and grid_cost <= self.grid_preference * (N * k + active * self.loop_rows_per_expert):
                out = self._batched(entries, flat_expert, rank, _round_up(busiest))
            else:
                out = self._in_expert_order(self._per_expert, entries, flat_expert, rank, counts, counts.tolist())
        return out.view(N, k, -1)

    @staticmethod
    def _in_expert_order(run, entries, flat_expert, rank, counts, *args):
        """Run `run(sorted_entries, *args)` on the entries laid out expert by expert, and return its rows
        in entry order again."""
        row = (counts.cumsum(0) - counts)[flat_expert] + rank  # (N*k,) row of each entry when sorted
        ordered = torch.empty_like(entries).index_copy_(0, row, entries)
        return run(ordered, *args)[row]

    def _grouped(self, grouped_x, counts, dtype=None) -> torch.Tensor:
        """grouped_x (N*k, H) sorted by expert -> expert outputs (N*k, H) in `dtype` (default x's: the casts are
        no-ops outside autocast, where x and the weights are in it already); offsets stay on the device."""
        dtype = dtype or grouped_x.dtype
        ends = counts.cumsum(0).to(torch.int32)
        gate_up, down = self.gate_up_proj.to(dtype).transpose(1, 2), self.down_proj.to(dtype).transpose(1, 2)
        hidden = gated_gelu(torch._grouped_mm(grouped_x.to(dtype), gate_up, offs=ends))
        return torch._grouped_mm(hidden, down, offs=ends)

    def _batched(self, entries, flat_expert, rank, capacity: int) -> torch.Tensor:
        """entries (N*k, H) -> expert outputs (N*k, H), via a grid of `capacity` columns per expert."""
        E, H = self.gate_up_proj.shape[0], entries.shape[-1]
        slot = rank + flat_expert * capacity  # (N*k,) cell of each entry in the (E * C, H) grid
        grid = entries.new_zeros(E * capacity, H).index_copy(0, slot, entries)  # zero rows stay zero
        columns = grid.view(E, capacity, H).transpose(1, 2)  # (E, H, C)
        hidden = gated_gelu(self.project("gate_up_proj", columns), dim=1)  # (E, I, C)
        out = self.project("down_proj", hidden)  # (E, H, C)
        return out.transpose(1, 2)[flat_expert, rank]

    def _per_expert(self, grouped_x, counts: list[int]) -> torch.Tensor:
        sorted_out = torch.empty_like(grouped_x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up, down = self.expert_weights(e)
            sorted_out[start : start + n] = F.linear(gated_gelu(F.linear(grouped_x[start : start + n], gate_up)), down)
            start += n
        return sorted_out


# Under torch.compile the routed experts run as one custom op: the grouping's shapes depend on the
# routing, which would otherwise break the graph (or recompile) at every layer. The op finds its
# module through this registry, so quantised and LoRA experts keep their own `route`.
_EXPERTS: "weakref.WeakValueDictionary[int, Experts]" = weakref.WeakValueDictionary()


_eager_route = torch.compiler.disable(Experts.route, reason="routed experts dispatched by the cost model")


def register_for_compile(module: Experts):
    """Give the module the key the custom op finds it by (done before tracing: dynamo cannot trace it)."""
    _EXPERTS[id(module)] = module
    module.op_key = id(module)


@torch.library.custom_op("dgemma::routed_experts", mutates_args=())
def routed_experts(key: int, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return _EXPERTS[key].route(x, experts)


@routed_experts.register_fake
def _(key, x, experts):
    return x.new_empty(x.shape[0], experts.shape[1], x.shape[1])


def _round_up(n: int) -> int:
    """n rounded up to a multiple of a power of two no larger than n / 8 (at most 12.5% more from 64 on,
    8-row steps below): a few grid shapes instead of one per routing outcome, which keeps the CPU
    allocator from fragmenting (measured: a training process grew from 4 to 9 GB with exact sizes)."""
    unit = max(8, 1 << max(0, n.bit_length() - 4))
    return -(-n // unit) * unit
