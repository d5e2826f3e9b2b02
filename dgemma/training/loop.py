"""`train(TrainConfig)`: the whole training run as one visible loop.

    setup  -> architecture (cheap) -> data (every line checked) -> memory plan (--memory-per-rank)
           -> model on meta -> what learns -> FSDP -> each process reads its own rows -> AdamW
    resume -> latest complete checkpoint: weights, optimizer, RNG, step (= data position)
    loop   -> per step: micro-batches (gradient accumulation) -> clip -> AdamW at lr(step) -> log -> checkpoint
    end    -> OUT/model streamed out of the last checkpoint (Hugging Face format, LoRA merged)

Global batch G = processes x micro-batch x accumulation. Step s reads stream positions s*G .. s*G+G-1
(process r takes its own contiguous slice), so the examples, their noise and the learning rate depend on
(seed, step) alone: 1 or N processes, any micro-batch, killed and resumed or not, see the same numbers.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dgemma import devices
from dgemma.compilation import policy
from dgemma.config import ConfigError
from dgemma.training import distributed as D
from dgemma.training.config import TrainConfig
from dgemma.training.data import ExampleStream, TextEncoder, collate, load_jsonl, read_examples
from dgemma.training.export import export_adapter, export_checkpoint
from dgemma.training.memory import format_bytes, memory_plan, plan_options, plan_summary
from dgemma.training.model_setup import (
    TRAINING_MODE,
    base_dtype,
    compile_for_training,
    configure_trainable,
    resolve_model_config,
    resolve_precision,
)
from dgemma.training.objective import ar_losses, diffusion_losses, draw_noise
from dgemma.training.progress import MetricsLog, Progress, plot_loss
from dgemma.training.state import (
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    remove_partial_writes,
    save_checkpoint,
)
from dgemma.training.weights import materialise, meta_model


@dataclass
class TrainResult:
    steps: int
    final_loss: float  # the last logged (window-mean) loss
    model_dir: Path  # the exported Hugging Face folder
    metrics: list[dict]
    seconds: float
    steps_per_s: float


def learning_rate(step: int, *, peak: float, floor: float, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then a cosine from `peak` down to `floor` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def _optimizer(model, config: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr, betas=tuple(config.betas), eps=1e-8)


def _check_resume(config: TrainConfig, saved: dict, where: Path):
    now = config.as_json()
    changed = [k for k in now if k not in TrainConfig.RESUMABLE_CHANGES and now[k] != saved.get(k)]
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise ConfigError(f"--resume: the run in {where} was started with other settings ({diff})")


def _tokenizer(config: TrainConfig):
    folder = config.tokenizer or config.model
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        if config.tokenizer:
            raise ConfigError(f"{config.tokenizer}: no tokenizer.json")
        return None, None
    from dgemma.tokenizer import Tokenizer, TokenizerError

    try:
        return TextEncoder(Tokenizer.from_folder(folder), config.chat_template), folder
    except TokenizerError as e:
        raise ConfigError(str(e)) from None


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) a training run; every process of a torchrun job calls this."""
    env = D.setup(config.device)
    try:
        return _train(config, env)
    finally:
        D.teardown(env)


def _train(config: TrainConfig, env: D.DistEnv) -> TrainResult:
    config.check(env.world_size)
    out = Path(config.out)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if env.is_main else (lambda *a: None)
    config = _resolved_precision(config, env, say)
    latest, saved = _resume_point(config, out, say)
    model_config, eos_id, dataset, _ = _architecture_and_data(config)
    _check_memory(config, model_config, dataset, env)
    if env.device.type == "cuda" and config.precision == "fp32":
        # fp32 weights and activations, matmuls on the tensor cores in TF32 (10-bit mantissa products,
        # fp32 accumulation): ~8x an H100's fp32 rate, the usual choice for fp32 training on CUDA
        torch.set_float32_matmul_precision("high")
    model, optimizer, trainable = _model_and_optimizer(config, model_config, eos_id, env)
    shape, tokens_per_step = _step_shape(config, env, model_config, dataset)
    stop = config.until or config.steps
    choice = compile_policy(config, env, model, steps=stop - (saved["step"] if saved else 0), shape=shape,
                            tokens_per_step=tokens_per_step)
    compiled = compile_for_training(model, shape) if choice else None
    numerics = ("FSDP bf16 mixed precision" if config.mixed_precision else
                "bf16 autocast" if config.precision == "bf16" else "fp32")
    say(f"training {trainable:,} of {model_config.param_counts()['total']:,} parameters "
        f"({config.objective}{', LoRA' if config.lora else ''}) on {len(dataset):,} examples, "
        f"{env.world_size} process(es) on {env.device.type}, "
        f"{choice if compiled or not choice else 'eager (compiling is unavailable)'}, {numerics}")

    metrics, start_step = _open_run(config, env, out, model, optimizer, latest, saved, say)
    G = config.batch_size
    floor = config.min_lr if config.min_lr is not None else config.lr / 10
    stream = ExampleStream(len(dataset), config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    progress = Progress(stop, start_step, enabled=config.progress and env.is_main)
    # summed over the log window on the device (loss, diffusion, ar, tokens): read at log steps only
    window = torch.zeros(4, dtype=torch.float64, device=env.device)
    window_steps, window_t0, t0 = 0, time.perf_counter(), time.perf_counter()
    last_loss = float("nan")
    try:
        for step in range(start_step, stop):
            lr = learning_rate(step, peak=config.lr, floor=floor, warmup=config.warmup_steps, total=config.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            sums = _accumulate_gradients(config, env, model, dataset, stream, step, model_config, eos_id)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            window += sums
            window_steps += 1
            done = step + 1
            if compiled is not None and done == start_step + 1:
                compiled.succeeded()  # this shape's compiled step is in the cache now (unless compiling failed)
            if done % config.log_every == 0 or done == stop:
                summed = D.all_reduce_sum(window, env).tolist()  # the window's one read
                seconds = time.perf_counter() - window_t0
                record = {
                    "step": done, "loss": summed[0] / (G * window_steps),
                    "diffusion_loss": summed[1] / (G * window_steps),
                    "ar_loss": summed[2] / (G * window_steps), "lr": lr,
                    "grad_norm": D.as_float(grad_norm), "tokens": int(summed[3]),
                    "tokens_per_s": summed[3] / max(seconds, 1e-9), "samples": done * G,
                    "elapsed_s": round(time.perf_counter() - t0, 3),
                }
                last_loss = record["loss"]
                if env.is_main:
                    metrics.append(record)
                    progress.update(record)
                window.zero_()
                window_steps, window_t0 = 0, time.perf_counter()
            else:
                progress.advance(done)
            if done % config.save_every == 0 or done == stop:
                save_started = time.perf_counter()
                trainer_state = {"step": done, "samples_seen": done * G, "config": config.as_json(),
                                 "loss": last_loss}
                save_checkpoint(out, done, env=env, model=model, optimizer=optimizer,
                                trainer_state=trainer_state, lora=config.lora, keep=config.keep_checkpoints)
                if env.is_main:
                    plot_loss(metrics.read(), out / "loss.png", title=f"{config.objective} training loss")
                window_t0 += time.perf_counter() - save_started  # tokens/s counts training time only
    finally:
        progress.close()

    seconds = time.perf_counter() - t0
    records = _export(config, env, out, stop, metrics, say)
    if records:
        last_loss = records[-1]["loss"]
    ran = max(stop - start_step, 0)
    return TrainResult(stop, last_loss, out / "model", records, seconds, ran / max(seconds, 1e-9))


def _open_run(config: TrainConfig, env: D.DistEnv, out: Path, model, optimizer, latest, saved, say):
    """The run's folder made ready: created (what a killed run left half written removed), the checkpoint
    to resume from loaded into the model and optimizer, and the metrics log cut back to it. Returns (the
    metrics log, the first step to run)."""
    if env.is_main and importlib.util.find_spec("matplotlib") is None:
        say("note: matplotlib is not installed, so no loss.png (pip install 'dgemma[plot]')")
    metrics = MetricsLog(out / "metrics.jsonl")
    start_step = 0
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(out)
    if saved is not None:
        load_checkpoint(latest, env=env, model=model, optimizer=optimizer, lora=config.lora)
        start_step = saved["step"]
        say(f"resumed from {latest} (step {start_step})")
    if env.is_main:
        metrics.truncate_after(start_step)  # drop steps logged after the checkpoint by a killed run
    D.barrier(env)
    return metrics, start_step


def _export(config: TrainConfig, env: D.DistEnv, out: Path, stop: int, metrics: MetricsLog, say) -> list[dict]:
    """The run's end: its last checkpoint (the last step always writes one) streamed out as a Hugging Face
    folder, OUT/model, by one process (no gathering), a LoRA run's adapter alone too, the final loss plot.
    Returns the logged records (on the main process; none elsewhere)."""
    if not env.is_main:
        return []
    export_checkpoint(checkpoint_dir(out, stop), out / "model")
    if config.lora:  # the adapter alone too, as PEFT writes it: served by name (dgemma serve --lora)
        export_adapter(checkpoint_dir(out, stop), out / "adapter")
    plot_loss(metrics.read(), out / "loss.png", title=f"{config.objective} training loss")
    say(f"done: {out / 'model'}")
    return metrics.read()


def _resume_point(config: TrainConfig, out: Path, say):
    """(latest checkpoint, its trainer state), or (None, None) for a fresh run; refuses to mix runs."""
    latest = latest_checkpoint(out)
    if latest is not None and not config.resume:
        raise ConfigError(f"{out} already holds checkpoints (latest {latest.name}); "
                          "pass --resume to continue that run, or choose another --out")
    saved = read_trainer_state(latest) if latest is not None else None
    if saved is not None:
        _check_resume(config, saved["config"], out)
    elif config.resume:
        say(f"note: no checkpoint in {out}; starting from step 0")
    return latest, saved


def _resolved_precision(config: TrainConfig, env: D.DistEnv, say) -> TrainConfig:
    """--precision auto -> fp32 or bf16 for this device, `devices.default_dtype`'s answer for training (rank
    0's on every rank: a CPU's may come from a measurement), said in one line; before the resume check, which
    then compares like with like. bf16 asked for where auto takes fp32 runs, after one warning line."""
    auto = D.from_rank0(lambda: devices.default_dtype(env.device, None, training=True), env)
    if config.precision == "auto":
        config = replace(config, precision=resolve_precision(config.precision, auto))
        say(f"precision: {config.precision} (--precision auto: {auto.why})")
    if "bf16" in (config.precision, config.mixed_precision) and auto.dtype != torch.bfloat16:
        say(f"warning: bf16 compute asked for where it is slower than fp32 ({auto.why}); --precision auto "
            "picks fp32 here")
    return config


def _architecture_and_data(config: TrainConfig):
    """The model's config (cheap), then every data line checked, before any weight is loaded.
    Returns (model config, canvas fill id, dataset, tokenizer folder or None)."""
    model_config = resolve_model_config(config.model, config.init, config.model_overrides)
    L, V = model_config.canvas_length, model_config.vocab_size
    eos_id = config.eos_id if config.eos_id is not None else model_config.eos_token_id
    if not 0 <= eos_id < V:
        raise ConfigError(f"eos id {eos_id} is outside the vocabulary 0..{V - 1}")
    max_length = config.max_length or model_config.max_position_embeddings
    if max_length > model_config.max_position_embeddings:
        raise ConfigError(f"--max-length {max_length} exceeds the model's context of "
                          f"{model_config.max_position_embeddings}")
    text, tokenizer_dir = _tokenizer(config)
    dataset = load_jsonl(config.data, vocab_size=V, canvas_length=L, max_length=max_length, text=text,
                         skip_bad_lines=config.skip_bad_lines)
    return model_config, eos_id, dataset, tokenizer_dir


def _check_memory(config: TrainConfig, model_config, dataset, env: D.DistEnv):
    """--memory-per-rank: refuse, before any weight is loaded, a run whose plan does not fit."""
    if config.memory_per_rank is None:
        return
    micro = config.micro_batch_size or config.batch_size // env.world_size
    seq = dataset.longest_row(model_config.canvas_length)
    plan = memory_plan(model_config, **plan_options(config, env.world_size, micro, seq))
    if plan["total"] > config.memory_per_rank:
        raise ConfigError(f"the plan needs {format_bytes(plan['total'])} per process ({plan_summary(plan)}), "
                          f"more than --memory-per-rank {format_bytes(config.memory_per_rank)}; "
                          f"try more processes, --lora, --activation-checkpointing or a smaller --micro-batch-size")


def _model_and_optimizer(config: TrainConfig, model_config, eos_id: int, env: D.DistEnv):
    """Weights, what learns, sharding, AdamW. The model is built on the meta device, adapted and sharded
    before any weight exists; then each process allocates and reads only its own shards, on its device.
    Returns (model, optimizer, the number of trainable parameters)."""
    torch.manual_seed(config.seed)
    model, plan = meta_model(config.model, model_config, eos_id, base_dtype(config))
    lora = (dict(rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                 dropout=config.lora_dropout) if config.lora else None)
    trainable = configure_trainable(model, objective=config.objective, lora=lora, train_router=config.train_router)
    if env.distributed:
        D.shard(model, mixed_precision=config.mixed_precision,
                activation_checkpointing=config.activation_checkpointing)
    elif config.activation_checkpointing:
        for block in model.layers:
            D.checkpoint_block(block)
    materialise(model, device=env.device, model_dir=config.model, plan=plan, seed=config.seed)
    model.train()
    return model, _optimizer(model, config), trainable


def compile_policy(config: TrainConfig, env: D.DistEnv, model, *, steps: int, shape: str,
                   tokens_per_step: int) -> policy.Choice:
    """Whether to compile the blocks, and why (`--eager`, then DGEMMA_EAGER=1, then where compiled training
    is measured, then `--compile`, then whether `steps` pay the compile back: `policy.training_choice`,
    which asks whether this shape is in the compile cache). Measured on one CPU process only, so eager
    elsewhere: on CUDA the routed experts are an opaque op in a graph, with no backward; under FSDP or
    activation checkpointing the regions' interplay with compiling is untested."""
    if not config.compile:
        return policy.Choice(False, "--eager")
    if os.environ.get("DGEMMA_EAGER", "") not in ("", "0"):
        return policy.Choice(False, "DGEMMA_EAGER is set")
    if env.device.type != "cpu" or env.distributed or config.activation_checkpointing:
        return policy.Choice(False, "compiled training is measured on one CPU process only")
    if config.force_compile:
        return policy.Choice(True, "--compile")
    return policy.training_choice(model.config, steps=steps, tokens_per_step=tokens_per_step,
                                       warm=policy.is_warm(model, TRAINING_MODE, shape))


def _step_shape(config: TrainConfig, env: D.DistEnv, model_config, dataset) -> tuple[str, int]:
    """(the label of this run's step shape for the compile cache, the tokens one process steps on)."""
    micro = config.micro_batch_size or config.batch_size // env.world_size
    length = dataset.longest_row(model_config.canvas_length)
    shape = policy.training_shape(objective=config.objective, batch=micro, length=length,
                                       precision=config.mixed_precision or config.precision, lora=config.lora)
    return shape, config.batch_size // env.world_size * length


def _accumulate_gradients(config: TrainConfig, env: D.DistEnv, model, dataset, stream: ExampleStream, step: int,
                          model_config, eos_id: int) -> torch.Tensor:
    """Forward and backward over this process's share of step `step`'s examples, micro-batch by micro-batch.
    Returns the summed (loss, diffusion loss, AR loss, tokens) of the share, float64 on the device (nothing
    is read back here: the loop reads its log window's sums once)."""
    G, W = config.batch_size, env.world_size
    share = G // W
    micro = config.micro_batch_size or share
    L, V = model_config.canvas_length, model_config.vocab_size
    autocast = (torch.autocast(env.device.type, dtype=torch.bfloat16) if config.precision == "bf16" else nullcontext())
    bf16 = config.precision == "bf16" or config.mixed_precision == "bf16"
    cache_dtype = torch.bfloat16 if bf16 else None  # the keys and values the bf16 layers compute
    sums = torch.zeros(4, dtype=torch.float64, device=env.device)
    tokens = 0
    for a in range(share // micro):
        first = step * G + env.rank * share + a * micro
        positions = list(range(first, first + micro))
        examples = read_examples(dataset, stream, positions, augment=config.augment, seed=config.seed)
        batch = collate(examples, positions, canvas_length=L, pad_id=model_config.pad_token_id, eos_id=eos_id)
        noise = None
        if config.objective == "diffusion":
            noise = draw_noise(batch, run_seed=config.seed, canvas_length=L, vocab_size=V,
                               eps=config.noise_eps, self_cond_prob=config.self_cond_prob,
                               cache_aware=config.cache_aware)
        batch = batch.to(env.device)
        D.set_gradient_sync(model, env, a == share // micro - 1)
        with autocast:
            if noise is not None:
                losses = diffusion_losses(model, batch, noise, encoder_loss_weight=config.encoder_loss_weight,
                                          cache_dtype=cache_dtype, lockstep=env.distributed,
                                          cache_aware_settle=config.cache_aware_settle)
            else:
                losses = ar_losses(model, batch, cache_dtype=cache_dtype)
        # FSDP averages gradients over W processes: scale so the result is the mean over G examples
        (losses.total.sum() * (W / G)).backward()
        sums[:3] += torch.stack([losses.total.detach().sum(), losses.diffusion.detach().sum(),
                                 losses.ar.detach().sum()]).double()
        tokens += batch.num_tokens
    sums[3] += tokens
    return sums
