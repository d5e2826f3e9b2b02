"""How much memory OpenVINO's copy of int4 weights takes, and so which of them the hand-over gives it
(`dgemma.quant.openvino.hand_over`): its codes and per-group numbers, what glibc keeps of its graphs' calls, and
a step's activations, within MEMORY_SHARE of the machine's memory (benchmarks/README.md has the measurements)."""

from __future__ import annotations

import gc

from torch import nn

from dgemma import processes
from dgemma.quant.formats import GROUP_SIZE

GROUP = GROUP_SIZE["int4"]  # dgemma's int4 groups (32), which the library takes as they are
# What OpenVINO holds besides the codes and two fp32 numbers per group, per fully connected layer (measured:
# ~0.13-0.21 MiB), for `library_bytes`
FC_BYTES = 200 << 10
# What glibc still keeps of an experts graph's canvas call once handed back, as a share of its intermediate
# tensors (`experts_call_bytes`): freed, but fragmented between torch's allocations. Set so that the plan's
# sum matches the 26B's measured peaks in groups of 64 (7.33 GiB predicted against 7.38 measured at 8 layers,
# 20.0 against 20.07 at 30, with an arena per thread): the step's peak over torch's is 80-90 MiB a layer, and
# `library_bytes`' copy term runs high by about the rest (benchmarks/README.md). With `openvino.MALLOC_ARENAS`
# the 26B's step peaks ~0.5 GiB lower (19.55 GiB): the plan keeps that as margin
KEPT_SHARE = 2 / 3
# The hand-over plans the process's memory within this share of the machine's (and what is available):
# on a 24 GB machine, 20 GiB
MEMORY_SHARE = 0.85


def library_bytes(module: nn.Module, group: int, entries: int) -> int:
    """What a module costs once handed over in groups of `group` (measured, benchmarks/README.md): the int4
    codes, two fp32 numbers per group (its scale, converted, and the kernel's transposed copy) and FC_BYTES
    per fully connected layer that OpenVINO holds, and for routed experts what glibc keeps of their canvas
    call of `entries` rows (KEPT_SHARE, `canvas_entries`). A call's intermediate tensors are handed back as it
    returns (`openvino.RELEASE_ROWS`): the step's reserve holds the largest (`reserve_bytes`)."""
    weights = [getattr(module, n) for n in ("gate_up_proj_q", "down_proj_q", "qweight") if hasattr(module, n)]
    elements = sum(2 * q.numel() for q in weights)
    layers = sum(q.shape[0] if q.dim() == 3 else 1 for q in weights)
    kept = 0
    if hasattr(module, "gate_up_proj_q"):
        E, two_i, half_h = module.gate_up_proj_q.shape
        kept = int(KEPT_SHARE * experts_call_bytes(entries, 2 * half_h, two_i // 2))
    return elements // 2 + elements // group * 8 + layers * FC_BYTES + kept


def canvas_entries(config) -> int:
    """The (token, expert) rows a batch-1 canvas routes: what an experts graph's canvas call holds."""
    return config.canvas_length * config.top_k_experts


def experts_call_bytes(entries: int, hidden: int, intermediate: int) -> int:
    """An experts graph's intermediate tensors for `entries` (token, expert) rows: fp32 input, gate|up, their
    product and the output."""
    return entries * (2 * hidden + 3 * intermediate) * 4


def reserve_bytes(config) -> int:
    """What a batch-1 step adds to the weights: its fp32 (L, V) logits and their kin, and the rest (measured
    0.7-0.9 GiB at the 26B's shape, peak against the resident set before the step), and one experts graph's
    intermediate tensors at a canvas."""
    experts_call = experts_call_bytes(canvas_entries(config), config.hidden_size, config.moe_intermediate_size)
    return 3 * config.canvas_length * config.vocab_size * 4 + (256 << 20) + experts_call


def plan(chosen: list, config) -> tuple[int, list, str]:
    """Which of the `chosen` (module, part) pairs the library takes, and the experts' group size, so that the
    process stays within MEMORY_SHARE of the machine's memory and within what is available, with a step's
    activations (`reserve_bytes` of the model's `config`) left free. Every linear layer first (a few percent of
    the weights, as fast a gain as the experts' per layer), then the experts: all of them in dgemma's groups of
    32, else in groups of 64 (the library's per-group numbers halve: ~15% less), as many layers as fit. ([], 32)
    where nothing does. The third value says what bounded the process, in words."""
    from dgemma import devices

    # what a load left behind (transients in Python's reference cycles, heap glibc keeps) is not live: counted, it
    # takes room from the plan, which for the whole 26B has ~0.1 GiB to spare (16.05 -> 15.95 GiB after its build)
    gc.collect()
    processes.release_freed_memory()
    rss, available, total = processes.resident_memory()["rss"], devices.available_host_memory(), \
        devices.total_host_memory()
    ceiling = min(rss + available, int(MEMORY_SHARE * total))
    bound = (f"{ceiling / 2**30:.2f} GiB: " + (f"{MEMORY_SHARE:.0%} of the machine's {total / 2**30:.2f} GiB"
             if ceiling < rss + available else f"{rss / 2**30:.2f} GiB resident and {available / 2**30:.2f} available"))
    room = ceiling - reserve_bytes(config) - rss  # what the hand-over may add
    entries = canvas_entries(config)

    def growth(module, part, group):
        return library_bytes(module, group if part == "experts" else GROUP, entries) - held_bytes([module])

    linears = [(m, p) for m, p in chosen if p == "linears"]
    experts = [(m, p) for m, p in chosen if p == "experts"]
    groups = [GROUP] + ([2 * GROUP] if experts and all(_groups_divide(m, 2 * GROUP) for m, _ in experts) else [])
    for group in groups:
        if sum(growth(m, p, group) for m, p in chosen) <= room:
            return group, chosen, bound
    taken, group = [], groups[-1]
    for module, part in linears + experts:
        cost = growth(module, part, group)
        if cost <= room:
            taken.append((module, part))
            room -= cost
    return group, taken, bound


def _groups_divide(module: nn.Module, group: int) -> bool:
    return all((2 * getattr(module, n).shape[-1]) % group == 0 for n in ("gate_up_proj_q", "down_proj_q"))


def held_bytes(modules) -> int:
    """The int4 codes and scales these modules hold (what the library takes over)."""
    return sum(t.numel() * t.element_size() for m in modules for t in m.buffers(recurse=False))
