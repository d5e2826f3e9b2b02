"""The prefix cache: committed KV kept across requests, so a prompt that starts like an earlier one (a
chat's next turn, a shared system prompt, the same few-shot block) encodes only what is new.

The encoder is causal, so the cache entries of a token depend on the tokens before it alone: the entries
of a prompt's first n tokens are the same in every request that starts with those n tokens. They are kept
in blocks of `block_tokens` tokens, each keyed by a hash chained over the whole prefix up to its end
(with the model, the adapter and the pixels of every image so far in the key), so a block is only ever
found by a request whose every earlier token matches.

A block holds, for its tokens, every layer's entries as the encoder made them (sliding layers included:
all of the block's tokens, not only what a ring of `window - 1` slots would keep, so a prefix that ends
anywhere can fill its ring), and the encoder's last hidden states (scoring computes a position's
log-probabilities from them without running the encoder again). Blocks are dropped least recently used
first to keep their bytes within the budget.

`RowTrail` follows one engine cache row: the tokens encoded into it since its last whole block and their
entries; each time a block fills, it goes into the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK_TOKENS = 16
# The budget when none is given (`default_budget`): a share of the memory free when the engine starts, capped
DEFAULT_SHARE = 4  # a quarter
DEFAULT_MAX_BYTES = 16 << 30


def default_budget(model) -> int:
    """The prefix cache's budget when none is given (`Engine(prefix_cache_bytes="auto")`; the generating
    commands and the server without --prefix-cache-gib): a quarter of the memory free on the model's device
    now (`dgemma.devices.free_memory_bytes`), at most 16 GiB. The ranks of a split model hold the same
    blocks, so each takes the smallest budget over the ranks: a collective that every rank calls."""
    from dgemma import devices

    budget = min(devices.free_memory_bytes(model.device) // DEFAULT_SHARE, DEFAULT_MAX_BYTES)
    tp = getattr(model, "tp", None)
    if tp is not None:
        import torch.distributed as dist

        smallest = torch.tensor([budget], dtype=torch.int64, device=model.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=tp.group)
        budget = int(smallest.item())
    return budget


def _counter(doc: str | None = None):
    """A counter of `PrefixCacheStats`, starting at 0; `doc` says what it counts (the server's /health schema
    publishes it)."""
    return field(default=0, metadata={"doc": doc} if doc else {})


@dataclass
class PrefixCacheStats:
    """Counters a /health page or a metrics exporter reads (`as_dict`)."""

    blocks: int = _counter("blocks held now")
    bytes: int = _counter("their bytes")
    budget_bytes: int = _counter()
    lookups: int = _counter("requests that looked their prompt up")
    hits: int = _counter("requests that took at least one block")
    cached_tokens: int = _counter("prompt tokens taken from the cache, all requests")
    inserted: int = _counter("blocks stored")
    evictions: int = _counter("blocks dropped for room")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CachedBlock:
    key: bytes
    keys: list[torch.Tensor]  # per layer (Hkv, n, D)
    values: list[torch.Tensor | None]  # per layer (Hkv, n, D); None on full layers (K = V)
    hidden: torch.Tensor  # (n, H): the encoder's output at these positions
    nbytes: int = 0

    def __post_init__(self):
        tensors = [*self.keys, *(v for v in self.values if v is not None), self.hidden]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


def chain_key(previous: bytes, tokens: list[int], salt: bytes) -> bytes:
    """The key of a block: a hash of the previous block's key, this block's tokens and `salt` (the
    digests of images whose tokens start in this block)."""
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    h.update(salt)
    return h.digest()


def image_digest(pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> bytes:
    """One image's identity for the key: its pixels and patch positions."""
    h = hashlib.blake2b(digest_size=16)
    h.update(pixel_values.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(image_position_ids.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def image_spans(prompt: list[int], image_token_id: int, num_soft_tokens: list[int]) -> list[tuple[int, int]]:
    """[start, end) positions of each image's tokens in the prompt, in order."""
    at = [i for i, t in enumerate(prompt) if t == image_token_id]
    spans, k = [], 0
    for n in num_soft_tokens:
        spans.append((at[k], at[k + n - 1] + 1))
        k += n
    return spans


class PrefixCache:
    def __init__(self, budget_bytes: int, *, block_tokens: int = BLOCK_TOKENS, model_key: str = ""):
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = block_tokens
        self.root = hashlib.blake2b(model_key.encode(), digest_size=16).digest()
        self.blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats(budget_bytes=self.budget_bytes)

    def root_key(self, adapter: int | str | None) -> bytes:
        """The key before a prompt's first block: the model, and the LoRA adapter (0 or None: the base
        weights)."""
        return self.root if adapter in (None, 0) else chain_key(self.root, [], f"adapter:{adapter}".encode())

    def match(self, prompt: list[int], root: bytes, salts: dict[int, bytes], limit: int) -> list[CachedBlock]:
        """The longest run of cached blocks that starts the prompt and ends at or before `limit` tokens;
        they become the most recently used. `salts[i]`: block i's image digests."""
        self.stats.lookups += 1
        found, key, B = [], root, self.block_tokens
        for i in range(limit // B):
            key = chain_key(key, prompt[i * B : (i + 1) * B], salts.get(i, b""))
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self.blocks.move_to_end(block.key)
        if found:
            self.stats.hits += 1
            self.stats.cached_tokens += len(found) * B
        return found

    def insert(self, block: CachedBlock):
        if block.key in self.blocks:
            self.blocks.move_to_end(block.key)
            return
        if block.nbytes > self.budget_bytes:
            return
        self.blocks[block.key] = block
        self.stats.inserted += 1
        self.stats.bytes += block.nbytes
        while self.stats.bytes > self.budget_bytes:
            _, old = self.blocks.popitem(last=False)
            self.stats.bytes -= old.nbytes
            self.stats.evictions += 1
        self.stats.blocks = len(self.blocks)

    def clear(self, counters: bool = False):
        """Drop every block; `counters`: start the counters again too (after a warm-up's throwaway prompts)."""
        self.blocks.clear()
        if counters:  # in place: whoever reports the counters may hold the object
            vars(self.stats).update(vars(PrefixCacheStats(budget_bytes=self.budget_bytes)))
        self.stats.blocks = self.stats.bytes = 0


@dataclass
class RowTrail:
    """What a cache row has encoded since its last whole block, to cut blocks from as it grows."""

    key: bytes  # the chain key of the row's last whole block (the root before the first)
    position: int  # tokens in the row
    salts: dict[int, bytes] = field(default_factory=dict)  # block index -> image digests starting there
    tokens: list[int] = field(default_factory=list)  # since the last whole block
    entries: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = field(default_factory=list)  # per chunk
    hidden: list[torch.Tensor] = field(default_factory=list)  # per chunk (t, H)

    def add(self, cache: PrefixCache, tokens: list[int], entries, hidden: torch.Tensor, dtype: torch.dtype):
        """Tokens just encoded into the row, with their per-layer entries (Hkv, t, D) and hidden (t, H);
        whole blocks go into the cache."""
        self.tokens += tokens
        self.entries.append(entries)
        self.hidden.append(hidden)
        B = cache.block_tokens
        if len(self.tokens) < B:
            self.position += len(tokens)
            return
        keys = [torch.cat([chunk[i][0] for chunk in self.entries], dim=1) for i in range(len(entries))]
        values = [None if entries[i][1] is None else torch.cat([chunk[i][1] for chunk in self.entries], dim=1)
                  for i in range(len(entries))]
        hidden_all = torch.cat(self.hidden)
        start = self.position - (len(self.tokens) - len(tokens))  # the row's position of self.tokens[0]
        whole = len(self.tokens) // B * B
        for a in range(0, whole, B):
            block_index = (start + a) // B
            self.key = chain_key(self.key, self.tokens[a : a + B], self.salts.get(block_index, b""))
            cache.insert(CachedBlock(self.key, [k[:, a : a + B].to(dtype).clone() for k in keys],
                               [None if v is None else v[:, a : a + B].to(dtype).clone() for v in values],
                               hidden_all[a : a + B].clone()))
        rest = slice(whole, None)  # copied, so the chunk's tensors can go
        self.tokens = self.tokens[rest]
        self.entries = [[(k[:, rest].clone(), None if v is None else v[:, rest].clone()) for k, v in zip(keys, values)]]
        self.hidden = [hidden_all[rest].clone()]
        self.position += len(tokens)

    def copy(self) -> RowTrail:
        return RowTrail(self.key, self.position, dict(self.salts), list(self.tokens), list(self.entries),
                        list(self.hidden))
