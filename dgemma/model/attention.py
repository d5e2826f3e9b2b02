"""Attention pieces: rotary tables, the KV cache, and the attention masks as pure functions.

The cache stores, for every slot, the *position* of the token held there (-1 = empty or padding).
Masks are computed from positions alone, so a slot's place in the buffer does not matter: the
sliding-window layers can keep a ring buffer of `window - 1` slots and the full layers one slot per
column, and the same mask code serves the causal encoder, the bidirectional decoder and training.

Full-attention layers have no v_proj: keys and values both come from one projection (K = V), so
their cache holds that raw projection once and the layer derives keys (k_norm, RoPE) and values
(scale-free norm) from it when it attends; sliding layers store finished keys and values.

A generation cache also reserves `canvas_length` slots in front of every layer's prefix slots: the
decoder writes the canvas's own keys/values there and attends to one contiguous view
[canvas | prefix], so a denoising step copies L new keys per layer, never the whole prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgemma.config import ModelConfig
from dgemma.device_sync import host_read, to_device


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, partial_factor: float = 1.0, device=None) -> torch.Tensor:
    """(head_dim // 2,) inverse frequencies.

    Sliding layers rotate every pair (partial_factor 1). Full layers use "proportional" RoPE: only the
    first `partial_factor * head_dim / 2` pairs rotate, with frequencies computed against the full head
    dim (the spectrum is truncated, not rescaled); the remaining pairs get frequency 0 (no rotation).
    """
    rotated = int(partial_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return torch.cat([inv_freq, torch.zeros(head_dim // 2 - rotated, device=device)])


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions (B, T) -> cos, sin (B, T, 1, head_dim), computed in fp32 then cast."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (B, T, D): halves layout, paired with rotate_half
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D): rotate pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
# The most attention scores one call materialises. With a boolean mask and GQA, and on full layers (head dim
# 512, above the flash kernels' limit), SDPA runs its math kernel, which holds (B, Hq, T, S) fp32 scores and
# their softmax: 4.3 GB each for an 8k-token prefill at the 26B shape. Longer calls go a block of queries at
# a time; each query's row is computed alone either way, so blocks change nothing but the peak
# (benchmarks/attention_memory.py).
SCORE_CHUNK_ELEMENTS = 1 << 26


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              chunk_elements: int = SCORE_CHUNK_ELEMENTS) -> torch.Tensor:
    """q (B, Hq, T, D), k/v (B, Hkv, S, D), mask (B, 1, T, S) bool or None -> (B, Hq, T, D), scale 1."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = max(1, chunk_elements // (B * Hq * S))
    if rows >= T and mask is None and Hq > Hkv and not torch.is_grad_enabled():
        # Without a mask every query row is on its own, so the heads that share a KV head are one head of
        # group * T queries: the same numbers, and the CPU flash kernel works on longer query blocks
        # (10-13% faster on full layers, 4 or 8 query heads per KV head; the same on sliding ones). Not
        # under autograd: there the backward would sum the key and value gradients in another order.
        folded = q.reshape(B, Hkv, Hq // Hkv * T, D)
        return F.scaled_dot_product_attention(folded, k, v, scale=1.0).view(B, Hq, T, v.shape[-1])
    if rows >= T:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
    out = q.new_empty(B, Hq, T, v.shape[-1])
    for a in range(0, T, rows):
        block_mask = None if mask is None else mask[:, :, a : a + rows]
        out[:, :, a : a + rows] = F.scaled_dot_product_attention(q[:, :, a : a + rows], k, v, attn_mask=block_mask,
                                                                 scale=1.0, enable_gqa=True)
    return out


def attention_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   valid: torch.Tensor, chunk_elements: int = SCORE_CHUNK_ELEMENTS):
    """`attention`, written out so that its weights are seen: q (B, Hq, T, D), k/v (B, Hkv, S, D), mask
    (B, 1, T, S) bool or None, valid (B, T) bool the queries that count -> out (B, Hq, T, D) and read (B, S)
    fp32, the attention weight each key receives, summed over the heads and the valid queries (the step cache's
    attention-targeted refresh, dgemma.generation.step_cache). A block of queries at a time past the budget."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    out = q.new_empty(B, Hq, T, v.shape[-1])
    read = torch.zeros(B, S, dtype=torch.float32, device=q.device)
    rows = max(1, chunk_elements // (B * Hq * S))
    for a in range(0, T, rows):
        t = min(rows, T - a)
        qa = q[:, :, a : a + t].reshape(B, Hkv, group * t, D)  # the heads sharing a KV head, as one
        scores = (qa @ k.transpose(-1, -2)).float()  # (B, Hkv, group * t, S)
        if mask is not None:
            block = mask[:, :, a : a + t]  # (B, 1, t, S), the same for every head
            scores = scores.masked_fill(~block.repeat(1, 1, group, 1), float("-inf"))
        weights = scores.softmax(dim=-1)
        out[:, :, a : a + t] = (weights.to(v.dtype) @ v).view(B, Hq, t, v.shape[-1])
        counted = valid[:, a : a + t].repeat(1, group).to(weights.dtype)  # (B, group * t)
        read += torch.einsum("bhqs,bq->bs", weights, counted)
    return out, read


# ---------------------------------------------------------------------------------------------
# Masks (pure functions of positions)
# ---------------------------------------------------------------------------------------------
def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Encoder mask. q_pos (B, T), k_pos (B, S) with -1 for empty/padding -> (B, 1, T, S) bool.

    A query sees keys at positions <= its own and, on sliding layers, within the last `window`.
    `blocks` (B, T): the new tokens, which are the last T keys, grouped: tokens of one group >= 0 (an
    image's soft tokens) also see each other both ways, whatever the window; -1 is no group.
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (q - k) < window
    if blocks is not None:
        T = blocks.shape[1]
        visible[:, :, -T:] |= (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    return _never_empty(visible)[:, None]


def image_blocks(is_image: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True on image soft tokens -> (B, T) long: each run of consecutive image tokens (one
    image) numbered 0, 1, ... along the row, -1 elsewhere."""
    starts = is_image.clone()
    starts[:, 1:] &= ~is_image[:, :-1]
    return torch.where(is_image, starts.long().cumsum(dim=1) - 1, -1)


def canvas_mask(cached_pos: torch.Tensor, canvas_start: torch.Tensor, canvas_len: int, window: int | None):
    """Decoder mask over keys laid out [canvas (L) | cached slots (S)]. cached_pos (B, S), canvas_start
    (B,) -> (B, 1, L, L + S) bool.

    Every canvas token sees the whole canvas and the cached prefix before `canvas_start`; on sliding
    layers only the last `window - 1` prefix tokens (what the encoder's ring buffer keeps), so a
    keep-everything training cache gives exactly what generation sees.
    """
    start = canvas_start[:, None]
    prefix = (cached_pos >= 0) & (cached_pos < start)
    if window is not None:
        prefix &= cached_pos > start - window
    B = cached_pos.shape[0]
    visible = torch.cat([prefix.new_ones(B, canvas_len), prefix], dim=1)  # (B, L + S)
    return visible[:, None, None, :].expand(B, 1, canvas_len, visible.shape[1])


def _never_empty(visible: torch.Tensor) -> torch.Tensor:
    # Padding queries (left padding at the very start) see no key at all; let them see everything so
    # attention stays finite. Their outputs are never used.
    return visible | ~visible.any(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------
class KVCache:
    """Preallocated keys/values for every layer, written by the encoder, read by the decoder.

    Full-attention layers keep one slot per position (`max_length` slots). Sliding layers keep a ring of
    `window - 1` slots (all they will ever attend to), unless `keep_all` (training, where each example's
    canvas sees a different prefix). Slot positions live in one table per layer kind.

    Every row has its own length, so a serving engine can hold requests at different points in one
    cache and run any subset of rows (`rows`) through a forward pass.

    `rows`, wherever a method takes it: None (every row), a list of row numbers, or a tensor of them. The
    bookkeeping (lengths, which slots are filled) is Python on the host; given a list, a forward reads
    nothing back from the device (a tensor costs one host read per forward: `dgemma.device_sync`).

    Buffer layout per layer: (batch, kv heads, canvas slots + prefix slots, head dim); the canvas slots
    (`canvas_length` of them, none for keep_all caches) belong to the decoder, see `canvas_buffers`.
    Full layers keep only `keys` (the raw K = V projection); their `values` entry is None.

    The canvas slots' invariant: slot j of a row holds canvas position j's keys/values from the last decoder
    step that computed that position, for the canvas the row is denoising now. A whole step
    (`place_in_canvas_slots`) writes all of them; the step cache's packed step (`place_active_in_slots`) writes
    only its active positions, so a settled position's slots keep what it had when it was last computed. The
    encoder never writes them and a new canvas's first step overwrites them all, so nothing of an earlier
    canvas is read; the prefix slots are written by the encoder alone.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        *,
        keep_all: bool = False,
        device=None,
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.batch_size = batch_size
        self.max_length = max_length
        self.keep_all = keep_all
        self.row_lengths = [0] * batch_size  # positions encoded so far per row (== next position)
        self.row_padded = [False] * batch_size  # the row may hold padding (slot position -1 inside its length)
        sliding_slots = max_length if keep_all else min(max_length, max(config.sliding_window - 1, 1))
        self.capacity = {False: max_length, True: sliding_slots}  # prefix slots, keyed by is_sliding
        self.canvas_slots = 0 if keep_all else config.canvas_length
        self._memo: dict = {}  # see `tables_for_positions`; cleared whenever slots or lengths change
        self._row_sets: dict = {}  # tuple of rows -> (rows, batch index); see `_rows`
        self._rows_seen: tuple = (None, None)  # the last rows tensor and what `_rows` made of it
        self.slot_pos = {
            s: torch.full((batch_size, n), -1, dtype=torch.long, device=device) for s, n in self.capacity.items()
        }
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for i in range(config.num_layers):
            slots = self.canvas_slots + self.capacity[config.is_sliding(i)]
            shape = (batch_size, config.layer_kv_heads(i), slots, config.layer_head_dim(i))
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device) if config.is_sliding(i) else None)

    @property
    def device(self):
        return self.slot_pos[False].device

    @property
    def length(self) -> int:
        """The longest row's length (all rows are equal when the cache is used as one batch)."""
        return max(self.row_lengths)

    def _rows(self, rows) -> tuple[tuple[int, ...], slice | torch.Tensor]:
        """`rows` -> (the row numbers on the host, an index into the batch dim: a slice when they are
        consecutive (views, no copies), else a device tensor). Memoised: one forward asks in every layer."""
        if rows is None:
            return tuple(range(self.batch_size)), slice(None)
        if isinstance(rows, torch.Tensor):
            if self._rows_seen[0] is not rows:
                host = tuple(host_read(rows.reshape(-1), "cache rows as a tensor"))
                self._rows_seen = (rows, self._index(host, rows))
            return self._rows_seen[1]
        key = tuple(int(r) for r in rows)
        if key not in self._row_sets:
            if len(self._row_sets) > 512:  # row subsets of a long-running engine: keep the memo bounded
                self._row_sets.clear()
            self._row_sets[key] = self._index(key, None)
        return self._row_sets[key]

    def _index(self, host: tuple[int, ...], tensor: torch.Tensor | None):
        first, n = (host[0] if host else 0), len(host)
        if host == tuple(range(first, first + n)):
            return host, slice(first, first + n)
        return host, (tensor if tensor is not None else to_device(list(host), torch.long, self.device))

    def row_tensor(self, rows) -> torch.Tensor:
        """`rows` as a device tensor of row numbers (for scattered writes)."""
        host, index = self._rows(rows)
        if isinstance(index, torch.Tensor):
            return index
        key = ("row tensor", host)
        if key not in self._row_sets:
            self._row_sets[key] = torch.arange(index.start or 0, (index.start or 0) + len(host), device=self.device)
        return self._row_sets[key]

    def lengths(self, rows=None) -> torch.Tensor:
        """(n,) lengths of `rows` (all rows if None) as a tensor on the cache's device (sent, not read back)."""
        host = self._rows(rows)[0]
        key = ("lengths", host)
        if key not in self._memo:
            self._memo[key] = to_device([self.row_lengths[r] for r in host], torch.long, self.device)
        return self._memo[key]

    def filled(self, sliding: bool, rows=None) -> int:
        """Leading slots that may hold something for these rows (slots fill 0, 1, ... before a ring wraps)."""
        return min(max(self.row_lengths[r] for r in self._rows(rows)[0]), self.capacity[sliding])

    def prefix_visible(self, sliding: bool, rows=None) -> bool | None:
        """Whether a canvas after each row's prefix sees every filled slot of these rows (its decoder mask
        is all True), decided on the host: True, False, or None when the host cannot tell (rows that may
        hold padding, or a keep_all cache, whose sliding slots outlive the window).

        Row r's slots 0 .. min(length_r, capacity) - 1 hold its last positions, all before its canvas and,
        in a ring of window - 1 slots, all inside the window; the slots after them hold nothing. So the
        mask is all True exactly when every row fills as many slots as the longest row."""
        host = self._rows(rows)[0]
        if self.keep_all or any(self.row_padded[r] for r in host):
            return None
        filled = self.filled(sliding, rows)
        return all(min(self.row_lengths[r], self.capacity[sliding]) >= filled for r in host)

    def tables_for_positions(self, name, rows, build):
        """`build()` once per (name, rows, their lengths) until the cache's slots change: what depends on
        positions alone, like a canvas's masks and RoPE tables, is made once per canvas, not per step."""
        host = self._rows(rows)[0]
        key = (name, host, tuple(self.row_lengths[r] for r in host))
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def view(self, layer: int, sliding: bool, rows):
        """(keys, values or None, slot positions) of `rows`, cut to the prefix slots in use."""
        n, c = self.filled(sliding, rows), self.canvas_slots
        idx = self._rows(rows)[1]
        values = self.values[layer]
        return (self.keys[layer][idx, :, c : c + n], None if values is None else values[idx, :, c : c + n],
                self.slot_pos[sliding][idx, :n])

    def place_before_prefix(self, layer: int, sliding: bool, rows, k: torch.Tensor, v):
        """The canvas's own entries k, v (n, Hkv, L, D; v None on full layers), then the rows' prefix
        slots -> new tensors over (n, Hkv, L + S, D), by concatenation.

        For a keep_all cache (training) and for forwards that need gradients through k, v; generation
        writes the canvas into the cache's reserved slots instead (`canvas_buffers`). The prefix slots
        are never modified.
        """
        old_k, old_v, _ = self.view(layer, sliding, rows)
        return torch.cat([k, old_k], dim=2), None if v is None else torch.cat([v, old_v], dim=2)

    def canvas_buffers(self, rows) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per layer, the rows' (keys, values or None) over [canvas slots | prefix slots in use], each
        (n, Hkv, L + S, D), for `DiffusionGemma.decode_canvas` to write the canvas into. Views of the
        cache when the rows are consecutive; for other rows a copy (the prefix is only read)."""
        idx, c = self._rows(rows)[1], self.canvas_slots
        buffers = []
        for i in range(self.config.num_layers):
            end = c + self.filled(self.config.is_sliding(i), rows)
            values = self.values[i]
            buffers.append((self.keys[i][idx, :, :end], None if values is None else values[idx, :, :end]))
        return buffers

    def place_active_in_slots(self, layer: int, rows, pack, k: torch.Tensor, v: torch.Tensor | None):
        """The step cache's decoder (`DiffusionGemma.decode_active`): write the packed active positions' entries
        k, v (1, Hkv, N, D; v None on full layers) into their rows' canvas slots (slot = canvas position), where
        they stay until the position is computed again; -> this layer's (keys, values or None) over
        [canvas slots | prefix slots in use] of `rows`, each (n, Hkv, L + S, D) (a copy for scattered rows)."""
        cache_rows = self.row_tensor(rows)[pack.row_of]  # (N,)
        self.keys[layer][cache_rows, :, pack.index] = k[0].transpose(0, 1).to(self.keys[layer].dtype)
        values = self.values[layer]
        if values is not None:
            values[cache_rows, :, pack.index] = v[0].transpose(0, 1).to(values.dtype)
        idx = self._rows(rows)[1]
        end = self.canvas_slots + self.filled(self.config.is_sliding(layer), rows)
        return self.keys[layer][idx, :, :end], None if values is None else values[idx, :, :end]

    def cached_positions(self, sliding: bool, rows=None) -> torch.Tensor:
        return self.slot_pos[sliding][self._rows(rows)[1], : self.filled(sliding, rows)]

    def check_room(self, new_len: int, rows=None):
        longest = max(self.row_lengths[r] for r in self._rows(rows)[0])
        if longest + new_len > self.max_length:
            raise ValueError(f"cache full: {longest} + {new_len} tokens exceed max_length={self.max_length}")

    def write(self, layer: int, sliding: bool, rows, positions: torch.Tensor, k: torch.Tensor, v):
        """Store k, v (n, Hkv, T, D; v None on full layers) of tokens at `positions` (n, T); a ring keeps
        only the last slots."""
        keep = min(positions.shape[1], self.capacity[sliding])
        slots = self.canvas_slots + positions[:, -keep:] % self.capacity[sliding]  # (n, keep)
        row_idx = self.row_tensor(rows)
        new_k = k[:, :, -keep:].transpose(1, 2).to(self.keys[layer].dtype)  # (n, keep, Hkv, D)
        self.keys[layer][row_idx[:, None], :, slots] = new_k
        if v is not None:
            self.values[layer][row_idx[:, None], :, slots] = v[:, :, -keep:].transpose(1, 2).to(self.values[layer].dtype)

    def commit_positions(self, rows, positions: torch.Tensor, valid: torch.Tensor, *, padded: bool = True):
        """Record the positions of a block just written (n, T); padding (valid False) gets -1. Advances
        the rows' lengths. padded=False promises that `valid` is all True (the host then knows the rows
        hold no padding, see `prefix_visible`)."""
        self._memo.clear()
        pos = torch.where(valid, positions, torch.full_like(positions, -1))
        row_idx = self.row_tensor(rows)
        for sliding in (False, True):
            keep = min(positions.shape[1], self.capacity[sliding])
            slots = positions[:, -keep:] % self.capacity[sliding]
            self.slot_pos[sliding][row_idx[:, None], slots] = pos[:, -keep:]
        for r in self._rows(rows)[0]:
            self.row_lengths[r] += positions.shape[1]
            self.row_padded[r] |= padded

    def save_overwritten(self, row: int, new_len: int):
        """What writing `new_len` more tokens into `row` would overwrite: the sliding layers' ring slots
        (keys, values, positions) that its next positions reuse. `rewind` puts them back."""
        cap, c = self.capacity[True], self.canvas_slots
        start = self.row_lengths[row]
        keep = min(new_len, cap)
        slots = [p % cap for p in range(start + new_len - keep, start + new_len)]
        index = torch.tensor(slots, device=self.device)
        saved = {i: (self.keys[i][row, :, c + index].clone(), self.values[i][row, :, c + index].clone())
                 for i in range(self.config.num_layers) if self.config.is_sliding(i)}
        return start, index, saved, self.slot_pos[True][row, index].clone()

    def rewind(self, row: int, saved):
        """Take back the tokens written into `row` since `save_overwritten` made `saved`: the row's length
        returns to what it was and the ring slots they reused get their old entries."""
        self._memo.clear()
        start, index, entries, positions = saved
        c = self.canvas_slots
        for i, (k, v) in entries.items():
            self.keys[i][row, :, c + index] = k
            self.values[i][row, :, c + index] = v
        self.slot_pos[True][row, index] = positions
        self.slot_pos[False][row, start : self.row_lengths[row]] = -1
        self.row_lengths[row] = start

    def copy_row(self, source: int, targets: list[int]):
        """Give `targets` the exact contents of row `source` (entries, slot positions, length): a prefix
        encoded once serves several continuations, each then appended in its own row."""
        self._memo.clear()
        idx = to_device(list(targets), torch.long, self.device)
        c = self.canvas_slots
        for i in range(self.config.num_layers):
            end = c + min(self.row_lengths[source], self.capacity[self.config.is_sliding(i)])
            for buffers in (self.keys, self.values):
                if buffers[i] is not None:
                    buffers[i][idx, :, c:end] = buffers[i][source : source + 1, :, c:end].clone()
        for p in self.slot_pos.values():
            p[idx] = p[source].clone()
        for r in targets:
            self.row_lengths[r] = self.row_lengths[source]
            self.row_padded[r] = self.row_padded[source]

    def reset_rows(self, rows: list[int]):
        """Free rows for new requests (their old slots become invisible)."""
        self._memo.clear()
        for r in rows:
            self.row_lengths[r] = 0
            self.row_padded[r] = False
        idx = to_device(list(rows), torch.long, self.device)
        for p in self.slot_pos.values():
            p[idx] = -1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)
