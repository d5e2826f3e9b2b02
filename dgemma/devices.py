"""What this machine's devices can do, asked in one place: the device a run uses, the dtype a model runs in
by default, and the CPU capabilities dgemma's fast paths depend on. Each probe runs once per process
(memoised) and nowhere else in dgemma (tests/test_import_graph.py holds that); tests monkeypatch these
functions to play another machine.

Native bf16 (`native_bf16`) is the one bf16 rule every default follows: a bf16 matmul is at least about as
fast as an fp32 one, so bf16 costs no speed and halves the memory.
  CUDA         torch.cuda.is_bf16_supported(): compute capability 8.0 and later (bf16 tensor cores), and an
               older GPU where torch runs bf16 tensors at all
  CPU, AVX-512 oneDNN's bf16 kernels run (torch.ops.mkldnn._is_mkldnn_bf16_supported(); likewise ARM with
               bf16 instructions): in hardware with AVX512_BF16 or AMX, converted inside oneDNN's kernels
               without. On the 2-core AVX-512 BF16 machine an eager denoising step ran 1.7x fp32's speed
               at 128 wide and 3.8x at 2,048 (benchmarks/README.md)
  CPU, AVX2    not native: a bf16 matmul takes ATen's scalar fallback, measured 42x slower than fp32 at the
               sudoku model's shapes, and a bf16-autocast training step 9x slower
The defaults built on it: a model runs in bf16 where it is native, on a CPU only from CPU_BF16_MIN_HIDDEN
wide (`default_dtype`; the generating commands and the server); `dgemma train --precision auto` and
`dgemma bench --dtype auto` take bf16 wherever it is native.
"""

from __future__ import annotations

import functools
import platform

import torch


class DeviceError(ValueError):
    """A device asked for that this machine does not have (the commands report it in one line)."""


@functools.cache
def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str = "auto") -> str:
    """A --device value as a torch device name: "auto" is "cuda" where torch sees a CUDA device, else "cpu".
    DeviceError for a CUDA device asked for where torch sees none."""
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name.startswith("cuda") and not cuda_available():
        raise DeviceError(f"--device {name} asked for, but torch sees no CUDA device")
    return name


@functools.cache
def _cuda_bf16() -> bool:
    return torch.cuda.is_bf16_supported()


@functools.cache
def _cpu_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_bf16(device) -> bool:
    """Whether `device` (a torch.device or its name) multiplies bf16 natively: see the module docstring."""
    kind = torch.device(device).type
    if kind == "cuda":
        return _cuda_bf16()
    return kind == "cpu" and _cpu_bf16()


# A CPU runs a model in bf16 by default from this width, where it multiplies bf16 natively. Measured on the
# 2-core AVX-512 BF16 machine, an eager denoising step of a 2-layer bench-20m variant (8,192 vocabulary),
# fp32 against bf16: 0.99x at 64 wide, 1.67x at 128, 2.23x at 256, 2.87x at 512, 3.53x at 1,024, 3.83x at
# 2,048 (benchmarks/README.md). Below it, and on CPUs without native bf16, fp32.
CPU_BF16_MIN_HIDDEN = 256


def default_dtype(device, hidden_size: int | None) -> torch.dtype:
    """The dtype a model `hidden_size` wide runs in on `device` when none is asked for: bf16 where the device
    multiplies it natively, on a CPU only from CPU_BF16_MIN_HIDDEN wide (None, a width not known: fp32);
    fp32 elsewhere."""
    if not native_bf16(device):
        return torch.float32
    if torch.device(device).type == "cpu" and (hidden_size is None or hidden_size < CPU_BF16_MIN_HIDDEN):
        return torch.float32
    return torch.bfloat16


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and instruction-set flags, as Linux's /proc/cpuinfo lists them ("", {} elsewhere)."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, flags


@functools.cache
def cpu_has_int8_dot() -> bool:
    """Whether this CPU multiplies int8 natively (x86 with AVX-512 VNNI, AVX-VNNI or AMX-INT8): what makes
    `dgemma.quant.int8_compute` pay."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_info()[1])


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (x86 AMX-BF16): oneDNN's bf16 matmuls run there."""
    return "amx_bf16" in cpu_info()[1]


def available_host_memory() -> int:
    """Bytes of host memory free for new allocations: Linux's MemAvailable (which counts reclaimable page
    cache), elsewhere the free pages. Asked afresh each time: it changes."""
    import os

    return _meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def total_host_memory() -> int:
    """Bytes of host memory in all (Linux's MemTotal, elsewhere the physical pages)."""
    import os

    return _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device) -> int:
    """Bytes free for new tensors on `device` (a torch device or its name): CUDA's free memory on a GPU,
    else the host's available memory (`available_host_memory`). Asked afresh each time."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


@functools.cache
def cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here: "AVX512", "AVX2", "DEFAULT", ..."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def has_cpu_int4_kernel() -> bool:
    """Whether this torch has its CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`, `dgemma.quant.quantize`)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4_kernel_layout_known(rows: int) -> bool:
    """Whether torch's CPU int4 kernel holds a weight of `rows` output rows in the layout dgemma reads
    (`dgemma.quant.int8_compute.Int4Widener`): whole blocks of 64 rows, as torch packs them on an AVX-512 CPU
    (on AVX2 it packs another way)."""
    return rows % 64 == 0 and cpu_capability() == "AVX512"
