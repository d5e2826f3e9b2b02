"""Generation speed, side by side in one process (ratios, because shared machines are noisy): `dgemma bench`'s
timed systems.

For each batch size: our engine with a fixed number of denoising steps per canvas and in adaptive mode,
transformers' `DiffusionGemmaForBlockDiffusion.generate` on the same weights and settings, and
autoregressive decoding of the same weights with a KV cache. Every run generates exactly
`new_tokens` per row (the EOS id is set outside the vocabulary), so tokens/s compare like for like.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from dgemma.config import SamplingConfig
from dgemma.engine.memory import kv_cache, logits_buffer_bytes
from dgemma.generation.canvas import canvases_for, positions_needed
from dgemma.processes import release_freed_memory, resident_memory, restart_peak_rss


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
    rss_before_bytes: int | None = None  # engine runs: the least resident memory any run started with
    group: str = "eager"  # the systems timed turn about with this one ("eager" or "compiled" engine)
    decoder_positions: int | None = None  # engine runs: canvas positions run through the decoder, all rows


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def _sync(device):
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _gpu_reset(device):
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def _gpu_allocated(device):
    return torch.cuda.memory_allocated(device) if _is_cuda(device) else None


def _gpu_peak(device):
    return torch.cuda.max_memory_allocated(device) if _is_cuda(device) else None


class Timed:
    """One system under measurement: warmed up when made, then `run(r)` times one whole generation.

    Systems are timed turn about (`interleave`), so a slow minute of a shared machine slows every
    system of a comparison instead of whichever happened to run then. Resident-memory peaks are taken
    per run (reset just before it, after freed memory went back to the kernel), so they do not mix
    systems either.
    """

    system: str

    def __init__(self, batch: int, device):
        self.batch, self.device = batch, device
        self.runs: list[dict] = []

    def generate(self, r: int) -> dict:
        """Run generation number r; return whatever `measurement` needs beyond wall time."""
        raise NotImplementedError

    def run(self, r: int):
        _gpu_reset(self.device)
        release_freed_memory()
        rss_before = resident_memory()["rss"]
        gpu_before = _gpu_allocated(self.device)
        restart_peak_rss()
        _sync(self.device)
        start = time.perf_counter()
        extra = self.generate(r)
        _sync(self.device)
        self.runs.append(dict(extra, seconds=time.perf_counter() - start, rss_before=rss_before,
                              peak_rss=resident_memory()["peak_rss"], gpu_before=gpu_before, gpu_peak=_gpu_peak(self.device)))

    def fastest(self) -> dict:
        return min(self.runs, key=lambda run: run["seconds"])

    def within_budget(self, extra_bytes: int) -> bool:
        """Every run's peak within what it started with plus `extra_bytes`, plus 10% of that for the runtime's
        own churn but never more than BUDGET_SLACK_CAP (at the 26B shape 10% of the weights would be 1.5 GB,
        which would hide a whole extra logits buffer or a dequantised layer). Measured on the GPU's allocated
        memory on CUDA (where the buffers live), the process's resident memory elsewhere."""
        before, peak = ("gpu_before", "gpu_peak") if _is_cuda(self.device) else ("rss_before", "peak_rss")
        return all(run[peak] <= run[before] + extra_bytes + min(0.1 * (run[before] + extra_bytes), BUDGET_SLACK_CAP)
                   for run in self.runs)

    def memory_record(self, extra_bytes: int, prefix: str = "") -> dict:
        """The memory check's figures for `dgemma bench`'s JSON (keys prefixed for a second engine group)."""
        record = {"rss_before_bytes": min(run["rss_before"] for run in self.runs),
                  "peak_rss_bytes": max(run["peak_rss"] for run in self.runs),
                  "within_budget": self.within_budget(extra_bytes)}
        if _is_cuda(self.device):
            record.update(checked="gpu", gpu_before_bytes=min(run["gpu_before"] for run in self.runs),
                          gpu_peak_bytes=max(run["gpu_peak"] for run in self.runs),
                          gpu_total_bytes=torch.cuda.get_device_properties(torch.device(self.device)).total_memory)
        else:
            record["checked"] = "host rss"
        return {prefix + k: v for k, v in record.items()}


BUDGET_SLACK_CAP = 256 << 20


def interleave(systems: list[Timed], repeats: int):
    """`repeats` rounds, each running every system once; the order flips every round so that no system
    always runs right after the same neighbour."""
    for r in range(repeats):
        for timed in systems if r % 2 == 0 else systems[::-1]:
            timed.run(r)


WARMUP_STEPS = 4


class EngineTimed(Timed):
    def __init__(self, model, prompts, sampling: SamplingConfig, system: str):
        from dgemma.engine import Engine

        super().__init__(len(prompts), model.device)
        self.system, self.prompts, self.sampling = system, prompts, sampling
        L = model.config.canvas_length
        need = positions_needed(len(prompts[0]), sampling.max_new_tokens, L)
        self.engine = Engine(model, max_batch=self.batch, max_length=need, max_queue=self.batch)
        # warm-up: one canvas of a few steps runs every kernel (and compiles) once; more would only cost time,
        # which at the 26B shape on a CPU is ~17 s a step
        warm = sampling.replace(max_new_tokens=L, max_denoising_steps=min(sampling.max_denoising_steps, WARMUP_STEPS))
        self.engine.generate(prompts, warm, seeds=list(range(self.batch)))

    def generate(self, r: int) -> dict:
        self.engine.forwards = 0
        requests = self.engine.generate(self.prompts, self.sampling, seeds=[r * self.batch + i for i in range(self.batch)])
        return {"steps": self.engine.forwards,
                "ttfc": statistics.mean(q.state.t_first_canvas - q.state.t_submit for q in requests),
                "tpf": statistics.mean(q.stats()["tokens_per_forward"] for q in requests),
                "positions": sum(q.stats()["decoder_positions"] for q in requests)}

    def measurement(self, group: str = "eager") -> Measurement:
        best = self.fastest()
        return Measurement(
            system=self.system, batch=self.batch, tokens_per_s=self.batch * self.sampling.max_new_tokens / best["seconds"],
            ms_per_step=1000 * best["seconds"] / max(best["steps"], 1), ttfc_s=best["ttfc"],
            tokens_per_forward=best["tpf"], peak_rss_bytes=max(run["peak_rss"] for run in self.runs),
            gpu_peak_bytes=best["gpu_peak"], rss_before_bytes=min(run["rss_before"] for run in self.runs), group=group,
            decoder_positions=best["positions"],
        )


def load_transformers(folder, dtype, device):
    """transformers' DiffusionGemma from a folder (the bench extra installs transformers)."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=dtype).to(device).eval()


class TransformersTimed(Timed):
    system = "transformers"

    def __init__(self, hf, prompts, sampling: SamplingConfig):
        super().__init__(len(prompts), hf.device)
        self.hf, self.sampling = hf, sampling
        self.ids = torch.tensor(prompts, device=hf.device)
        self.kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, max_denoising_steps=sampling.max_denoising_steps,
            t_min=sampling.t_min, t_max=sampling.t_max, stability_threshold=sampling.stability_threshold,
            # a threshold no mean entropy gets under = a fixed number of steps (transformers wants it > 0)
            confidence_threshold=1e-30 if sampling.fixed_steps else sampling.confidence_threshold,
            eos_token_id=list(sampling.eos_token_ids), pad_token_id=sampling.pad_token_id,
        )
        self.tpf = None
        with torch.no_grad():
            hf.generate(self.ids, **{**self.kwargs, "max_new_tokens": hf.config.canvas_length})  # warm-up

    def generate(self, r: int) -> dict:
        with torch.no_grad():
            out = self.hf.generate(self.ids, **self.kwargs)
        if getattr(out, "tokens_per_forward", None) is not None:
            self.tpf = float(out.tokens_per_forward.float().mean())
        return {}

    def measurement(self, group: str = "eager") -> Measurement:
        best, s = self.fastest(), self.sampling
        steps = s.max_denoising_steps * canvases_for(s.max_new_tokens, self.hf.config.canvas_length)
        return Measurement("transformers", self.batch, self.batch * s.max_new_tokens / best["seconds"],
                           1000 * best["seconds"] / steps if s.fixed_steps else None, None, self.tpf,
                           max(run["peak_rss"] for run in self.runs), best["gpu_peak"], group=group)


class ARTimed(Timed):
    system = "ar"

    def __init__(self, model, prompts, new_tokens: int, eos):
        from dgemma.generation import generate_ar

        super().__init__(len(prompts), model.device)
        self.model, self.prompts, self.new_tokens, self.eos = model, prompts, new_tokens, eos
        self.generate_ar = generate_ar
        generate_ar(model, prompts, 8, eos_token_ids=eos)  # warm-up

    def generate(self, r: int) -> dict:
        start = time.perf_counter()
        self.generate_ar(self.model, self.prompts, 1, eos_token_ids=self.eos)  # time to the first token
        _sync(self.device)
        first = time.perf_counter() - start
        self.generate_ar(self.model, self.prompts, self.new_tokens, eos_token_ids=self.eos)
        return {"first": first}

    def fastest(self) -> dict:  # the timed part is the full generation, not the first-token probe
        best = min(self.runs, key=lambda run: run["seconds"] - run["first"])
        return dict(best, seconds=best["seconds"] - best["first"])

    def measurement(self, group: str = "eager") -> Measurement:
        best = self.fastest()
        return Measurement("ar", self.batch, self.batch * self.new_tokens / best["seconds"],
                           1000 * best["seconds"] / self.new_tokens, min(run["first"] for run in self.runs), 1.0,
                           max(run["peak_rss"] for run in self.runs), best["gpu_peak"], group=group)


def save_for_transformers(model) -> tempfile.TemporaryDirectory:
    from dgemma.weights.checkpoint import save_pretrained

    tmp = tempfile.TemporaryDirectory(prefix="dgemma-bench-")
    save_pretrained(model, os.path.join(tmp.name, "model"))
    return tmp


def memory_budget(model, batch: int, max_length: int) -> dict:
    """What one generation may hold beyond the loaded model (dgemma.engine.memory): the KV cache and the
    sampler's (B, L, V) fp32 buffer. (The engine's cache is already allocated when the timed runs start; it is
    listed for the record.)"""
    return {"kv_cache_bytes": kv_cache(model.cache_config, batch, max_length, model.dtype).nbytes(),
            "logits_buffer_bytes": logits_buffer_bytes(model.config, batch)}
