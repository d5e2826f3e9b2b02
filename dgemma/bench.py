"""Generation speed, measured side by side in one process (ratios, because shared machines are noisy).

For each batch size: our engine with a fixed number of denoising steps per canvas and in adaptive mode,
transformers' `DiffusionGemmaForBlockDiffusion.generate` on the same weights and settings, and
autoregressive decoding of the same weights with a KV cache. Every run generates exactly
`new_tokens` per row (the EOS id is set outside the vocabulary), so tokens/s compare like for like.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from dgemma.config import SamplingConfig


def reset_peak_rss():
    """Linux: make VmHWM (peak resident set) restart from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_bytes(field: str = "VmRSS") -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Measurement:
    system: str  # "engine-fixed" | "engine-adaptive" | "engine-compiled" | "transformers" | "ar"
    batch: int
    tokens_per_s: float
    ms_per_step: float | None  # decoder forward + sampling, per denoising step (whole batch)
    ttfc_s: float | None  # time to first committed canvas (or first token for AR)
    tokens_per_forward: float | None
    peak_rss_bytes: int
    gpu_peak_bytes: int | None = None
    rss_before_bytes: int | None = None  # engine runs: resident memory right before the timed runs


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _gpu_reset(device):
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _gpu_peak(device):
    return torch.cuda.max_memory_allocated() if str(device).startswith("cuda") else None


def bench_engine(model, prompts, sampling: SamplingConfig, repeats: int) -> Measurement:
    from dgemma.engine import Engine

    batch = len(prompts)
    need = len(prompts[0]) + math.ceil(sampling.max_new_tokens / model.config.canvas_length) * model.config.canvas_length
    engine = Engine(model, max_batch=batch, max_length=need, max_queue=batch)
    engine.generate(prompts, sampling.replace(max_new_tokens=model.config.canvas_length), seeds=list(range(batch)))
    times, ttfcs, tpf, steps = [], [], [], []
    _gpu_reset(model.device)
    rss_before = rss_bytes()  # model, cache and runtime in place, warmed up
    reset_peak_rss()
    for r in range(repeats):
        engine.forwards = 0
        _sync(model.device)
        start = time.perf_counter()
        requests = engine.generate(prompts, sampling, seeds=[r * batch + i for i in range(batch)])
        _sync(model.device)
        times.append(time.perf_counter() - start)
        steps.append(engine.forwards)
        ttfcs.append(statistics.mean(q.t_first_canvas - q.t_submit for q in requests))
        tpf.append(statistics.mean(q.stats()["tokens_per_forward"] for q in requests))
    best = min(range(repeats), key=lambda i: times[i])
    generated = batch * sampling.max_new_tokens
    return Measurement(
        system="engine-fixed" if sampling.fixed_steps else "engine-adaptive", batch=batch,
        tokens_per_s=generated / times[best], ms_per_step=1000 * times[best] / max(steps[best], 1),
        ttfc_s=ttfcs[best], tokens_per_forward=tpf[best], peak_rss_bytes=rss_bytes("VmHWM"),
        gpu_peak_bytes=_gpu_peak(model.device), rss_before_bytes=rss_before,
    )


def bench_transformers(folder, prompts, sampling: SamplingConfig, dtype, device, repeats: int) -> Measurement:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        max_new_tokens=sampling.max_new_tokens, max_denoising_steps=sampling.max_denoising_steps,
        t_min=sampling.t_min, t_max=sampling.t_max, stability_threshold=sampling.stability_threshold,
        # a threshold no mean entropy gets under = a fixed number of steps (transformers wants it > 0)
        confidence_threshold=1e-30 if sampling.fixed_steps else sampling.confidence_threshold,
        eos_token_id=list(sampling.eos_token_ids), pad_token_id=sampling.pad_token_id,
    )
    times = []
    _gpu_reset(device)
    reset_peak_rss()
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": hf.config.canvas_length})  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            _sync(device)
            times.append(time.perf_counter() - start)
    steps = sampling.max_denoising_steps * math.ceil(sampling.max_new_tokens / hf.config.canvas_length)
    tpf = float(out.tokens_per_forward.float().mean()) if getattr(out, "tokens_per_forward", None) is not None else None
    del hf
    return Measurement("transformers", len(prompts), len(prompts) * sampling.max_new_tokens / min(times),
                       1000 * min(times) / steps if sampling.fixed_steps else None, None, tpf,
                       rss_bytes("VmHWM"), _gpu_peak(device))


def bench_ar(model, prompts, new_tokens: int, eos, repeats: int) -> Measurement:
    from dgemma.ar import generate_ar

    generate_ar(model, prompts, 8, eos_token_ids=eos)  # warm-up
    times, firsts = [], []
    reset_peak_rss()
    _gpu_reset(model.device)
    for _ in range(repeats):
        _sync(model.device)
        start = time.perf_counter()
        generate_ar(model, prompts, 1, eos_token_ids=eos)
        _sync(model.device)
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate_ar(model, prompts, new_tokens, eos_token_ids=eos)
        _sync(model.device)
        times.append(time.perf_counter() - start)
    return Measurement("ar", len(prompts), len(prompts) * new_tokens / min(times), 1000 * min(times) / new_tokens,
                       min(firsts), 1.0, rss_bytes("VmHWM"), _gpu_peak(model.device))


def save_for_transformers(model) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="dgemma-bench-")
    model.save_pretrained(os.path.join(tmp.name, "model"))
    return tmp


def memory_budget(model, batch: int, max_length: int) -> dict:
    """What one generation may hold beyond the loaded model: the KV cache and one (B, L, V) fp32 buffer.
    (The engine's cache is already allocated when the timed runs start; it is listed for the record.)"""
    cache = model.new_cache(batch, max_length, device="meta")
    kv = cache.nbytes()
    logits = batch * model.config.canvas_length * model.config.vocab_size * 4
    return {"kv_cache_bytes": kv, "logits_buffer_bytes": logits}
