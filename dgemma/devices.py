"""What this machine's devices can do, asked in one place: the device a run uses, the dtype a model runs in
by default, and the CPU capabilities dgemma's fast paths depend on. Each probe runs once per process
(memoised) and nowhere else in dgemma (tests/test_import_graph.py holds that); tests monkeypatch these
functions to play another machine.

The default dtype (`default_dtype`) is one rule, decided here for every caller: generate, chat, serve and
sudoku, `dgemma bench --dtype auto`, `dgemma train --precision auto`; each start line prints it with its
reason ("dtype: bf16 (...)"). A model runs in bf16 where the device multiplies bf16 faster than fp32
(`fast_bf16`), for then bf16 costs no speed and halves the memory; on a CPU only from CPU_BF16_MIN_HIDDEN
wide (a training step, thousands of rows, at any width); fp32 elsewhere. What each class of device gets
(figures: benchmarks/README.md, "bf16 against fp32 per CPU class"):
  CUDA               bf16 where torch.cuda.is_bf16_supported() (compute capability 8.0 and later)
  CPU, AMX-BF16      bf16: the tile unit multiplies bf16 several times faster than fp32 (Intel Sapphire
                     Rapids and later; measured 6.97x at the probe's shape, bench-20m's compiled engine
                     1.56x fp32's tokens/s)
  CPU, AVX512_BF16   measured (AMD Zen 4 and 5, Intel Cooper Lake): oneDNN's AVX512_BF16 kernels ran below
  without AMX        fp32's rate (0.65x at the probe's shape, the engine 0.97x) on the AMX machine capped
                     to them, but at 2.11x on a real Zen 4 (bf16 there; bench-20m's eager engine 1.03-1.44x
                     fp32's tokens/s): why this class's answer is measured, not read from its flags
  CPU, AVX-512       fp32, from the flags alone (Skylake-SP, Cascade Lake, Ice Lake): oneDNN runs bf16
  without bf16       by converting inside its kernels (0.24x at the probe's shape capped to this class,
                     the engine 0.47x; 0.53x on a real AVX-512 VNNI Xeon)
  CPU, AVX2          fp32: oneDNN runs no bf16 (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False) and
                     a bf16 matmul takes ATen's scalar fallback, ~40x slower than fp32
  Arm                bf16 where the CPU lists BF16 and the measurement agrees; fp32 without BF16
An int4 model on an AVX-512 CPU runs bf16 wherever bf16 matmuls are slow or fast: torch's int4 kernel runs
nearly all of its products and takes fp32 activations ~100x slower than bf16 ones.
Where the CPU has bf16 instructions, the answer is a short measurement (`cpu_bf16_per_fp32`, ~0.1-0.3 s
once per CPU, torch and kernel caps, kept in the user's cache folder): it sees what oneDNN will run, which
the flags do not (ONEDNN_MAX_CPU_ISA capping it below AMX, an OS that does not enable AMX), and it runs
only when a command asks, never on an import (`dgemma --help` takes none).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

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


# -- bf16: where it is fast, and the dtype a model runs in by default --------------------------------------
@dataclass(frozen=True)
class Verdict:
    """An answer and its reason in words, for a command's start line (`str`: the reason). True when yes."""

    yes: bool
    why: str

    def __bool__(self) -> bool:
        return self.yes

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why, for a command's start line (`str`: "bf16 (why)")."""

    dtype: torch.dtype
    why: str

    def __str__(self) -> str:
        return f"{DTYPE_NAMES[self.dtype]} ({self.why})"


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.cache
def _cuda_bf16() -> bool:
    return torch.cuda.is_bf16_supported()


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls here at all: on x86 from AVX512_CORE (with bf16 instructions or by
    converting inside its kernels), honouring ONEDNN_MAX_CPU_ISA; on Arm with bf16 instructions."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Instruction sets that multiply bf16 (x86: AVX512_BF16's dot products, AMX's bf16 tiles; Arm: BF16), as
# /proc/cpuinfo names them. An AVX-512 CPU without them runs oneDNN's bf16 kernels too, converting to fp32
# inside them: slower than fp32 (benchmarks/README.md, "bf16 against fp32 per CPU class").
BF16_INSTRUCTIONS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

# The probe: a canvas's rows through one of the 26B's projections, (256, 2,816) x (2,816, 1,408), in fp32 and
# in bf16, turn about, the best of PROBE_REPEATS each, on one thread: with every core, one other busy process
# stalls the kernels' threads and the ratio swung from 0.1x to 3x on a loaded 2-core machine; on one it held
# within a few percent (benchmarks/README.md). ~0.05-0.2 s. bf16 counts as fast from BF16_FAST_RATIO times
# fp32's rate: the classes measured sit far from it on either side (AMX 6.97x; AVX512_BF16 alone 0.65x;
# AVX-512 without bf16 0.24x).
PROBE_SHAPE = (256, 2816, 1408)
PROBE_REPEATS = 3
BF16_FAST_RATIO = 1.0


def _measure_bf16_per_fp32() -> float:
    """This CPU's bf16 matmul rate over its fp32 one on one thread, at PROBE_SHAPE, as oneDNN runs them now."""
    import time

    rows, inner, cols = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)  # uniform draws: a third of normal ones' cost; the rate is the same
    x, w = (torch.empty(shape).uniform_(-1, 1, generator=generator) for shape in ((rows, inner), (inner, cols)))
    operands = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    best = dict.fromkeys(operands, math.inf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for a, b in operands.values():  # oneDNN builds each kernel at its first call
                a @ b
            for _ in range(PROBE_REPEATS):
                for dtype, (a, b) in operands.items():
                    start = time.perf_counter()
                    a @ b
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def user_cache_dir() -> Path:
    """dgemma's folder in the user's cache: $XDG_CACHE_HOME/dgemma, else ~/.cache/dgemma."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma"


def _probe_key() -> str:
    """What the probe's answer depends on: the CPU, torch (its oneDNN) and the caps set on their kernels."""
    caps = ",".join(f"{name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                                 "ATEN_CPU_CAPABILITY") if os.environ.get(name))
    return f"{cpu_info()[0] or platform.machine()} | torch {torch.__version__} | {caps or 'no caps'}"


@functools.cache
def cpu_bf16_per_fp32() -> float:
    """`_measure_bf16_per_fp32`, measured once per CPU, torch and caps: kept in the user's cache folder
    (cpu-bf16.json), so every process on this machine takes the same dtype by default, and so the same tokens
    for a seed. Not written where the folder is not writable."""
    path, key = user_cache_dir() / "cpu-bf16.json", _probe_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), (int, float)):
        return float(known[key])
    ratio = round(_measure_bf16_per_fp32(), 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps({**known, key: ratio}, indent=1) + "\n")
        scratch.replace(path)
    except OSError:
        pass
    return ratio


@functools.cache
def _cpu_fast_bf16() -> Verdict:
    if not onednn_runs_bf16():
        return Verdict(False, "no oneDNN bf16 kernels on this CPU (an x86 one without AVX-512): a bf16 matmul "
                              "takes ATen's fallback, tens of times slower than fp32")
    flags = cpu_info()[1]
    if flags and not BF16_INSTRUCTIONS & flags:
        return Verdict(False, "this CPU has no bf16 instructions (AVX-512 without AVX512_BF16 or AMX): oneDNN "
                              "converts bf16 inside its kernels, slower than fp32")
    ratio = cpu_bf16_per_fp32()
    return Verdict(ratio >= BF16_FAST_RATIO, f"this CPU multiplies bf16 at {ratio:.2f}x fp32's rate, measured "
                                               f"(cached in {user_cache_dir() / 'cpu-bf16.json'})")


def fast_bf16(device) -> Verdict:
    """Whether `device` (a torch.device or its name) multiplies bf16 at least as fast as fp32, and why: the
    one bf16 rule (see the module docstring). A CPU's first answer may take a short measurement."""
    kind = torch.device(device).type
    if kind == "cuda":
        return Verdict(True, "this GPU runs bf16") if _cuda_bf16() else Verdict(False, "this GPU has no bf16")
    if kind == "cpu":
        return _cpu_fast_bf16()
    return Verdict(False, f"no bf16 rule for {kind}")


# A CPU runs a model in bf16 by default from this width, where it multiplies bf16 fast. Measured on the
# 2-core AVX-512 BF16 machine, an eager denoising step of a 2-layer bench-20m variant (8,192 vocabulary),
# fp32 against bf16: 0.99x at 64 wide, 1.67x at 128, 2.23x at 256, 2.87x at 512, 3.53x at 1,024, 3.83x at
# 2,048 (benchmarks/README.md). Below it, fp32.
CPU_BF16_MIN_HIDDEN = 256


def default_dtype(device, hidden_size: int | None, *, quantize: str | None = None,
                  training: bool = False) -> DtypeChoice:
    """The dtype a model `hidden_size` wide runs in on `device` when none is asked for, and why: bf16 where
    the device multiplies it fast (`fast_bf16`), on a CPU for inference only from CPU_BF16_MIN_HIDDEN wide
    (None, a width not known: fp32); fp32 elsewhere. `quantize` "int4" on an AVX-512 CPU: bf16 even where
    bf16 matmuls are slow, for torch's int4 kernel, which runs nearly all of such a model's products, takes
    fp32 activations ~100x slower than bf16 ones (benchmarks/README.md). `training`: the dtype of training's
    compute (autocast), where a step's thousands of rows make bf16 pay at any width."""
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and not training and (hidden_size is None or hidden_size < CPU_BF16_MIN_HIDDEN):
        width = "its width not known here" if hidden_size is None else f"{hidden_size} wide"
        return DtypeChoice(torch.float32, f"a model {width}: on a CPU, bf16 pays from {CPU_BF16_MIN_HIDDEN} wide")
    fast = fast_bf16(device)
    if not fast and on_cpu and quantize == "int4" and onednn_runs_bf16() and has_cpu_int4_kernel():
        return DtypeChoice(torch.bfloat16, f"int4 weights: torch's int4 kernel takes bf16 activations, fp32 ones "
                                           f"~100x slower (an unquantised model runs fp32 here: {fast.why})")
    return DtypeChoice(torch.bfloat16 if fast else torch.float32, fast.why)


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and instruction-set flags, as Linux's /proc/cpuinfo lists them (x86: "flags";
    Arm: "Features"); "", {} elsewhere."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
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
