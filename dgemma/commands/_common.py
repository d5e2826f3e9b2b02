"""What the commands share: the usage error, argument types, and loading a model and its sampler from flags."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

from dgemma.config import ACCEPT_ORDERS, CORRECTOR_SELECTIONS, REFRESH_ORDERS, SAMPLER_SETTINGS, SAMPLERS, SETTLE_ON
from dgemma.config import settings_not_read

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def missing_extra(module: str, extra: str, what: str) -> str | None:
    """The one line saying `what` needs an optional extra that is not installed, or None when `module` imports."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return None
    return f"{what} needs {module}, which the core install leaves out: pip install 'dgemma[{extra}]'"


def require_extra(module: str, extra: str, what: str):
    """UsageError (one line, exit code 2) when an optional extra `what` needs is not installed."""
    message = missing_extra(module, extra, what)
    if message:
        raise UsageError(message)


def plot_file(text: str) -> str:
    """--plot's type: a PNG path, refused before any work when matplotlib (the [plot] extra) is missing."""
    message = missing_extra("matplotlib", "plot", "--plot")
    if message:
        raise argparse.ArgumentTypeError(message)
    return text


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_model_arguments(p, *, required: bool = True, compile_by_default: bool | str = False):
    p.add_argument("--model", required=required,
                   help="a DiffusionGemma model folder (Hugging Face format) or a Hugging Face id (org/name)")
    add_revision_argument(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and activations (default: bf16 where the device multiplies it faster than fp32: "
                        "CUDA, and CPUs with AMX or AVX512_BF16 where a short measurement says so, for models 256 "
                        "or more wide, and int4 models on any AVX-512 CPU; else fp32. The start line says which "
                        "and why)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weight-only quantisation applied while loading")
    add_int8_compute_argument(p)
    add_compile_arguments(p, by_default=compile_by_default)


def add_int8_compute_argument(p):
    p.add_argument("--cpu-int8-compute", choices=["auto", "on", "off"], default="auto",
                   help="quantised models on a CPU: multiply int8 activations by int8 weights (auto, the default: "
                        "where the CPU has int8 dot products, VNNI or AMX; on: any CPU; off: dequantised or int4 "
                        "weights against float activations, as on a GPU)")


def apply_int8_compute(args, model):
    """`--cpu-int8-compute` on a loaded model (before compiling); a bad combination is a usage error."""
    from dgemma.processes import release_freed_memory
    from dgemma.quant import int8_compute, kernels

    try:
        on = int8_compute.enable(model, getattr(args, "cpu_int8_compute", "auto"))
    except ValueError as e:
        raise UsageError(f"--cpu-int8-compute: {e}") from None
    if on:
        release_freed_memory()  # the int4 codes a kernel library took over, handed back to the system
        print("note: " + kernels.start_line(model), file=sys.stderr)
    return model


# `--compile-mode auto`'s choice and its cost, for the help texts (dgemma/compilation/ says why)
COMPILE_MODE_HELP = (
    "auto (default): max-autotune-no-cudagraphs on a CPU (inductor times its kernel choices; a cold compile "
    "costs minutes on 2 cores, a warm one from the on-disk cache far less: `dgemma bench` prints both), "
    "default on CUDA (no autotuning and no CUDA graphs: the cheapest compile; not yet timed on a GPU). "
    "reduce-overhead adds CUDA graphs (a graph and its memory per shape; inductor skips them for graphs "
    "that write their inputs, as the decoder step writes the KV cache); max-autotune times every matmul "
    "shape, which at the 26B shape on a GPU is the slowest compile")


def add_compile_arguments(p, *, by_default: bool | str):
    """--compile / --eager / --compile-mode. `by_default`: True (compiled unless --eager), False (only
    with --compile) or "warm" (with --compile, or when this model's compiled step is in the cache)."""
    g = p.add_mutually_exclusive_group()
    when = {True: "the default here", False: "off by default here",
            "warm": "the default here once the compile cache holds this model's step (a previous compiled run)"}
    g.add_argument("--compile", action="store_true",
                   help=f"torch.compile the denoising step ({when[by_default]}; a one-off compile, kept in "
                        "torch's cache under ~/.cache/dgemma, then faster steps)")
    g.add_argument("--eager", action="store_true",
                   help="never compile (also DGEMMA_EAGER=1); where compiling is unavailable or fails, "
                        "dgemma runs eagerly anyway after one warning line")
    p.add_argument("--compile-mode", choices=("auto",) + _modes(), default="auto", help=COMPILE_MODE_HELP)
    p.set_defaults(compile_by_default=by_default)


def _modes():
    return ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_flags(args):
    """UsageError for compile flags that contradict each other (checked before any other work)."""
    if getattr(args, "deterministic", False) and getattr(args, "compile", False):
        raise UsageError("--deterministic runs eagerly: drop --compile")


def wants_compile(args, model, shape: str | None = None):
    """The flags of `add_compile_arguments` handed to the compile policy (`policy.should_compile`), with
    the shape the command will run (a label: "batch 1, length 256"): a `policy.Choice`, true when it
    compiles, whose `str` says why.
    --deterministic runs eagerly: a compiled step's kernels round otherwise than the eager ones (a server
    answers eagerly until its step has compiled), and autotuning picks them by timings, which vary from one
    process to the next."""
    from dgemma.compilation import policy

    check_compile_flags(args)
    if getattr(args, "deterministic", False):
        return policy.Choice(False, "--deterministic")

    return policy.should_compile(model, compile=getattr(args, "compile", False),
                                      eager=getattr(args, "eager", False),
                                      by_default=getattr(args, "compile_by_default", False),
                                      mode=getattr(args, "compile_mode", "auto"), shape=shape)


def compile_mode(args, model) -> str:
    from dgemma.compilation import policy

    return policy.resolve_mode(getattr(args, "compile_mode", "auto"), model.device)


def maybe_compile(args, model, shape: str | None = None, *, announce: bool = True):
    """`compile_model(model)` when the policy says so (see `wants_compile`; on a split model, rank 0's answer on
    every rank, which compile alike), after a line on stderr that says the choice and why ("step: eager
    (...)"), after the dtype's ("dtype: bf16 (...)", args.dtype_choice, where the command chose it), unless
    `announce` is False; the model either way. The command's start lines: printed once its input is checked."""
    from dgemma.compilation.steps import compile_model

    choice = agree(args, lambda: wants_compile(args, model, shape))
    if announce and getattr(getattr(args, "tp", None), "rank", 0) == 0:
        if getattr(args, "dtype_choice", None) is not None:
            print(f"dtype: {args.dtype_choice}", file=sys.stderr, flush=True)
        cache_on = {"on": True, "off": False}.get(getattr(args, "step_cache", None), model.sampling_config.step_cache)
        packed = "; the step cache's steps eager" if choice and cache_on else ""
        print(f"step: {choice}{packed}", file=sys.stderr, flush=True)
    if choice:
        compile_model(model, compile_mode(args, model), shape=shape)
    return model


def add_revision_argument(p):
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face id given to --model (default: main)")


def add_denoising_arguments(g):
    """The sampler's knobs, each defaulting to the model's generation_config.json (None here)."""
    g.add_argument("--steps", type=positive_int, default=None, help="max denoising steps per canvas")
    g.add_argument("--entropy-bound", type=non_negative_float, default=None,
                   help="entropy (nats) one step may accept in all")
    g.add_argument("--t-min", type=non_negative_float, default=None, help="temperature at the schedule's end")
    g.add_argument("--t-max", type=non_negative_float, default=None, help="temperature at the schedule's start")
    g.add_argument("--accept-order", choices=ACCEPT_ORDERS, default=None,
                   help="which positions a step accepts first: lowest entropy (the reference), widest top-2 "
                        "probability margin, or highest top-1 probability; the bound applies to each")
    add_sampler_arguments(g)
    add_step_cache_arguments(g)


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# the flags of block refinement's and DDIM's settings (the entropy bound's are add_denoising_arguments' own)
OTHER_SAMPLERS_FLAGS = tuple(dict.fromkeys(f for s in SAMPLERS[1:] for f in SAMPLER_SETTINGS[s]))


def sampler_list(text: str) -> list[str]:
    """`dgemma bench --sampler`'s type: one sampler or several, comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SAMPLERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected samplers from {', '.join(SAMPLERS)} (comma-separated), got {text!r}")
    return list(dict.fromkeys(names))


def add_sampler_arguments(g, *, several: bool = False):
    """--sampler and the settings of block refinement and DDIM (dgemma.sampling.samplers); `several`: --sampler
    takes a comma-separated list (`dgemma bench` times each)."""
    what = ("what turns each step's logits into the next canvas: entropy-bound (the model's own), "
            "block-refinement (commit the most confident, an even share of the canvas per step) or ddim "
            "(ancestral steps from the uniform process's exact posterior); --steps is each one's decoder forwards "
            "per canvas (default: the model's generation_config.json, else entropy-bound)")
    if several:
        g.add_argument("--sampler", type=sampler_list, default=None, metavar="NAME[,NAME...]",
                       help=what + "; several are timed side by side, the first as the headline engine")
    else:
        g.add_argument("--sampler", choices=SAMPLERS, default=None, help=what)
    g.add_argument("--temperature", type=non_negative_float, default=None,
                   help="block-refinement and ddim: the temperature their predictions are drawn at (default 0: "
                        "the argmax; the entropy bound anneals --t-max to --t-min instead)")
    g.add_argument("--commit-threshold", type=non_negative_float, default=None,
                   help="block-refinement: also commit every position more confident than this (default 0.95)")
    g.add_argument("--editing-threshold", type=non_negative_float, default=None,
                   help="block-refinement: a committed token the model now predicts otherwise with more confidence "
                        "than this is replaced (default 0: no editing)")
    g.add_argument("--corrector-steps", type=non_negative_int, default=None,
                   help="ddim: Gibbs corrector sweeps after each of the first predictor steps, out of --steps "
                        "(default 0: plain ancestral sampling)")
    g.add_argument("--corrector-k", type=positive_int, default=None,
                   help="ddim: positions one corrector sweep draws again (default 1)")
    g.add_argument("--corrector-selection", choices=CORRECTOR_SELECTIONS, default=None,
                   help="ddim: how a sweep picks its positions, least confident first (default lowest_log_margin)")
    g.add_argument("--corrector-selection-tau", type=positive_float, default=None,
                   help="ddim: temperature of that choice's Gumbel-top-k (default 1; lower is greedier)")


def sampler_overrides(args) -> dict:
    """The settings of `add_sampler_arguments` other than --sampler, as `SamplingConfig.replace` keywords (None
    keeps the model's)."""
    return {k: getattr(args, k, None) for k in OTHER_SAMPLERS_FLAGS}


def check_sampler_flags(args, samplers: str | list[str]):
    """UsageError for a sampler setting given on the command line that none of `samplers` reads."""
    given = {name: getattr(args, name, None) for name in (*SAMPLER_SETTINGS["entropy-bound"], *OTHER_SAMPLERS_FLAGS)}
    problem = settings_not_read(samplers if isinstance(samplers, str) else tuple(samplers), given, as_flags=True)
    if problem:
        raise UsageError(problem)


def probability(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_step_cache_arguments(g):
    """The step cache's flags (dgemma.generation.step_cache), each defaulting to generation_config.json."""
    g.add_argument("--step-cache", choices=["on", "off"], default=None,
                   help="run only the canvas positions that have not settled through the decoder (default: the "
                        "model's setting, off unless its generation_config.json says otherwise)")
    g.add_argument("--settle-steps", type=positive_int, default=None,
                   help="steps a position's argmax must stay the same before it settles (default 2)")
    g.add_argument("--settle-probability", type=probability, default=None,
                   help="the top probability a position needs to settle (default 0.99)")
    g.add_argument("--settle-on", choices=SETTLE_ON, default=None,
                   help="read that probability at the step's temperature (tempered, the default) or the model's own")
    g.add_argument("--cache-refresh", type=non_negative_int, default=None, metavar="R",
                   help="recompute every position every R-th step (default 0: never)")
    g.add_argument("--refresh-share", type=probability, default=None, metavar="P", help="each step also recompute "
                   "the settled positions holding this share of the attention on settled ones (default 0: none)")
    g.add_argument("--refresh-order", choices=REFRESH_ORDERS, default=None, help="which ones --refresh-share "
                   "recomputes: the most attended (the default), or as many random or longest-kept ones")


def step_cache_overrides(args) -> dict:
    """`add_step_cache_arguments`' values as `SamplingConfig.replace` keywords (None keeps the model's)."""
    on = {"on": True, "off": False}.get(args.step_cache)
    return dict(step_cache=on, settle_steps=args.settle_steps, settle_probability=args.settle_probability,
                settle_on=args.settle_on, cache_refresh=args.cache_refresh, refresh_share=args.refresh_share,
                refresh_order=args.refresh_order)


def decoder_positions_text(stats: dict) -> str:
    """A request's "N of M decoder positions (x%)": M is what whole canvases at every step would have run."""
    done, whole = stats["decoder_positions"], stats["whole_canvas_positions"]
    return f"{done:,} of {whole:,} decoder positions ({done / max(whole, 1):.0%})"


def refuse_sampler_flags_with_ar(args):
    """--ar decodes left to right: --step-cache on, --sampler and the samplers' settings are a usage error there."""
    if not getattr(args, "ar", False):
        return
    if args.step_cache == "on":
        raise UsageError("--step-cache works with the diffusion samplers, not with --ar")
    for name in ("sampler", *OTHER_SAMPLERS_FLAGS):
        if getattr(args, name, None) is not None:
            raise UsageError(f"--{name.replace('_', '-')} works with the diffusion samplers, not with --ar")


def denoising_overrides(args) -> dict:
    """`add_denoising_arguments`' values as `SamplingConfig.replace` keywords (None keeps the model's)."""
    return dict(max_denoising_steps=args.steps, entropy_bound=args.entropy_bound, t_min=args.t_min, t_max=args.t_max,
                accept_order=args.accept_order, sampler=args.sampler, **sampler_overrides(args),
                **step_cache_overrides(args))


def sampling_with_overrides(base, args, **more):
    """`base` (a SamplingConfig) with the denoising flags' values and `more` (None keeps base's); a flag the
    chosen sampler does not read, or a combination the config refuses, is a usage error."""
    from dgemma.config import ConfigError

    overrides = {**denoising_overrides(args), **more}
    check_sampler_flags(args, overrides["sampler"] or base.sampler)
    try:
        return base.replace(**overrides)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def add_sampling_arguments(p):
    g = p.add_argument_group("sampling (defaults from the model's generation_config.json)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 2048 (not capped at a canvas)")
    add_denoising_arguments(g)
    g.add_argument("--fixed-steps", action="store_true", help="exactly --steps per canvas, no early stop")
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(model, args):
    return sampling_with_overrides(model.sampling_config, args, max_new_tokens=args.max_new_tokens,
                                   fixed_steps=True if args.fixed_steps else None, seed=args.seed)


def resolve_device_dtype(args):
    """--device and --dtype as a torch device name and a `devices.DtypeChoice` (the dtype and why): no --dtype
    (or auto) asks `devices.default_dtype` for the model run, --model's folder or `dgemma bench`'s --config
    preset (on a split model, rank 0's answer on every rank: a CPU's answer may come from a measurement)."""
    import torch

    from dgemma import devices

    device = devices.resolve_device(args.device)
    if args.dtype not in (None, "auto"):
        return device, devices.DtypeChoice(getattr(torch, DTYPES[args.dtype]), f"--dtype {args.dtype}")
    width, quantize = _model_shape(args)
    return device, agree(args, lambda: devices.default_dtype(device, width, quantize=quantize))


def _model_shape(args) -> tuple[int | None, str | None]:
    """The width and weight format of the model a command runs: --model's config.json (`model_shape`), else
    a --config preset's width (random weights) and --quantize."""
    import dgemma
    from dgemma.weights.checkpoint import model_shape

    model, quantize = getattr(args, "model", None), getattr(args, "quantize", None)
    if model is None and getattr(args, "config", None):
        return dgemma.get_preset(args.config).hidden_size, quantize
    return model_shape(model, quantize)


def load_from_args(args, *, compile: bool = True, shape: str | None = None, announce: bool = True):
    """The model --model names, in the dtype `resolve_device_dtype` chooses (kept as args.dtype_choice);
    compiled per the flags (for `shape`, see `wants_compile`; `announce`: the choices' lines on stderr) unless
    `compile` is False (the caller decides when)."""
    from dgemma.weights.hub import load_model

    device, args.dtype_choice = resolve_device_dtype(args)  # said beside the compile choice (`maybe_compile`)
    dtype = args.dtype_choice.dtype
    if getattr(args, "tp", None) is not None:  # a rank of a split model (--tensor-parallel): its slices
        from dgemma.parallel.load import load_split_model

        model = load_split_model(args.model, args.tp, device=device, dtype=dtype, quantize=args.quantize)
    else:
        model = load_model(args.model, device=device, dtype=dtype, quantize=args.quantize)
    model = apply_int8_compute(args, model)
    return maybe_compile(args, model, shape, announce=announce) if compile else model


def read_prompt(text: str | None) -> str:
    """`-` (or no --prompt with piped input) reads standard input."""
    if text is None or text == "-":
        if text is None and sys.stdin.isatty():
            raise UsageError("give --prompt TEXT, or --prompt - to read standard input")
        text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


@contextlib.contextmanager
def image_usage_errors(what: str = ""):
    """An image the user gave that cannot be used (`dgemma.images.ImageError` inside) is a usage error: one
    line, `what` before the reason, exit code 2."""
    from dgemma.images import ImageError

    try:
        yield
    except ImageError as e:
        raise UsageError(f"{what}{e}") from None


def open_images(paths: list[str]) -> list:
    """Image files (--image, chat's /image) as RGB images; an unusable one is a usage error naming it."""
    from dgemma.images import open_image

    images = []
    for path in paths:
        with image_usage_errors(f"--image {path}: "):
            images.append(open_image(path))
    return images


def with_images(model, folder, prompt: list[int], images: list):
    """The prompt with its image placeholders expanded, and the images' inputs (None without images)."""
    from dgemma.images import ImageProcessor, prompt_with_images

    with image_usage_errors():
        return prompt_with_images(prompt, images, ImageProcessor.from_folder(folder), model.config)


def add_prefix_cache_arguments(p):
    """--prefix-cache-gib and --prefill-chunk (serve, chat, generate)."""
    p.add_argument("--prefix-cache-gib", type=non_negative_float, default=None, metavar="GIB",
                   help="memory for the prefix cache, which keeps encoded prompts and answers so a prompt that "
                        "starts like an earlier one (a chat's next turn, a shared system prompt) encodes only "
                        "the rest (default: a quarter of the free memory, at most 16, the smallest over the ranks "
                        "of a split model; 0 turns it off)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="TOKENS",
                   help="prompt tokens encoded per engine step (default: while other requests are denoising, "
                        "as many as take about one of their steps, measured, so they keep stepping; 8 canvases "
                        "when none is)")
    p.add_argument("--deterministic", action="store_true",
                   help="a request's tokens depend on its prompt and seed alone, not on what the prefix cache "
                        "held, how its prompt was chunked or what else runs: every encoder call reads one "
                        "aligned canvas-long span of a request (a span read in part is read again when its "
                        "request grows), the decoder runs a request at a time, and nothing is compiled; at "
                        "some cost in speed")


def prefix_cache_bytes(args, model, command: str, say: bool = True) -> int:
    """The prefix cache's budget from --prefix-cache-gib, or the library's default
    (`dgemma.engine.prefix_cache.default_budget`), said on stderr when `say`."""
    from dgemma.engine.prefix_cache import default_budget

    if args.prefix_cache_gib is not None:
        return int(args.prefix_cache_gib * 2**30)
    budget = default_budget(model)  # on a split model, a collective: every rank asks
    if say:
        split = getattr(model, "tp", None) is not None
        memory = "a quarter of the free memory" + (", the smallest over the ranks" if split else "")
        print(f"dgemma {command}: prefix cache {budget / 2**30:.1f} GiB ({memory}; "
              f"--prefix-cache-gib to change, 0 turns it off)", file=sys.stderr)
    return budget


def agree(args, make):
    """`make()` run on rank 0 and its value handed to every rank (or `make()` itself without ranks): what
    rank 0 reads or draws. An error `make` raises on rank 0 is raised on every rank."""
    tp = getattr(args, "tp", None)
    if tp is None:
        return make()
    import torch.distributed as dist

    box = [None]
    if tp.rank == 0:
        try:
            box[0] = ("value", make())
        except Exception as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0, group=tp.group)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
