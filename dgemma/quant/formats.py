"""dgemma's int8 / int4 formats: symmetric, group-wise along the input dim, fp16 scales, two int4 codes a byte.
Quantising a dense tensor into them, dequantising back, and random codes made directly in them. The modules
that hold them are in quantize.py; OpenVINO's copy (openvino.py) reads and requantises them here too.
"""

from __future__ import annotations

import math

import torch

FORMATS = ("int8", "int4")
GROUP_SIZE = {"int8": 64, "int4": 32}  # weights per scale; int4 needs finer groups for the same error


def group_size(in_features: int, fmt: str) -> int:
    """The input-dim group of one scale for a weight `in_features` wide: GROUP_SIZE[fmt] where it divides the
    width, else the whole row (one group per row for odd widths)."""
    return GROUP_SIZE[fmt] if in_features % GROUP_SIZE[fmt] == 0 else in_features


def fits_int4_kernel(in_features: int) -> bool:
    """Whether torch's CPU int4 matmul takes a weight `in_features` wide: whole groups of GROUP_SIZE["int4"]."""
    return in_features % GROUP_SIZE["int4"] == 0


# Quantising works through this many weights at a time, so its fp32 temporaries stay a few tens of MB
# whatever the tensor (a 26B expert tensor is 0.5G weights: whole, the clip search would need ~10 GB).
QUANT_CHUNK_ELEMENTS = 1 << 22

dequantize_calls = 0  # dequantize_tensor calls outside compiled graphs (tests count them per step)


def quantize_tensor(w: torch.Tensor, fmt: str, group: int | None = None):
    """w (..., out, in) -> (q, scales). int8: q int8 (..., out, in); int4: q uint8 (..., out, in/2), two
    nibbles per byte. scales (..., out, in/group) fp16 with w ≈ q * scale per group (2 bytes a group:
    int4 costs 0.5625 bytes a weight with groups of 32). Rows are quantised a chunk at a time. `group`:
    another group size than the format's (`openvino.regroup`), a divisor of the width."""
    *lead, out_f, in_f = w.shape
    group = group or group_size(in_f, fmt)
    rows = w.reshape(-1, in_f)
    q = torch.empty(rows.shape[0], in_f // 2 if fmt == "int4" else in_f,
                    dtype=torch.uint8 if fmt == "int4" else torch.int8, device=w.device)
    scales = torch.empty(rows.shape[0], in_f // group, dtype=torch.float16, device=w.device)
    step = max(1, QUANT_CHUNK_ELEMENTS // in_f)
    for a in range(0, rows.shape[0], step):
        q[a : a + step], scales[a : a + step] = _quantize_rows(rows[a : a + step], fmt, group)
    return q.view(*lead, out_f, q.shape[-1]), scales.view(*lead, out_f, scales.shape[-1])


def _quantize_rows(w: torch.Tensor, fmt: str, group: int):
    """w (n, in) -> q (n, in or in/2), scales (n, in/group) fp16."""
    n, in_f = w.shape
    qmax = 127 if fmt == "int8" else 7
    qmin = -qmax - 1 if fmt == "int4" else -qmax
    groups = w.float().reshape(n, in_f // group, group)
    absmax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # int4 has 16 levels: clipping the largest weights a little lowers the error of all the others.
    # Per group, keep the clip ratio with the least squared error (int8 has enough levels not to need it).
    best_scale = absmax / qmax
    if fmt == "int4":
        best_err = None
        for r in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75):
            scale = absmax * r / qmax
            err = (torch.round(groups / scale).clamp_(qmin, qmax).mul_(scale).sub_(groups)).square_().sum(-1, keepdim=True)
            if best_err is None:
                best_err, best_scale = err, scale
            else:
                better = err < best_err
                best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    best_scale = best_scale.to(torch.float16).float()  # stored as fp16: quantise against what is stored
    q = torch.round(groups / best_scale).clamp_(qmin, qmax).to(torch.int8).reshape(n, in_f)
    if fmt == "int4":
        nibbles = (q + 8).to(torch.uint8)  # 0..15
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return q, best_scale.squeeze(-1).to(torch.float16)


def dequantize_tensor(q: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """(q, scales) of `quantize_tensor` -> weights (..., out, in) in `dtype` (computed in fp32, rounded
    once); into `out` when given."""
    global dequantize_calls
    if not torch.compiler.is_dynamo_compiling():
        dequantize_calls += 1
    if fmt == "int4":
        low = (q & 0x0F).to(torch.int8) - 8
        high = (q >> 4).to(torch.int8) - 8
        q = torch.stack([low, high], dim=-1).flatten(-2)
    *lead, out_f, in_f = q.shape
    groups = scales.shape[-1]
    w = q.reshape(*lead, out_f, groups, in_f // groups).float() * scales.float()[..., None]
    w = w.reshape(*lead, out_f, in_f)
    if out is None:
        return w.to(dtype)
    return out.copy_(w)


def random_quantized(shape: tuple[int, ...], fmt: str, std: float, generator: torch.Generator | None = None,
                     device=None):
    """Random (q, scales) for a (..., out, in) weight, made directly in the quantised format (no dense
    copy): codes uniform over the format's levels, every scale std / (the levels' standard deviation),
    so the dequantised weights have standard deviation ~std. For benchmarks of the full-size model."""
    *lead, out_f, in_f = shape
    group = group_size(in_f, fmt)
    packed = (*lead, out_f, in_f // 2 if fmt == "int4" else in_f)
    n = math.prod(packed)
    # random bytes, 8 at a time (3x faster than drawing bytes: 13 GB of int4 codes take ~1.5 min on 2 cores)
    words = torch.empty(-(-n // 8), dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1, generator=generator)
    q = words.view(torch.uint8)[:n].view(packed)
    if fmt == "int4":
        level_std = (((16**2) - 1) / 12) ** 0.5  # uniform over -8..7
    else:
        q = q.view(torch.int8)
        level_std = (((256**2) - 1) / 12) ** 0.5  # uniform over -128..127
    scales = torch.full((*lead, out_f, in_f // group), std / level_std, dtype=torch.float16, device=device)
    return q, scales
