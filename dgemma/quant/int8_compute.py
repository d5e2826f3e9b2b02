"""Int8 compute for quantised models on a CPU: int8 activations x int8 weights, int32 accumulation.

A canvas step multiplies 256 rows by every weight, so it is bound by arithmetic, and a CPU with VNNI does
int8 dot products several times faster than bf16 or fp32 ones (2 cores, a 256 x 2816 x 2112 product:
int8 x int8 ~4-6x the weight-only int4 kernel, ~3.5x bf16: benchmarks/README.md). Every matrix product of
a quantised model then runs as

    x (M, K) float --per row, symmetric--> codes (M, K) int8, scale (M, 1)
    torch._int_mm(codes, weight codes (K, N) int8) -> (M, N) int32, exact
    out = int32 * row scale * weight channel scale (N,)

which needs one scale per output channel of the weight, where the stored formats keep one per group of
32 / 64 inputs (`dgemma.quant.quantize`). So:
  int8 models -- each weight is requantised once, in place, to one scale per channel (the codes keep their
                 bytes; the group scales are all set to the channel's, so the model still reads, saves and
                 dequantises as before): every row count runs in int8;
  int4 models -- where OpenVINO is installed, it takes the routed experts and the large linear layers and
                 holds their only copy (`dgemma.quant.openvino`: its int4 kernels are several times these at
                 a canvas's rows). The rest keep their int4 codes: a weight (a dense layer, one expert) is
                 widened to channel int8 codes when it runs on enough rows to repay that (`widening_pays`),
                 never the whole model at once; otherwise the int4 path runs (torch's int4 kernel, or
                 dequantising);
  the tied embedding table (LM head, self-conditioning soft embedding) -- int8 codes with one scale per
                 token row, beside the table (V x H bytes: 0.74 GB at the 26B shape, 8% of its int4 weights),
                 on CPUs without AMX-BF16 (`table_in_int8`).
Attention itself, norms and the router stay in floating point.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dgemma import devices

MODES = ("auto", "on", "off")
LIBRARIES = ("auto", "openvino", "torch")

# When an int4 weight is widened to int8 for one product: at least this many rows, and a weight of at least
# this many elements. Calibrated with `python benchmarks/int8_compute.py threshold` (2 cores, quiet):
# widening costs ~0.2-0.5 ns a weight in torch's elementwise ops, so on the 26B's expert shapes it overtook
# torch's int4 kernel from 128 rows (1.17x and 1.33x; 64 rows: 0.85x and 1.00x; 16 rows, an expert's share of
# a canvas: 0.33x), and never on bench-20m's small ones (256 x 256 at 256 rows: 0.43x).
MIN_ROWS_TO_WIDEN = 128
MIN_WEIGHTS_TO_WIDEN = 1 << 20
# int32 accumulation stays exact while K * 127 * 127 < 2^31: longer products are summed a block at a time
MAX_EXACT_K = 1 << 17
# The embedding table gets int8 codes (LM head, soft embedding) from this many entries. Measured (2 cores,
# bf16 against int8, 1 / 64 / 256 rows): at 8,192 x 256 the soft embedding ran 0.80-0.92x and the head
# 1.1x at a canvas's rows; at 32,768 x 512 the soft embedding 1.1-2.2x; from 65,536 x 1,024 on both 1.0-3.7x.
MIN_TABLE_ENTRIES = 1 << 24
TABLE_INT8_ON_AMX = False  # on CPUs with AMX-BF16 the table stays bf16 (`table_in_int8`); tests force the codes


def resolve(mode: str, model: nn.Module) -> bool:
    """Whether int8 compute runs for `mode` (auto / on / off) and this model: quantised, on a CPU, and
    (auto) a CPU with int8 dot products. `on` elsewhere is an error: it is the flag that forces the path."""
    if mode not in MODES:
        raise ValueError(f"cpu int8 compute is one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off" or not model.quantization:
        return False
    if model.device.type != "cpu":
        if mode == "on":
            raise ValueError("int8 compute is a CPU path; this model is on " + model.device.type)
        return False
    return mode == "on" or devices.cpu_has_int8_dot()


def quantize_rows(x: torch.Tensor):
    """x (M, K) float -> codes (M, K) int8 in -127..127 and scales (M, 1) fp32, x ≈ codes * scale.
    (The max-norm reads x once without an |x| copy; the codes take one fp32 temporary, rounded in place.)"""
    x = x.float()
    scale = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_(min=1e-30).div_(127.0)
    return torch.div(x, scale).round_().to(torch.int8), scale


def int8_matmul(x: torch.Tensor, weight_t: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, weight codes (K, N) int8 (any strides), channel scales (N,) fp32 -> (..., N) in x's
    dtype: x @ (weight_t * channel_scale), with x quantised per row."""
    K, N = weight_t.shape
    codes, scale = quantize_rows(x.reshape(-1, K))
    if K <= MAX_EXACT_K:
        acc = torch._int_mm(codes, weight_t).float()
    else:
        acc = sum(torch._int_mm(codes[:, a : a + MAX_EXACT_K].contiguous(), weight_t[a : a + MAX_EXACT_K]).float()
                  for a in range(0, K, MAX_EXACT_K))
    return acc.mul_(scale).mul_(channel_scale).to(x.dtype).view(*x.shape[:-1], N)


# -- int8 weights: requantised in place to one scale per channel ---------------------------------------------
@torch.no_grad()
def to_channel_scales(q: torch.Tensor, scales: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """int8 codes (..., N, K) with group scales (..., N, G) -> in place: codes against one scale per row, every
    group scale set to it (stored fp16, codes computed against what is stored). Returns the (..., N) fp32
    channel scales. A chunk of rows at a time: fp32 temporaries of a few MB."""
    K, G = q.shape[-1], scales.shape[-1]
    rows_q, rows_s = q.view(-1, K), scales.view(-1, G)
    for a in range(0, rows_q.shape[0], chunk_rows):
        sq, ss = rows_q[a : a + chunk_rows], rows_s[a : a + chunk_rows]
        w = sq.view(-1, G, K // G).float() * ss.float()[..., None]  # (n, G, K/G) the stored weights
        channel = (w.abs().amax(dim=(1, 2)) / 127).clamp_(min=1e-8).to(torch.float16).float()  # (n,)
        sq.copy_(torch.round(w.view(-1, K) / channel[:, None]).clamp_(-127, 127).to(torch.int8))
        ss.copy_(channel[:, None].expand_as(ss))
    return scales[..., 0].float()


# -- int4 weights: widened to int8 one weight at a time --------------------------------------------------------
class Int4Widener:
    """Channel scales and fixed-point group ratios of an int4 weight, so that a call widens its codes to int8
    against one scale per row: q8 = round(q4 * group scale / channel scale), as ((q4 * R + 128) >> 8) in int16
    with R = round(256 * ratio) (ratio <= 127/8, so q4 * R stays within int16). Kept per weight: the (N,) fp32
    channel scales; the (N, G) int16 ratios are made per widening.

    `kernel`: the codes are in the layout of torch's CPU int4 kernel: (N, K/2) bytes in blocks of 64 rows,
    each block stored (K, 32) with byte [k, j] = rows j (low nibble) and j + 32 (high) of column k, codes
    0..15 standing for -8..7; scales (G, N, 2) (scale, zero 0). Otherwise ours: (N, K/2) with columns 2c, 2c + 1
    in the low / high nibble, scales (N, G)."""

    def __init__(self, scales: torch.Tensor, kernel: bool):
        self.scales, self.kernel = scales, kernel  # the module's own tensor, not a copy
        self.channel_scale = self._group_scales().abs().amax(dim=-1).clamp_(min=1e-8) * (8 / 127)  # (..., N)

    def _group_scales(self, index: int | None = None) -> torch.Tensor:
        scales = self.scales if index is None else self.scales[index]
        return (scales[..., 0].transpose(-1, -2) if self.kernel else scales).float()  # (..., N, G)

    def ratio(self, index: int | None = None) -> torch.Tensor:
        """The group ratios of the weight (of expert `index`), made per widening: N x G values against the
        widening's N x K, where keeping them would hold a quarter of the codes' bytes (1.4 GB for the 26B's
        experts) for products that rarely widen."""
        channel = self.channel(index)
        ratio = torch.round(self._group_scales(index) / channel[..., None] * 256).to(torch.int16)  # (N, G)
        # laid out as the widened codes are: (G, 1, N) for the kernel's layout, (N, G, 1) for ours
        return ratio.t().unsqueeze(-2).contiguous() if self.kernel else ratio.unsqueeze(-1)

    def widen(self, packed: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """Codes (N, K/2) (of expert `index` when the weights are stacked) -> int8 codes as a (K, N) matrix
        against `channel_scale` (a contiguous (K, N) tensor for the kernel layout, a (N, K) one transposed
        for ours)."""
        ratio = self.ratio(index)
        N, half = packed.shape
        K = half * 2
        if self.kernel:
            blocks = packed.view(N // 64, K, 32)
            codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # (N/64, K, 64)
            codes = codes.permute(1, 0, 2).reshape(K, N)
            G = ratio.shape[0]
            q4 = codes.to(torch.int16).sub_(8).view(G, K // G, N)
        else:
            codes = torch.stack([packed & 15, packed >> 4], dim=-1)  # (N, K/2, 2)
            G = ratio.shape[-2]
            q4 = codes.to(torch.int16).sub_(8).view(N, G, K // G)
        q8 = q4.mul_(ratio).add_(128).bitwise_right_shift_(8).to(torch.int8)
        return q8.view(K, N) if self.kernel else q8.view(N, K).t()

    def channel(self, index: int | None = None) -> torch.Tensor:
        return self.channel_scale if index is None else self.channel_scale[index]


# -- the embedding table: LM head and self-conditioning soft embedding ---------------------------------------
class Int8Table:
    """The tied (V, H) table as int8 codes with one scale per token row, beside the table itself."""

    SOFT_SLICE = 1 << 14  # vocabulary entries per slice of the soft embedding (int32 sums stay exact)
    HEAD_SLICE = 1 << 15  # table rows per slice of the LM head
    # A slice of the soft embedding where at most this share of the entries has a nonzero code in some row
    # multiplies only those: the same int32 sums. Probabilities under 1/254 of their row's largest (weighted)
    # one round to code 0, and a canvas's rows share few entries above that: 0.1-20% of the 262k in the 26B's
    # bench steps. 256 x 262,144 x 2,816 on a Zen 4 (`benchmarks/int8_compute.py soft-embedding`): 631 -> 95 ms
    # at 4.5% reached, 643 -> 564 at 63%; reached whole, gathering every entry would double the time
    SPARSE_SHARE = 0.75

    def __init__(self, table: torch.Tensor, chunk_rows: int = 8192):
        V, H = table.shape
        self.codes = torch.empty(V, H, dtype=torch.int8)
        self.scale = torch.empty(V, dtype=torch.float32)
        for a in range(0, V, chunk_rows):
            self.codes[a : a + chunk_rows], s = quantize_rows(table[a : a + chunk_rows])
            self.scale[a : a + chunk_rows] = s[:, 0]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., H) -> (..., V) fp32 = hidden @ table.T, written into `out` ((M, V) fp32) when given.
        A slice of the table at a time, all positions together: the table is read once, and the int32 sums
        are (M, HEAD_SLICE), not (M, V) beside the logits."""
        V, H = self.codes.shape
        codes, scale = quantize_rows(hidden.reshape(-1, H))
        out = torch.empty(codes.shape[0], V) if out is None else out
        for a in range(0, V, self.HEAD_SLICE):
            b = min(a + self.HEAD_SLICE, V)
            out[:, a:b] = torch._int_mm(codes, self.codes[a:b].t()).float().mul_(scale).mul_(self.scale[a:b])
        return out.view(*hidden.shape[:-1], V)

    def soft_embedding(self, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """probs (..., V) -> (..., H) in `dtype` = probs @ table: the row scales move onto the probabilities
        (the product runs along V), which are then quantised per row. A slice of V at a time, so that the
        weighted probabilities, their codes and the int32 sums are a slice's, not (M, V) buffers beside the
        logits: first each row's largest weighted probability, then the codes and products slice by slice,
        each slice's product over the entries some row's code reaches (SPARSE_SHARE)."""
        V, H = self.codes.shape
        flat = probs.reshape(-1, V).float()
        slices = [(a, min(a + self.SOFT_SLICE, V)) for a in range(0, V, self.SOFT_SLICE)]
        row_max = torch.zeros(flat.shape[0], 1)
        for a, b in slices:
            row_max = torch.maximum(row_max, (flat[:, a:b] * self.scale[a:b]).abs_().amax(-1, keepdim=True))
        row_scale = row_max.clamp_(min=1e-30).div_(127.0)  # (M, 1), as quantize_rows makes it
        out = torch.zeros(flat.shape[0], H)
        for a, b in slices:
            codes = (flat[:, a:b] * self.scale[a:b]).div_(row_scale).round_().to(torch.int8)
            # (n,): the entries some row's code reaches (a reduction along the rows runs ~15x faster as amax /
            # amin than as any)
            used = codes.amax(0).ne(0).logical_or_(codes.amin(0).ne(0)).nonzero().squeeze(1)
            if used.numel() > self.SPARSE_SHARE * (b - a):
                out += torch._int_mm(codes, self.codes[a:b])
            elif used.numel():  # the same int32 sums without the zero codes' columns and rows
                out += torch._int_mm(codes.index_select(1, used), self.codes[a:b].index_select(0, used))
        return out.mul_(row_scale).to(dtype).view(*probs.shape[:-1], H)


# -- switching a model over -------------------------------------------------------------------------------
@torch.no_grad()
def enable(model: nn.Module, mode: str = "auto", library: str = "auto") -> bool:
    """Prepare a quantised CPU model for int8 compute (see the module docstring) when `resolve` says so.
    Returns whether it is on. int8 weights are requantised in place: off again needs a fresh load.
    `library`: where the int4 weights' kernels come from (`dgemma.quant.openvino`): "torch"; "openvino" (every
    int4 weight it can take, an error where it is not installed); or "auto": OpenVINO for the parts where it
    is the faster (`openvino.takes`) where it is installed, unless the environment variable
    DGEMMA_CPU_KERNELS names one of the other two. The weights OpenVINO takes are its only copy from then on
    (`kernels.start_line` says which kernel runs each part: the commands print it)."""
    if library not in LIBRARIES:
        raise ValueError(f"int4 weights' kernels are one of {', '.join(LIBRARIES)}, not {library!r}")
    if library == "auto":
        library = os.environ.get("DGEMMA_CPU_KERNELS", "auto")
        if library not in LIBRARIES:
            raise ValueError(f"DGEMMA_CPU_KERNELS is one of {', '.join(LIBRARIES)}, not {library!r}")
    if not resolve(mode, model):
        return False
    if model.int8_compute_on:
        return True
    if library != "torch":
        from dgemma.quant import openvino

        openvino.hand_over(model, required=library == "openvino", everything=library == "openvino",
                           threads=torch.get_num_threads())
    for module in model.modules():  # QuantLinear and QuantExperts (dgemma.quant.quantize) hold `int8`
        if getattr(module, "weights_in_library", False):
            continue
        if hasattr(module, "int8") and hasattr(module, "qweight"):
            module.int8 = _prepare(module, "qweight", "scales")
        elif hasattr(module, "int8"):
            prepared = {name: _prepare(module, f"{name}_q", f"{name}_scales") for name in ("gate_up_proj", "down_proj")}
            module.int8 = None if None in prepared.values() else prepared
    model.int8_table = Int8Table(model.embed_tokens.weight) if table_in_int8(model) else None
    model.int8_compute_on = True
    return True


def table_in_int8(model: nn.Module) -> bool:
    """Whether the tied table gets int8 codes for the LM head and the soft embedding: from MIN_TABLE_ENTRIES
    entries, on CPUs without AMX-BF16. With AMX the bf16 table measured as fast at a canvas's rows on 1 thread
    (65,536 x 2,816, 256 rows: head 1.19x faster, soft embedding 0.86x) and 1.8-2.3x faster on 2 loaded
    threads (benchmarks/README.md), and the codes would cost V x H bytes more (0.69 GiB at the 26B's shape)."""
    big = model.embed_tokens.weight.numel() >= MIN_TABLE_ENTRIES
    return big and (TABLE_INT8_ON_AMX or not devices.cpu_has_amx_bf16())


def _prepare(module: nn.Module, codes_name: str, scales_name: str):
    """An int8 weight -> its channel scales (requantising it in place); an int4 one -> its Int4Widener, or None
    where the int4 kernel's layout is not the one the widener reads (the int4 path then runs)."""
    q, scales = getattr(module, codes_name), getattr(module, scales_name)
    if module.fmt == "int8":
        return to_channel_scales(q, scales)
    if module.kernel_layout and not devices.int4_kernel_layout_known(q.shape[-2]):
        return None
    return Int4Widener(scales, bool(module.kernel_layout))


def widening_pays(rows: int, weights: int) -> bool:
    """Whether widening an int4 weight of `weights` elements to int8 beats the int4 path for `rows` rows."""
    return rows >= MIN_ROWS_TO_WIDEN and weights >= MIN_WEIGHTS_TO_WIDEN


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A QuantLinear's product in int8, or None where its own path is the faster (few rows on int4)."""
    if isinstance(module.int8, torch.Tensor):  # int8 codes against channel scales
        return int8_matmul(x, module.qweight.t(), module.int8)
    if not widening_pays(x.numel() // x.shape[-1], module.qweight.numel() * 2):
        return None
    return int8_matmul(x, module.int8.widen(module.qweight), module.int8.channel())


def experts(module: nn.Module, grouped_x: torch.Tensor, counts: list[int], activation,
            one_expert) -> torch.Tensor | None:
    """A QuantExperts on its entries grouped by expert (rows sorted by expert, counts[e] rows each) -> (N*k, H),
    or None where no expert runs in int8 (int4 weights, none with rows enough to repay widening: the
    module's own path then runs, without the quantisations below).

    The entries are quantised once for all experts, each expert's gate|up product is written into one int32
    buffer, and the activation and the second quantisation run once over all of them: per expert only the two
    integer products. Experts whose int4 weights would not repay their widening run
    `one_expert(e, rows)` (the int4 kernel, or dequantised weights) instead (`widening_pays`)."""
    gate_up, down = module.int8["gate_up_proj"], module.int8["down_proj"]
    channel_codes = isinstance(gate_up, torch.Tensor)
    if not channel_codes and not any(widening_pays(n, module.gate_up_proj_q[0].numel() * 2) for n in counts):
        return None
    codes, scale = quantize_rows(grouped_x)  # (R, H) int8, (R, 1)
    two_i = module.gate_up_proj_q.shape[1]
    acc = torch.zeros(grouped_x.shape[0], two_i, dtype=torch.int32)
    row_scale = torch.zeros(grouped_x.shape[0], two_i)  # each row's channel scales: its expert's
    spans, fallback, start = [], [], 0
    for e, n in enumerate(counts):
        if n and (channel_codes or widening_pays(n, module.gate_up_proj_q[e].numel() * 2)):
            w = module.gate_up_proj_q[e].t() if channel_codes else gate_up.widen(module.gate_up_proj_q[e], e)
            acc[start : start + n] = torch._int_mm(codes[start : start + n], w)
            row_scale[start : start + n] = gate_up[e] if channel_codes else gate_up.channel(e)
            spans.append((e, start, n))
        elif n:
            fallback.append((e, start, n))
        start += n
    hidden = activation(acc.float().mul_(scale).mul_(row_scale)).to(grouped_x.dtype)  # (R, I)
    codes, scale = quantize_rows(hidden)
    acc = torch.zeros(grouped_x.shape[0], grouped_x.shape[1], dtype=torch.int32)
    row_scale = torch.zeros(grouped_x.shape[0], grouped_x.shape[1])
    for e, start, n in spans:
        w = module.down_proj_q[e].t() if channel_codes else down.widen(module.down_proj_q[e], e)
        acc[start : start + n] = torch._int_mm(codes[start : start + n], w)
        row_scale[start : start + n] = down[e] if channel_codes else down.channel(e)
    out = acc.float().mul_(scale).mul_(row_scale).to(grouped_x.dtype)
    for e, start, n in fallback:
        out[start : start + n] = one_expert(e, grouped_x[start : start + n])
    return out
