"""Start-up: a fresh process timed from its launch to the first canvas of one batch-1 request, eager and
compiled (`measure_startup`). Each run is `python -c LAUNCH SPEC`: the clock starts before torch and dgemma
are imported, then `first_canvas` builds the model (a folder's, or the preset's random weights as the bench
makes them: models.py), runs one canvas and prints its times as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

# the child's first lines: its clock starts before the imports it times
LAUNCH = ("import sys, time; start = time.perf_counter(); "
          "from dgemma.benchmarking.startup import first_canvas; first_canvas(sys.argv[1], start)")


def first_canvas(spec_json: str, start: float):
    """In the child: build the model `spec_json` describes (see `measure_startup`), compile it if asked, run
    one canvas of a batch-1 request and print {"build_s", "first_canvas_s", "compiled"} as one JSON line."""
    import torch

    import dgemma
    from dgemma.benchmarking.models import preset_model
    from dgemma.compilation.steps import compile_model, is_compiled
    from dgemma.engine import Engine
    from dgemma.generation.canvas import positions_needed
    from dgemma.quant import int8_compute

    a = json.loads(spec_json)
    torch.set_num_threads(a["threads"])
    torch.manual_seed(a["seed"])
    dtype = getattr(torch, a["dtype"])
    if a["model"]:
        model = dgemma.load_model(a["model"], device=a["device"], dtype=dtype, quantize=a["quantize"])
    else:
        model = preset_model(a["config"], layers=a["layers"], device=a["device"], dtype=dtype,
                             quantize=a["quantize"], seed=a["seed"])
    int8_compute.enable(model, a["cpu_int8_compute"])
    built = time.perf_counter()
    if a["compile"]:
        compile_model(model, a["mode"])
    L = model.config.canvas_length
    sampling = model.sampling_config.replace(max_new_tokens=L, max_denoising_steps=a["steps"], fixed_steps=True,
                                             eos_token_ids=(model.config.vocab_size + 1,))
    prompt = torch.randint(3, model.config.vocab_size, (a["prompt_len"],)).tolist()
    engine = Engine(model, max_batch=1, max_length=positions_needed(len(prompt), L, L))
    engine.generate([prompt], sampling, seeds=[0])
    if a["device"].startswith("cuda"):
        torch.cuda.synchronize()
    done = time.perf_counter()
    print(json.dumps({"build_s": built - start, "first_canvas_s": done - built, "compiled": is_compiled(model)}))


def measure_startup(*, model: str | None, config: str, layers: int | None, device: str, dtype, quantize: str | None,
                    cpu_int8_compute: str, mode: str, steps: int, prompt_len: int, seed: int) -> dict:
    """Start-up, each in a fresh process from its launch to its first canvas (batch 1, `prompt_len` prompt
    tokens, `steps` fixed steps): eager; compiled with an empty compile cache (cold: tracing, inductor's code
    generation and C++ or triton compiles); compiled again with the cache the cold run filled (warm). The model:
    the folder `model`, else preset `config` (its first `layers`) with random weights of `seed`."""
    import torch

    spec = dict(threads=torch.get_num_threads(), seed=seed, dtype=str(dtype).replace("torch.", ""), model=model,
                config=config, layers=layers, device=device, quantize=quantize, mode=mode,
                cpu_int8_compute=cpu_int8_compute, steps=steps, prompt_len=prompt_len)
    out = {}
    with tempfile.TemporaryDirectory(prefix="dgemma-compile-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for run, compiled in (("eager", False), ("compiled, cold cache", True), ("compiled, warm cache", True)):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", LAUNCH, json.dumps(dict(spec, compile=compiled))],
                                  capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"start-up run ({run}) failed:\n{proc.stderr[-2000:]}")
            out[run] = dict(json.loads(proc.stdout.strip().splitlines()[-1]), seconds=seconds)
    return out
