"""Run by tests/test_prefix_cache.py in a fresh process: 1,000 requests with different 256-token prompts
through an engine whose prefix cache holds at most `budget` bytes (the first argument), 50 at a time.

Prints one JSON line: resident memory (VmRSS) after the first 50 requests (by then the cache is full and the
allocator warm), the highest VmRSS read after each later 50, and the cache's counters.
"""

from __future__ import annotations

import json
import sys

import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine
from dgemma.processes import resident_memory

REQUESTS, WAVE, PROMPT = 1000, 50, 256


def prompts(first: int, n: int, vocab: int) -> list[list[int]]:
    """Prompt i: PROMPT tokens drawn with seed i, so no two share a block."""
    return [torch.randint(2, vocab, (PROMPT,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(first, first + n)]


def main():
    budget = int(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()
    engine = Engine(model, max_batch=16, max_length=PROMPT + 64, prefix_cache_bytes=budget,
                    prefill_chunk=4 * PROMPT)
    # an EOS outside the vocabulary, one step: each request is its prompt's prefill and one canvas
    sampling = SamplingConfig(max_new_tokens=16, max_denoising_steps=1, eos_token_ids=(1000,))
    V = model.config.vocab_size
    with torch.no_grad():
        engine.generate(prompts(0, WAVE, V), sampling, seeds=list(range(WAVE)))
        start = peak = resident_memory()["rss"]
        for first in range(WAVE, REQUESTS, WAVE):
            engine.generate(prompts(first, WAVE, V), sampling, seeds=list(range(WAVE)))
            peak = max(peak, resident_memory()["rss"])
    stats = engine.prefix_cache.stats
    block_bytes = next(iter(engine.prefix_cache.blocks.values())).nbytes
    print(json.dumps({"start_rss": start, "peak_rss": peak, "held_bytes": stats.bytes, "blocks": stats.blocks,
                      "inserted_bytes": stats.inserted * block_bytes, "evictions": stats.evictions,
                      "lookups": stats.lookups, "rows_left": len(engine.runner.trails)}))


if __name__ == "__main__":
    main()
