"""The engine's model-facing half: one preallocated cache, forwards over any subset of its rows.

Rows are Python lists: the cache keeps its bookkeeping on the host, and host values (prompt ids) go to
the device without waiting for it (`dgemma.device_sync.to_device`).
"""

from __future__ import annotations

import contextlib

import torch

from dgemma.device_sync import to_device
from dgemma.model.network import device_vocab_chunk_rows

# Self-conditioning embeddings are made a block of positions at a time from the probabilities buffer, so the
# temporaries stay (block, V) next to the one (B, L, V) buffer; the block depends on the device.


class Runner:
    def __init__(self, model, max_batch: int, max_length: int):
        self.model = model
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, max_length)
        self.hidden_size = model.config.hidden_size
        # each row's LoRA adapter (dgemma.model.adapters; 0: the base model), for models serving adapters
        self.row_adapter = [0] * max_batch

    @property
    def device(self):
        return self.model.device

    def _adapters(self, rows: list[int]):
        """While a forward over `rows` runs: each row's adapter, for a model that serves adapters."""
        holder = getattr(self.model, "adapter_rows", None)
        if holder is None:
            return contextlib.nullcontext()
        return holder.set(to_device([self.row_adapter[r] for r in rows], torch.long, self.device))

    @torch.no_grad()
    def prefill(self, row: int, prompt: list[int], images=None, adapter: int = 0):
        """Encode a prompt into its row; `images` (dgemma.images.ImageInputs) fill its image tokens, in the
        same call (an image's tokens must be encoded together). `adapter`: the row's LoRA adapter from now on."""
        self.row_adapter[row] = adapter
        ids = to_device([prompt], torch.long, self.device)
        pixels = {} if images is None else dict(pixel_values=images.pixel_values,
                                                image_position_ids=images.image_position_ids)
        with self._adapters([row]):
            self.model.encode(ids, self.cache, rows=[row], return_logits=False, **pixels)

    @torch.no_grad()
    def commit(self, rows: list[int], canvases: torch.Tensor):
        """Encode committed canvases (n, L) into their rows' cache."""
        with self._adapters(rows):
            self.model.encode(canvases, self.cache, rows=rows, return_logits=False)

    @torch.no_grad()
    def denoise(self, rows: list[int], canvases: torch.Tensor, softs: list[torch.Tensor | None]) -> torch.Tensor:
        """One decoder forward for the given rows: canvases (n, L), softs[i] (L, H) or None -> logits (n, L, V)."""
        soft = None
        if any(s is not None for s in softs):  # rows at their first step get an exact zero signal
            zeros = torch.zeros(canvases.shape[1], self.hidden_size, dtype=self.model.dtype, device=self.device)
            soft = torch.stack([zeros if s is None else s for s in softs])
        with self._adapters(rows):
            return self.model.denoise(canvases, self.cache, soft_embedding=soft, rows=rows)

    @torch.no_grad()
    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """(L, V) self-conditioning probabilities (the sampler's buffer) -> (L, H), chunked over positions
        so the model-dtype copy of the probabilities stays a (chunk, V) temporary."""
        L, V = probs.shape
        out = torch.empty(L, self.hidden_size, dtype=self.model.dtype, device=self.device)
        step = device_vocab_chunk_rows(L, V, probs.device, self.model.embed_tokens.weight.element_size())
        for a in range(0, L, step):
            out[a : a + step] = self.model.soft_embedding_from_probs(probs[a : a + step])
        return out

    def free(self, rows: list[int]):
        for row in rows:
            self.row_adapter[row] = 0
        if rows:
            self.cache.reset_rows(rows)
