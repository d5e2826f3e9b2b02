"""`dgemma bench`: tokens/s of our engine against transformers' generate and AR decoding, side by side.

Prints a table and, as the last line, one JSON object with every figure and the ratios.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from dgemma.commands import _tensor_parallel
from dgemma.config import SAMPLERS, ConfigError
from dgemma.commands._common import (
    UsageError,
    add_compile_arguments,
    add_int8_compute_argument,
    add_revision_argument,
    add_sampler_arguments,
    add_step_cache_arguments,
    apply_int8_compute,
    check_sampler_flags,
    compile_mode,
    plot_file,
    require_extra,
    resolve_device_dtype,
    sampler_overrides,
    step_cache_overrides,
    wants_compile,
)


def add_arguments(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="bench-20m", help="preset with random weights (default bench-20m)")
    p.add_argument("--layers", type=int, default=None,
                   help="--config's first N layers only (its widths and vocabulary kept): a large preset's step and "
                        "its parts in a few GiB, for figures to scale up by depth")
    src.add_argument("--model", help="a model folder or Hugging Face id instead of random weights")
    add_revision_argument(p)
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas in fixed mode (default 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default one canvas)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto (the default): what the generating commands take for this model (see `dgemma "
                        "generate --help`); the table and the JSON say which and why")
    p.add_argument("--transformers-dtype", choices=["same", "fp32", "bf16"], default="same",
                   help="dtype for transformers (default: the same as ours; fp32 is what it loads by default)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    add_int8_compute_argument(p)
    add_compile_arguments(p, by_default=True)
    p.add_argument("--with-eager", action="store_true",
                   help="also time the eager engine (before compiling), beside the same comparisons")
    p.add_argument("--check-tokens", action="store_true",
                   help="after timing, check the engine's tokens against the plain loop (dgemma.generation), "
                        "each row of every batch size alone, one canvas, fixed steps")
    p.add_argument("--no-startup", dest="startup", action="store_false",
                   help="skip the start-up measurement (fresh processes to the first canvas: eager, compiled "
                        "with an empty compile cache, compiled again with the cache it filled)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    p.add_argument("--no-ar", action="store_true", help="skip the autoregressive comparison")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-stopping run")
    add_sampler_arguments(p.add_argument_group(
        "the sampler: several (--sampler entropy-bound,ddim) add the engine with each further one (system "
        "...-SAMPLER) beside the first"), several=True)
    add_step_cache_arguments(p.add_argument_group(
        "the step cache: --step-cache on adds the engine with it (system ...-step-cache) beside the engine"))
    p.add_argument("--glibc-malloc-defaults", dest="keep_freed_memory", action="store_false",
                   help="leave glibc's allocator as it is (by default the process keeps freed memory for "
                        "reuse, as the generating commands do; this changes the eager systems' speed, "
                        "transformers' most)")
    p.add_argument("--plot", type=plot_file, default=None, help="PNG of tokens/s against batch size (needs dgemma[plot])")
    p.add_argument("--seed", type=int, default=0)
    _tensor_parallel.add_arguments(p)  # with it: the engine alone on the split model, and memory per rank


def _batches(args) -> list[int]:
    """--batch's sizes, ascending; UsageError for a bad one or a count below 1."""
    try:
        batches = sorted({int(b) for b in args.batch.split(",")})
    except ValueError:
        raise UsageError(f"--batch takes comma-separated whole numbers, got {args.batch!r}") from None
    if not batches or batches[0] < 1 or args.steps < 1 or args.prompt_len < 1 or args.repeats < 1:
        raise UsageError("--batch, --steps, --prompt-len and --repeats must be >= 1")
    return batches


def _sampling_configs(args, model, new_tokens: int, never: tuple):
    """The timed runs' sampling: a fixed step count, the adaptive stop, the fixed one with the step cache (None
    unless --step-cache on), and the fixed one with each further --sampler ({sampler: config})."""
    samplers = args.sampler or [model.sampling_config.sampler]
    check_sampler_flags(args, samplers)
    try:
        base = model.sampling_config.replace(sampler=samplers[0], **sampler_overrides(args))
        fixed = base.replace(max_new_tokens=new_tokens, max_denoising_steps=args.steps, fixed_steps=True,
                             eos_token_ids=never, seed=args.seed)
        adaptive = base.replace(max_new_tokens=new_tokens, eos_token_ids=never, seed=args.seed)
        cache_settings = step_cache_overrides(args)
        cached = fixed.replace(**cache_settings) if cache_settings["step_cache"] else None
        others = {name: fixed.replace(sampler=name) for name in samplers[1:]}
    except ConfigError as e:  # e.g. DDIM's corrector with the step cache
        raise UsageError(str(e)) from None
    return fixed, adaptive, cached, others


def _transformers_beside(args, model, fixed, dtype, device):
    """transformers' model for its generate's column, or None: --no-transformers, or a first sampler other than
    the entropy bound (its generate samples with that one, so its column would not be the same work)."""
    if args.no_transformers:
        return None
    if fixed.sampler != "entropy-bound":
        print(f"transformers: skipped (its generate samples with the entropy bound, not {fixed.sampler})",
              file=sys.stderr)
        return None
    return _transformers_model(args, model, dtype, device)


def run(args):
    import torch

    from dgemma.benchmarking import timing
    from dgemma.compilation.steps import compile_model, is_compiled
    from dgemma.generation.canvas import positions_needed
    from dgemma.quant import kernels

    batches = _batches(args)
    device, dtype_choice = resolve_device_dtype(args)
    dtype = dtype_choice.dtype
    if args.tensor_parallel is not None:
        from dgemma.commands.bench_split import run_split

        return run_split(args, batches, device, dtype_choice)
    torch.manual_seed(args.seed)
    model, name = _model(args, device, dtype)
    apply_int8_compute(args, model)
    load_before = kernels.load_average()
    c = model.config
    new_tokens = args.new_tokens or c.canvas_length
    never = (c.vocab_size + 1,)  # an EOS id outside the vocabulary: every row runs to new_tokens
    fixed, adaptive, cached, other_samplers = _sampling_configs(args, model, new_tokens, never)
    gen = torch.Generator().manual_seed(args.seed)

    hf = _transformers_beside(args, model, fixed, dtype, device)
    print(f"{name}: {c.param_counts()['total'] / 1e6:,.1f}M parameters, {device}, {str(dtype).replace('torch.', '')}, "
          f"canvas {c.canvas_length}, {new_tokens} new tokens, prompt {args.prompt_len}", file=sys.stderr)
    ran = _what_runs(model, batches[0], load_before, dtype_choice.why)
    for line in _what_runs_lines(ran):
        print("  " + line, file=sys.stderr)

    rows, budgets = [], {}
    prompts_by_batch = {b: torch.randint(3, c.vocab_size, (b, args.prompt_len), generator=gen).tolist()
                        for b in batches}
    need = positions_needed(args.prompt_len, new_tokens, c.canvas_length)
    compiling = bool(wants_compile(args, model))

    def compared(engine_system: str, batch: int, prompts) -> list:
        """Our engine, transformers and AR decoding, timed turn about (see `timing.interleave`)."""
        systems = [timing.EngineTimed(model, prompts, fixed, engine_system)]
        systems += [timing.EngineTimed(model, prompts, sampling, f"{engine_system}-{name}")
                    for name, sampling in other_samplers.items()]
        if cached is not None:
            systems.append(timing.EngineTimed(model, prompts, cached, engine_system + "-step-cache"))
        if hf is not None:
            systems.append(timing.TransformersTimed(hf, prompts, fixed))
        if not args.no_ar:
            systems.append(timing.ARTimed(model, prompts, new_tokens, never))
        timing.interleave(systems, args.repeats)
        return systems

    def check_memory(batch: int, engine_timed, prefix: str = ""):
        # before a run, memory already holds weights, runtime and the allocated KV cache; during generation
        # it may grow by one (B, L, V) fp32 buffer, within 10% of the whole (at most 256 MB). On CUDA that is the GPU's
        # allocated memory (torch.cuda.max_memory_allocated), not the host's resident set.
        budget = budgets.setdefault(batch, timing.memory_budget(model, batch, need))
        budget.update(engine_timed.memory_record(budget["logits_buffer_bytes"], prefix))

    groups = ([("eager", "engine-fixed")] if args.with_eager or not compiling else []) + \
        ([("compiled", "engine-compiled")] if compiling else [])
    for group, engine_system in groups:
        if group == "compiled":  # after every eager run: compiling swaps the model's decoder for good
            compile_model(model, compile_mode(args, model))
        for batch, prompts in prompts_by_batch.items():  # the same prompts in every group
            systems = compared(engine_system, batch, prompts)
            rows += [timed.measurement(group) for timed in systems]
            check_memory(batch, systems[0], "compiled_" if group == "compiled" and len(groups) > 1 else "")
            if not args.no_adaptive and group == groups[-1][0]:
                adaptive_run = timing.EngineTimed(model, prompts, adaptive, "engine-adaptive")
                adaptive_run.run(0)
                rows.append(adaptive_run.measurement(group))
            print(f"  batch {batch} {group} done", file=sys.stderr)
    compiled_ran = compiling and is_compiled(model)
    if compiling and not compiled_ran:  # compiling was unavailable or failed (warned): those runs were eager
        rows, budgets = _as_eager(rows, budgets)
    hf = None  # free transformers' copy of the weights before the token check and start-up runs

    tokens_check = _check_tokens(model, prompts_by_batch, fixed, need) if args.check_tokens else None
    startup = None
    if args.startup:
        print("  start-up: fresh processes to the first canvas (eager; compiled, cold cache; compiled, warm)",
              file=sys.stderr)
        startup = _startup(args, device, dtype, compile_mode(args, model))
    ran["load_average"]["after"] = kernels.load_average()
    _table(rows)
    if startup:
        _startup_table(startup)
    print("what ran: " + "\n          ".join(_what_runs_lines(ran)))
    result = _summary(rows, budgets, name, device, dtype, args, new_tokens, compiled_ran)
    result.update(sampler=fixed.sampler, compile_mode=compile_mode(args, model) if compiling else None,
                  cpu_int8_compute=model.int8_compute_on, what_ran=ran, startup=startup)
    if tokens_check is not None:
        result["tokens_check"] = tokens_check
    if args.plot:
        _plot(rows, args.plot, name, args.steps)
        result["plot"] = args.plot
    print(json.dumps(result))
    return 0


def _what_runs(model, batch: int, load_before, dtype_why: str) -> dict:
    """The kernel of each part at a canvas step and at an AR token (batch `batch`), int8 compute, the dtype and
    why (`dtype_why`), the CPU, threads and the load average: what a figure needs beside it to explain itself."""
    from dgemma.quant import kernels

    canvas_rows = batch * model.config.canvas_length
    out = {"int8_compute": model.int8_compute_on, "dtype": str(model.dtype).replace("torch.", ""),
           "dtype_why": dtype_why, "quantize": getattr(model, "quantization", None),
           f"canvas step ({canvas_rows} rows)": kernels.kernels(model, canvas_rows),
           f"AR token ({batch} row{'s' if batch > 1 else ''})": kernels.kernels(model, batch),
           "load_average": {"before": load_before}}
    if model.device.type == "cpu":
        out["cpu"] = kernels.cpu()
    return out


def _what_runs_lines(ran: dict) -> list[str]:
    lines = [f"int8 compute {'on' if ran['int8_compute'] else 'off'}, {ran['dtype']} ({ran['dtype_why']}), "
             f"weights {ran['quantize'] or 'unquantised'}"]
    if "cpu" in ran:
        cpu = ran["cpu"]
        lines[0] += (f"; {cpu['name'] or 'CPU'} ({', '.join(cpu['flags']) or 'no AVX2'}; torch {cpu['torch_capability']}), "
                     f"{cpu['threads']} threads on {cpu['cores']} cores"
                     + (f" (OpenMP spin {cpu['openmp_spin']})" if cpu.get("openmp_spin", "default") != "default" else ""))
    load = ran["load_average"]
    lines[0] += f"; load average {load['before']}" + (f" -> {load['after']}" if load.get("after") is not None else "")
    for key, parts in ran.items():
        if isinstance(parts, dict) and "head" in parts:
            named = [f"{part} (~{parts['expert_rows']} rows each) {kernel}" if part == "experts" else f"{part} {kernel}"
                     for part, kernel in parts.items() if part != "expert_rows"]
            lines.append(f"{key}: " + "; ".join(named))
    return lines


def _model(args, device, dtype):
    """The model to bench and its name: a folder, or a preset with random weights."""
    import dgemma
    from dgemma.benchmarking.models import preset_model

    if args.model:
        return dgemma.load_model(args.model, device=device, dtype=dtype, quantize=args.quantize), args.model
    try:
        model = preset_model(args.config, layers=args.layers, device=device, dtype=dtype, quantize=args.quantize,
                             seed=args.seed)
    except ValueError as e:  # --layers out of range
        raise UsageError(f"--layers {e}") from None
    layers = "" if args.layers is None else f", first {args.layers} layers"
    return model, f"preset {args.config}{layers} (random weights)"


def _startup(args, device: str, dtype, mode: str) -> dict:
    """Fresh processes to the first canvas: the bench's model, prompt length and steps (`measure_startup`)."""
    from dgemma.benchmarking.startup import measure_startup

    return measure_startup(model=args.model, config=args.config, layers=args.layers, device=device, dtype=dtype,
                           quantize=args.quantize, cpu_int8_compute=args.cpu_int8_compute, mode=mode,
                           steps=args.steps, prompt_len=args.prompt_len, seed=args.seed)


def _transformers_model(args, model, dtype, device):
    """transformers' DiffusionGemma with the same weights (dense ones for a quantised model)."""
    import torch

    from dgemma.benchmarking import timing

    if model.quantization and not args.quantize:
        raise UsageError(f"{args.model} is stored in {model.quantization}, which transformers cannot load: add "
                         f"--no-transformers, or bench the unquantised folder with --quantize")
    require_extra("transformers", "bench", "the transformers comparison (skip it with --no-transformers)")
    if args.quantize:
        print("note: transformers runs unquantised weights" + ("" if args.model else " (dense random ones of the "
              "same shape)"), file=sys.stderr)
    hf_dtype = {"same": dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[args.transformers_dtype]
    with timing.save_for_transformers(_dense_copy(model, args, dtype, device)) as folder:
        return timing.load_transformers(f"{folder}/model", hf_dtype, device)


def _as_eager(rows: list, budgets: dict) -> tuple[list, dict]:
    """When compiling did not happen, the "compiled" runs were eager: keep the eager group if one was timed,
    else relabel the compiled group as eager."""
    eager_timed = any(r.group == "eager" for r in rows)
    rows = [r for r in rows if r.group == "eager"] if eager_timed else \
        [dataclasses.replace(r, group="eager", system="engine-fixed" if r.system == "engine-compiled" else r.system)
         for r in rows]
    budgets = {b: {k.removeprefix("compiled_"): v for k, v in budget.items()
                   if not (eager_timed and k.startswith("compiled_"))} for b, budget in budgets.items()}
    return rows, budgets


def _check_tokens(model, prompts_by_batch: dict, sampling, need: int) -> dict:
    """The engine at each batch size against the plain loop run row by row (the reference), one canvas each,
    the same seeds: exact on a CPU; on a GPU, where batch shapes can change the rounding, the share of
    positions that agree is the figure to read (tests/test_cuda.py states what holds there)."""
    from dgemma.engine import Engine
    from dgemma.generation import generate

    one = sampling.replace(max_new_tokens=model.config.canvas_length)
    out = {}
    for batch, prompts in prompts_by_batch.items():
        seeds = [1000 + i for i in range(batch)]
        engine = Engine(model, max_batch=batch, max_length=need).generate(prompts, one, seeds=seeds)
        same = positions = rows_equal = 0
        for prompt, seed, request in zip(prompts, seeds, engine):
            plain = generate(model, [prompt], one, seed=seed).tokens[0]
            same += sum(a == b for a, b in zip(request.tokens, plain))
            positions += max(len(plain), len(request.tokens))
            rows_equal += request.tokens == plain
        out[str(batch)] = {"rows_equal": rows_equal, "rows": batch, "token_agreement": round(same / positions, 4)}
        print(f"  tokens, batch {batch}: {rows_equal}/{batch} rows equal the plain loop, "
              f"{100 * same / positions:.1f}% of tokens", file=sys.stderr)
    return out


def _dense_copy(model, args, dtype, device):
    """transformers gets the same weights; for a quantised model, the dense original."""
    if not args.quantize:
        return model
    import dgemma

    if args.model:
        return dgemma.load_model(args.model, device="cpu", dtype=dtype)
    from dgemma.weights.random_weights import random_model

    # random codes have no dense original: dense random weights of the same shape and seed
    return random_model(dgemma.get_preset(args.config), dtype=dtype, seed=args.seed)


def _table(rows):
    from rich.console import Console
    from rich.table import Table

    grouped = len({r.group for r in rows}) > 1
    gpu = any(r.gpu_peak_bytes is not None for r in rows)
    t = Table(title="generation speed (best of repeats; systems of one group timed turn about)")
    for col in ("system", "batch", "tokens/s", "ms/step", "TTFC s", "tok/forward", "peak RSS MB") + \
            (("GPU peak MB",) if gpu else ()) + (("group",) if grouped else ()):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(r.system, str(r.batch), f"{r.tokens_per_s:,.0f}",
                  "-" if r.ms_per_step is None else f"{r.ms_per_step:.1f}",
                  "-" if r.ttfc_s is None else f"{r.ttfc_s:.3f}",
                  "-" if r.tokens_per_forward is None else f"{r.tokens_per_forward:.1f}",
                  f"{r.peak_rss_bytes / 2**20:,.0f}",
                  *((f"{(r.gpu_peak_bytes or 0) / 2**20:,.0f}",) if gpu else ()), *((r.group,) if grouped else ()))
    Console(stderr=False, width=130).print(t)


def _summary(rows, budgets, name, device, dtype, args, new_tokens, compiled_ran: bool):
    by = {(r.group, r.system, r.batch): r for r in rows}
    out = {"model": name, "device": device, "dtype": str(dtype).replace("torch.", ""),
           "transformers_dtype": args.transformers_dtype, "steps": args.steps,
           "new_tokens": new_tokens, "prompt_len": args.prompt_len, "quantize": args.quantize,
           "compile": compiled_ran, "repeats": args.repeats, "keep_freed_memory": args.keep_freed_memory,
           "results": [r.__dict__ for r in rows], "memory": {str(b): v for b, v in budgets.items()}}
    # Each ratio compares runs timed turn about. The headline uses our fastest fixed-steps engine
    # (compiled when it ran); the eager engine's ratios are kept beside it.
    groups = {r.group for r in rows}
    engines = [(g, s, "" if g == ("compiled" if "compiled" in groups else "eager") else "_" + g)
               for g, s in (("compiled", "engine-compiled"), ("eager", "engine-fixed")) if g in groups]
    for group, engine, suffix in engines:  # the engine with the step cache against the same engine without
        ratios = {str(b): round(by[(g, s, b)].tokens_per_s / by[(group, engine, b)].tokens_per_s, 3)
                  for (g, s, b) in by if s == engine + "-step-cache" and g == group}
        if ratios:
            out["step_cache_speedup" + suffix] = ratios.get("1", next(iter(ratios.values())))
            out["step_cache_speedup" + suffix + "_by_batch"] = ratios
    for group, engine, suffix in engines:  # each further sampler's engine against the first's
        ratios = {s.removeprefix(engine + "-"): round(by[(g, s, b)].tokens_per_s / by[(group, engine, b)].tokens_per_s, 3)
                  for (g, s, b) in by if g == group and b == min(b for (_, _, b) in by)
                  and s.removeprefix(engine + "-") in SAMPLERS}
        if ratios:
            out["sampler_speed" + suffix] = ratios  # at the smallest batch
    for system, key in (("transformers", "speedup_vs_transformers"), ("ar", "speedup_vs_ar")):
        for group, engine, suffix in engines:
            ratios = {str(b): round(by[(group, engine, b)].tokens_per_s / by[(g, s, b)].tokens_per_s, 3)
                      for (g, s, b) in by if s == system and g == group}
            if ratios:
                out[key + suffix] = ratios.get("1", next(iter(ratios.values())))  # batch 1 when measured
                out[key + suffix + "_by_batch"] = ratios
    return out


def _startup_table(startup: dict):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="start-up: a fresh process to its first canvas (batch 1)")
    for col in ("run", "seconds", "of which building the model", "first canvas (compiling included)", "compiled"):
        t.add_column(col, justify="right", no_wrap=True)
    for run, r in startup.items():
        t.add_row(run, f"{r['seconds']:.1f}", f"{r['build_s']:.1f}", f"{r['first_canvas_s']:.1f}", str(r["compiled"]))
    Console(stderr=False, width=130).print(t)


def _plot(rows, path, name, steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    colours = {}
    for group, system in dict.fromkeys((r.group, r.system) for r in rows):
        pts = sorted((r.batch, r.tokens_per_s) for r in rows if (r.group, r.system) == (group, system))
        again = group == "compiled" and system != "engine-compiled"  # the comparisons, timed again beside it
        colours.setdefault(system, f"C{len(colours)}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="--" if again else "-",
                color=colours[system], label=f"{system} (beside compiled)" if again else system)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{name}\nfixed {steps} steps per canvas (engine-adaptive: the model's stop rule)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
