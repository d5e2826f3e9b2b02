"""bf16 against fp32 on each class of CPU: what `dgemma.devices.default_dtype` decides, and what it costs.

    python benchmarks/bf16_classes.py [--classes machine,avx512_bf16,avx512,avx2] [--repeats 3] [--compile]

Each class runs in a process of its own, this machine's kernels capped to that class: oneDNN through
ONEDNN_MAX_CPU_ISA (AVX512_CORE_BF16: AVX512_BF16 without AMX, as AMD Zen 4 and 5; AVX512_CORE_VNNI: AVX-512
without bf16 instructions, as Skylake-SP, Cascade Lake and Ice Lake; AVX2) and, for AVX2, ATen through
ATEN_CPU_CAPABILITY ("machine": no cap). On an AMX CPU that plays every class down to AVX2; a capped class
runs this CPU's caches, memory and clocks, so a real CPU of that class can differ.

Per class: the probe's bf16/fp32 rate (`devices.cpu_bf16_per_fp32`, measured afresh, not read from the
cache) and the dtype `devices.default_dtype` takes for bench-20m; a (256 x 2,816) x (2,816 x 1,408) matmul's
GFLOP/s in fp32 and bf16 (the process's threads, best of 5); and bench-20m (random weights) in fp32 and in
bf16, side by side in the one process: the engine (batch 1, a 64-token prompt, one 256-token canvas at 16
fixed steps) and AR decoding (256 tokens), all four timed turn about (`dgemma.benchmarking.timing.interleave`), the
fastest of --repeats each. Eager by default; --compile compiles both models' steps first (as `dgemma bench`).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

CLASSES = {
    "machine": {},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
SHAPE = (256, 2816, 1408)


def matmul_gflops(dtype, repeats: int = 5) -> float:
    import torch

    rows, inner, cols = SHAPE
    x, w = torch.rand(rows, inner).to(dtype), torch.rand(inner, cols).to(dtype)
    x @ w  # oneDNN builds its kernel
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - start)
    return 2 * rows * inner * cols / best / 1e9


def child(name: str, repeats: int, compile: bool) -> dict:
    import torch

    import dgemma
    from dgemma import devices
    from dgemma.benchmarking import timing
    from dgemma.compilation.steps import compile_model
    from dgemma.weights.random_weights import random_model

    config = dgemma.get_preset("bench-20m")
    probe = round(devices._measure_bf16_per_fp32(), 2) if devices.onednn_runs_bf16() else None
    choice = devices.default_dtype("cpu", config.hidden_size)
    out = {"class": name, "caps": CLASSES[name], "probe_bf16_per_fp32": probe,
           "default": str(choice.dtype).replace("torch.", ""), "why": choice.why, "threads": torch.get_num_threads(),
           "matmul_gflops": {d: round(matmul_gflops(getattr(torch, d)), 1) for d in ("float32", "bfloat16")}}
    prompts = torch.randint(3, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).tolist()
    never = (config.vocab_size + 1,)
    systems = []
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(config, dtype=dtype, seed=0)
        if compile:
            compile_model(model, "max-autotune-no-cudagraphs")
        sampling = model.sampling_config.replace(max_new_tokens=config.canvas_length, max_denoising_steps=16,
                                                 fixed_steps=True, eos_token_ids=never, seed=0)
        label = str(dtype).replace("torch.", "")
        systems += [timing.EngineTimed(model, prompts, sampling, f"engine {label}"),
                    timing.ARTimed(model, prompts, config.canvas_length, never)]
        systems[-1].system = f"ar {label}"
    timing.interleave(systems, repeats)
    out["tokens_per_s"] = {s.system: round(s.measurement().tokens_per_s, 1) for s in systems}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {', '.join(CLASSES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile both models' steps (as `dgemma bench`)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats, args.compile)))
        return 0
    names = args.classes.split(",")
    if bad := [n for n in names if n not in CLASSES]:
        p.error(f"unknown class {bad[0]!r}; choose from {', '.join(CLASSES)}")
    results = []
    for name in names:
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--repeats", str(args.repeats)]
                              + (["--compile"] if args.compile else []), env={**env, **CLASSES[name]},
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
        results.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]),
                            load_average=[round(load, 2), round(os.getloadavg()[0], 2)]))
        print(f"  {name} done", file=sys.stderr)
    _table(results)
    print(json.dumps({"compile": args.compile, "repeats": args.repeats, "shape": SHAPE, "classes": results}))
    return 0


def _table(results: list[dict]):
    head = ("class", "probe", "default", "matmul fp32", "bf16", "engine fp32", "bf16", "AR fp32", "bf16", "load")
    print(" | ".join(head))
    for r in results:
        t, m = r["tokens_per_s"], r["matmul_gflops"]
        print(" | ".join(str(v) for v in (
            r["class"], r["probe_bf16_per_fp32"], r["default"], m["float32"], m["bfloat16"], t["engine float32"],
            t["engine bfloat16"], t["ar float32"], t["ar bfloat16"], "-".join(map(str, r["load_average"])))))


if __name__ == "__main__":
    sys.exit(main())
