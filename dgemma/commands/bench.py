"""`dgemma bench`: tokens/s of our engine against transformers' generate and AR decoding, side by side.

Prints a table and, as the last line, one JSON object with every figure and the ratios.
"""

from __future__ import annotations

import json
import sys

from dgemma.commands._common import UsageError, add_revision_argument


def add_arguments(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="bench-20m", help="preset with random weights (default bench-20m)")
    src.add_argument("--model", help="a model folder or Hugging Face id instead of random weights")
    add_revision_argument(p)
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas in fixed mode (default 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default one canvas)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on CUDA and on CPUs with native bf16 matmuls, else fp32")
    p.add_argument("--transformers-dtype", choices=["same", "fp32", "bf16"], default="same",
                   help="dtype for transformers (default: the same as ours; fp32 is what it loads by default)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile our denoising step (compiled in the warm-up)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    p.add_argument("--no-ar", action="store_true", help="skip the autoregressive comparison")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-stopping run")
    p.add_argument("--glibc-malloc-defaults", dest="keep_freed_memory", action="store_false",
                   help="leave glibc's allocator as it is (by default the process keeps freed memory for "
                        "reuse, as the generating commands do; this changes the eager systems' speed, "
                        "transformers' most)")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against batch size")
    p.add_argument("--seed", type=int, default=0)


def _resolve(args):
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    if args.dtype == "auto":
        native_bf16 = device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        dtype = torch.bfloat16 if native_bf16 else torch.float32
    else:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return device, dtype


def run(args):
    import torch

    import dgemma
    from dgemma.commands import bench_timing as timing
    from dgemma.engine import positions_needed

    try:
        batches = sorted({int(b) for b in args.batch.split(",")})
    except ValueError:
        raise UsageError(f"--batch takes comma-separated whole numbers, got {args.batch!r}") from None
    if not batches or batches[0] < 1 or args.steps < 1 or args.prompt_len < 1 or args.repeats < 1:
        raise UsageError("--batch, --steps, --prompt-len and --repeats must be >= 1")
    device, dtype = _resolve(args)
    torch.manual_seed(args.seed)
    if args.model:
        model = dgemma.load_model(args.model, device=device, dtype=dtype, quantize=args.quantize)
        name = args.model
    else:
        from dgemma.model.random_weights import random_model

        # made on the device in the dtype, tensor by tensor (quantised ones directly in int8 / int4)
        model = random_model(dgemma.get_preset(args.config), device=device, dtype=dtype, quantize=args.quantize,
                             seed=args.seed)
        name = f"preset {args.config} (random weights)"
    c = model.config
    new_tokens = args.new_tokens or c.canvas_length
    never = (c.vocab_size + 1,)  # an EOS id outside the vocabulary: every row runs to new_tokens
    fixed = model.sampling_config.replace(max_new_tokens=new_tokens, max_denoising_steps=args.steps,
                                          fixed_steps=True, eos_token_ids=never, seed=args.seed)
    adaptive = model.sampling_config.replace(max_new_tokens=new_tokens, eos_token_ids=never, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    hf = None
    if not args.no_transformers:
        if args.quantize:
            print("note: transformers runs unquantised weights" + ("" if args.model else " (dense random ones of the "
                  "same shape)"), file=sys.stderr)
        hf_dtype = {"same": dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[args.transformers_dtype]
        with timing.save_for_transformers(_dense_copy(model, args, dtype, device)) as folder:
            hf = timing.load_transformers(f"{folder}/model", hf_dtype, device)
    print(f"{name}: {c.param_counts()['total'] / 1e6:,.1f}M parameters, {device}, {str(dtype).replace('torch.', '')}, "
          f"canvas {c.canvas_length}, {new_tokens} new tokens, prompt {args.prompt_len}", file=sys.stderr)

    rows, budgets = [], {}
    prompts_by_batch = {b: torch.randint(3, c.vocab_size, (b, args.prompt_len), generator=gen).tolist()
                        for b in batches}
    need = positions_needed(args.prompt_len, new_tokens, c.canvas_length)

    def compared(engine_system: str, batch: int, prompts) -> list:
        """Our engine, transformers and AR decoding, timed turn about (see `timing.interleave`)."""
        systems = [timing.EngineTimed(model, prompts, fixed, engine_system)]
        if hf is not None:
            systems.append(timing.TransformersTimed(hf, prompts, fixed))
        if not args.no_ar:
            systems.append(timing.ARTimed(model, prompts, new_tokens, never))
        timing.interleave(systems, args.repeats)
        return systems

    for batch, prompts in prompts_by_batch.items():
        systems = compared("engine-fixed", batch, prompts)
        rows += [timed.measurement("eager") for timed in systems]
        engine = rows[-len(systems)]
        budget = timing.memory_budget(model, batch, need)
        # resident memory before a run already holds weights, runtime and the allocated KV cache; during
        # generation it may grow by one (B, L, V) fp32 buffer, within 10% of the whole (at most 256 MB)
        budget["rss_before_bytes"] = engine.rss_before_bytes
        budget["peak_rss_bytes"] = engine.peak_rss_bytes
        budget["within_budget"] = systems[0].within_budget(budget["logits_buffer_bytes"])
        budgets[batch] = budget
        if not args.no_adaptive:
            adaptive_run = timing.EngineTimed(model, prompts, adaptive, "engine-adaptive")
            adaptive_run.run(0)
            rows.append(adaptive_run.measurement("eager"))
        print(f"  batch {batch} done", file=sys.stderr)
    if args.compile:  # after every eager run: compiling swaps the model's decoder for good
        model.compile_decoder()
        for batch, prompts in prompts_by_batch.items():  # the same prompts, and the others timed again
            systems = compared("engine-compiled", batch, prompts)
            rows += [timed.measurement("compiled") for timed in systems]
            budgets[batch]["compiled_peak_rss_bytes"] = rows[-len(systems)].peak_rss_bytes
            budgets[batch]["compiled_within_budget"] = systems[0].within_budget(budgets[batch]["logits_buffer_bytes"])
            print(f"  batch {batch} compiled done", file=sys.stderr)
    del hf

    _table(rows)
    result = _summary(rows, budgets, name, device, dtype, args, new_tokens)
    if args.plot:
        _plot(rows, args.plot, name, args.steps)
        result["plot"] = args.plot
    print(json.dumps(result))
    return 0


def _dense_copy(model, args, dtype, device):
    """transformers gets the same weights; for a quantised model, the dense original."""
    if not args.quantize:
        return model
    import dgemma

    if args.model:
        return dgemma.load_model(args.model, device="cpu", dtype=dtype)
    from dgemma.model.random_weights import random_model

    # random codes have no dense original: dense random weights of the same shape and seed
    return random_model(dgemma.get_preset(args.config), dtype=dtype, seed=args.seed)


def _table(rows):
    from rich.console import Console
    from rich.table import Table

    grouped = len({r.group for r in rows}) > 1
    t = Table(title="generation speed (best of repeats; systems of one group timed turn about)")
    for col in ("system", "batch", "tokens/s", "ms/step", "TTFC s", "tok/forward", "peak RSS MB") + (("group",) if grouped else ()):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(r.system, str(r.batch), f"{r.tokens_per_s:,.0f}",
                  "-" if r.ms_per_step is None else f"{r.ms_per_step:.1f}",
                  "-" if r.ttfc_s is None else f"{r.ttfc_s:.3f}",
                  "-" if r.tokens_per_forward is None else f"{r.tokens_per_forward:.1f}",
                  f"{r.peak_rss_bytes / 2**20:,.0f}", *((r.group,) if grouped else ()))
    Console(stderr=False, width=130).print(t)


def _summary(rows, budgets, name, device, dtype, args, new_tokens):
    by = {(r.group, r.system, r.batch): r for r in rows}
    out = {"model": name, "device": device, "dtype": str(dtype).replace("torch.", ""),
           "transformers_dtype": args.transformers_dtype, "steps": args.steps,
           "new_tokens": new_tokens, "prompt_len": args.prompt_len, "quantize": args.quantize,
           "compile": args.compile, "repeats": args.repeats, "keep_freed_memory": args.keep_freed_memory,
           "results": [r.__dict__ for r in rows], "memory": {str(b): v for b, v in budgets.items()}}
    # Each ratio compares runs timed turn about. The headline uses our fastest fixed-steps engine
    # (compiled when it ran); the eager engine's ratios are kept beside it.
    engines = [("compiled", "engine-compiled", ""), ("eager", "engine-fixed", "_eager")] if args.compile \
        else [("eager", "engine-fixed", "")]
    for system, key in (("transformers", "speedup_vs_transformers"), ("ar", "speedup_vs_ar")):
        for group, engine, suffix in engines:
            ratios = {str(b): round(by[(group, engine, b)].tokens_per_s / by[(g, s, b)].tokens_per_s, 3)
                      for (g, s, b) in by if s == system and g == group}
            if ratios:
                out[key + suffix] = ratios.get("1", next(iter(ratios.values())))  # batch 1 when measured
                out[key + suffix + "_by_batch"] = ratios
    return out


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
