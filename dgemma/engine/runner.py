"""The engine's model-facing half: one preallocated cache, forwards over any subset of its rows, and the
prefix cache (prefix_cache.py) the rows' encodes feed and new rows start from.

Rows are Python lists: the cache keeps its bookkeeping on the host, and host values (prompt ids) go to
the device without waiting for it (`dgemma.device_sync.to_device`).

Aligned spans (`span_tokens`, the engine's deterministic mode): a float matmul's rounding on a CPU or GPU
depends on the shape of the call a row is in (how many rows, which tile it falls in), so a prompt encoded
in other chunks, or partly taken from the prefix cache, gets cache entries a rounding apart, and sampling
can then draw other tokens. With spans every encoder call covers one row's tokens from one multiple of
`span_tokens` to the next (or to the row's end): a position's entries always come from the same call
shape, whatever was cached or chunked before. A span read in part (a prompt's or an answer's end) is read
again, whole, when its row grows; only whole spans feed the prefix cache. The decoder then runs one
forward a row (`denoise`), so that the other rows cannot move a row's rounding either.
"""

from __future__ import annotations

import contextlib

import torch

from dgemma.device_sync import to_device
from dgemma.engine.prefix_cache import PrefixCache, RowTrail, image_digest, image_spans
from dgemma.model.network import PreviousStep, device_vocab_chunk_rows
from dgemma.model.packing import PackedPositions


def model_key(model) -> str:
    """What makes one model's cache entries differ from another's: its shape, dtype and quantisation (the
    engine's prefix cache serves one model; the key keeps blocks of another from ever matching)."""
    return f"{model.config!r}|{model.dtype}|{model.quantization}"


class Runner:
    def __init__(self, model, max_batch: int, max_length: int, prefix_cache_bytes: int = 0,
                 span_tokens: int | None = None):
        self.model = model
        self.span_tokens = span_tokens  # aligned spans (see the module docstring), or None
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, max_length)
        self.hidden_size = model.config.hidden_size
        self.prefix_cache = PrefixCache(prefix_cache_bytes, model_key=model_key(model)) if prefix_cache_bytes > 0 \
            else None
        self.trails: dict[int, RowTrail] = {}  # row -> what it encoded since its last whole block
        # each row's LoRA adapter (dgemma.model.adapters; 0: the base model), for models serving adapters
        self.row_adapter = [0] * max_batch
        # with aligned spans: row -> (its last span's tokens, read in part, and what reading them overwrote)
        self.partial_spans: dict[int, tuple[list[int], object]] = {}

    @property
    def device(self):
        return self.model.device

    def _adapters(self, rows: list[int]):
        """While a forward over `rows` runs: each row's adapter, for a model that serves adapters. A forward
        whose rows all run the base model skips the adapters' products (adapter 0 adds exactly zero)."""
        holder = self.model.adapter_rows
        adapters = [self.row_adapter[r] for r in rows]
        if holder is None or not any(adapters):
            return contextlib.nullcontext()
        return holder.set(to_device(adapters, torch.long, self.device))

    @torch.no_grad()
    def start_row(self, row: int, prompt: list[int], images=None, adapter: int = 0,
                  limit: int | None = None, want_hidden: bool = False):
        """A fresh row for `prompt` run with LoRA `adapter` (0: the base model): the longest run of cached
        blocks (ending at or before `limit` tokens, never inside an image) is written into it. Returns
        (tokens taken, the images left to encode with the rest, their hidden states (n, H) when
        `want_hidden`)."""
        self.row_adapter[row] = adapter
        if self.prefix_cache is None:
            return 0, images, None
        B = self.prefix_cache.block_tokens
        limit = len(prompt) if limit is None else limit
        salts, spans = {}, []
        if images is not None:
            spans = image_spans(prompt, self.model.config.image_token_id, images.num_soft_tokens)
            for i, (start, _) in enumerate(spans):
                digest = image_digest(images.pixel_values[i], images.image_position_ids[i])
                salts[start // B] = salts.get(start // B, b"") + digest
            for start, end in spans:  # an image's tokens are encoded together
                if start < limit < end:
                    limit = start
        root = self.prefix_cache.root_key(adapter)
        if self.span_tokens:  # whole spans only: the rest is read in the call its span's first token starts
            limit = limit // self.span_tokens * self.span_tokens
        blocks = self.prefix_cache.match(prompt, root, salts, limit)
        if self.span_tokens:  # a run of blocks cut short by eviction ends on a span bound too
            blocks = blocks[: len(blocks) * B // self.span_tokens * self.span_tokens // B]
        for start, end in reversed(spans):  # the blocks found may stop inside an image: back off to its start
            if start < len(blocks) * B < end:
                blocks = blocks[: start // B]
        matched = len(blocks) * B
        self.trails[row] = RowTrail(blocks[-1].key if blocks else root, matched, salts)
        if blocks:
            self._restore(row, blocks)
        if images is not None and matched:
            first = sum(1 for start, _ in spans if start < matched)
            images = None if first == len(spans) else type(images)(
                images.pixel_values[first:], images.image_position_ids[first:], images.num_soft_tokens[first:])
        hidden = torch.cat([b.hidden for b in blocks]) if want_hidden and blocks else None
        return matched, images, hidden

    def _restore(self, row: int, blocks):
        """Write cached blocks (positions 0 .. P - 1) into an empty row: every layer's last slots it keeps."""
        cache, P = self.cache, len(blocks) * self.prefix_cache.block_tokens
        positions = torch.arange(P, device=self.device)[None]  # (1, P)
        for i in range(self.model.config.num_layers):
            sliding = self.model.config.is_sliding(i)
            keep = min(P, cache.capacity[sliding])  # a sliding ring takes the last window - 1 alone
            first = (P - keep) // self.prefix_cache.block_tokens
            k = torch.cat([b.keys[i] for b in blocks[first:]], dim=1)[None]  # (1, Hkv, >= keep, D)
            v = None if blocks[0].values[i] is None else torch.cat([b.values[i] for b in blocks[first:]], dim=1)[None]
            cache.write(i, sliding, [row], positions, k, v)
        cache.commit_positions([row], positions, torch.ones_like(positions, dtype=torch.bool), padded=False)

    @torch.no_grad()
    def prefill(self, row: int, prompt: list[int], images=None):
        """Encode prompt tokens into their row (all of it, or the next chunk); `images`
        (dgemma.images.ImageInputs) fill its image tokens, in the same call (an image's tokens must be
        encoded together)."""
        if self.span_tokens:
            if images is None:
                self._encode_spans(row, prompt)
                return
            self.trails.pop(row, None)  # read in one call, not in spans: this row no longer feeds the cache
        ids = to_device([prompt], torch.long, self.device)
        pixels = {} if images is None else dict(pixel_values=images.pixel_values,
                                                image_position_ids=images.image_position_ids)
        self.encode_rows(ids, [row], tokens=[prompt], **pixels)

    @torch.no_grad()
    def commit(self, rows: list[int], canvases: list[list[int]]):
        """Encode committed canvases (n lists of L tokens) into their rows' cache."""
        if self.span_tokens:
            for row, canvas in zip(rows, canvases):
                self._encode_spans(row, canvas)
            return
        self.encode_rows(to_device(canvases, torch.long, self.device), rows, tokens=canvases)

    def _encode_spans(self, row: int, tokens: list[int]):
        """Append `tokens` to the row one aligned span a call, first reading again the span it left
        unfinished (if any) together with them."""
        C = self.span_tokens
        if row in self.partial_spans:
            head, saved = self.partial_spans.pop(row)
            self.cache.rewind(row, saved)
            tokens = head + tokens
        if self.cache.row_lengths[row] % C:  # a prompt with images, read in one call: not aligned from here on
            self.encode_rows(to_device([tokens], torch.long, self.device), [row], tokens=[tokens])
            return
        for a in range(0, len(tokens), C):
            piece = tokens[a : a + C]
            whole = len(piece) == C
            saved = None if whole else self.cache.save_overwritten(row, len(piece))
            self.encode_rows(to_device([piece], torch.long, self.device), [row], tokens=[piece], feed_cache=whole)
            if not whole:
                self.partial_spans[row] = (piece, saved)

    @torch.no_grad()
    def encode_rows(self, ids: torch.Tensor, rows: list[int], valid: torch.Tensor | None = None,
                    counts: list[int] | None = None, tokens: list[list[int]] | None = None,
                    feed_cache: bool | None = None, **pixels):
        """model.encode of ids (n, T) into `rows` -> hidden (n, T, H); each row's first counts[i] tokens
        (all without padding) feed the prefix cache (`feed_cache`; by default unless spans are aligned,
        where only whole spans do). `tokens`: the ids on the host, when the caller has them (else they
        are read back)."""
        if feed_cache is None:
            feed_cache = not self.span_tokens
        entries = [] if self.trails and feed_cache else None
        with self._adapters(rows):
            hidden = self.model.encode(ids, self.cache, valid, rows=rows, return_hidden=True, entries_out=entries,
                                       **pixels)
        if entries:
            host = tokens if tokens is not None else ids.tolist()
            for i, row in enumerate(rows):
                trail = self.trails.get(row)
                if trail is None:
                    continue
                n = ids.shape[1] if counts is None else counts[i]
                own = [(k[i, :, :n].clone(), None if v is None else v[i, :, :n].clone()) for k, v in entries]
                trail.add(self.prefix_cache, list(host[i][:n]), own, hidden[i, :n].clone(), self.cache.keys[0].dtype)
        return hidden

    def copy_row(self, source: int, targets: list[int]):
        """Give `targets` row `source`'s contents, and what it would still give the prefix cache."""
        self.cache.copy_row(source, targets)
        for t in targets:
            self.row_adapter[t] = self.row_adapter[source]
        if source in self.trails:
            for t in targets:
                self.trails[t] = self.trails[source].copy()
        if source in self.partial_spans:  # its saved slots are only read back: every copy may share them
            head, saved = self.partial_spans[source]
            for t in targets:
                self.partial_spans[t] = (list(head), saved)

    @torch.no_grad()
    def denoise(self, rows: list[int], canvases: torch.Tensor, softs: list[torch.Tensor | None]) -> torch.Tensor:
        """One decoder forward for the given rows: canvases (n, L), softs[i] (L, H) or None -> logits (n, L, V).
        With aligned spans (deterministic) one forward a row: a row's rounding in a shared forward follows
        the others' (the keys are padded to the longest row's, the experts see every row's tokens)."""
        if self.span_tokens and len(rows) > 1:
            logits = None
            for i, row in enumerate(rows):
                one = self.denoise([row], canvases[i : i + 1], softs[i : i + 1])
                if logits is None:
                    logits = one.new_empty(len(rows), *one.shape[1:])
                logits[i] = one[0]
            return logits
        with self._adapters(rows):
            return self.model.denoise(canvases, self.cache, self_conditioning=self._previous(softs, canvases.shape[1]),
                                      rows=rows)

    @torch.no_grad()
    def denoise_positions(self, rows: list[int], canvases: torch.Tensor, softs: list[torch.Tensor | None],
                          active: torch.Tensor, counts: list[int], read: torch.Tensor | None = None) -> torch.Tensor:
        """The step cache's forward: only the `active` (n, L) positions of the rows' canvases (n, L) run (counts:
        each row's, on the host; softs as `denoise`) -> their logits (N, V), packed row after row
        (`PackedPositions.from_mask`); `read` (n, L), if given, collects the attention on each canvas position
        (`DiffusionGemma.decode_active`). With aligned spans one forward a row, as `denoise`."""
        if self.span_tokens and len(rows) > 1:
            return torch.cat([self.denoise_positions([row], canvases[i : i + 1], softs[i : i + 1], active[i : i + 1],
                                                     counts[i : i + 1], None if read is None else read[i : i + 1])
                              for i, row in enumerate(rows) if counts[i]])
        with self._adapters(rows):
            return self.model.decode_active(canvases, self.cache, PackedPositions.from_mask(active, counts),
                                            self_conditioning=self._previous(softs, canvases.shape[1]), rows=rows,
                                            read=read)

    def _previous(self, softs: list[torch.Tensor | None], length: int) -> PreviousStep | None:
        """The rows' self-conditioning embeddings softs[i] (L, H) or None as one `PreviousStep` (n, L, H): rows at
        their first step get an exact zero signal; None when every row is at its first step."""
        if all(s is None for s in softs):
            return None
        zeros = torch.zeros(length, self.hidden_size, dtype=self.model.dtype, device=self.device)
        return PreviousStep(embedding=torch.stack([zeros if s is None else s for s in softs]))

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
        for r in rows:
            self.trails.pop(r, None)
            self.partial_spans.pop(r, None)
            self.row_adapter[r] = 0
        if rows:
            self.cache.reset_rows(rows)
