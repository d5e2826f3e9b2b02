"""A token-level automaton for a regex or a JSON schema: which token may follow in each state.

Built by outlines-core, the library that gives the whole transition table of a regex over a token
vocabulary. Of the three well-kept libraries for constrained decoding:
  * outlines-core (Rust, Python bindings): regex -> byte-level DFA -> token-level `Index` with
    `get_initial_state`, `get_final_states`, `get_transitions() -> {state: {token: next}}`,
    `get_allowed_tokens`, `get_next_state`; JSON schema -> regex by `build_regex_from_schema`;
  * llguidance: an Earley parser over a context-free grammar with `compute_bitmask` /
    `consume_token` for the current state only;
  * xgrammar: a pushdown automaton with `fill_next_token_bitmask` / `accept_token` for the current
    state only.
The canvas decoder (dgemma.structured.decode) chooses a whole canvas at once, by dynamic programming
over (position, state) as in DINGO (arXiv 2505.23061), so it needs every state's transitions, not the
mask of one state: only outlines-core exposes them. Its languages are regular, which covers JSON
schemas without unbounded recursion (outlines bounds nesting depth) and Gemma 4's tool-call syntax.

What this module adds on top of the library's `Index`:
  * dense state ids, dead states removed (every state left can still reach an accepting state), and
    for each state the fewest tokens to an accepting state (the decoder keeps answers within budget);
  * token classes: tokens with the same transitions in every state are interchangeable for the
    decoder, which then works per class (tens to thousands) instead of per token (up to 262,144);
  * a cache per (vocabulary, regex): building takes seconds at Gemma's vocabulary size (about four
    minutes for json_object's generic grammar). In process, the 32 most recent; concurrent requests for
    one automaton share one build. On disk, optionally (`set_disk_cache(folder)`, `dgemma serve
    --automaton-cache`): one file per (vocabulary fingerprint, regex, outlines-core version), written
    atomically and read back in well under a second, so a restarted server does not build again.
EOS is not part of the automaton: the decoder allows it in accepting states only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dgemma.structured.schema import SchemaError, check_schema
from dgemma.structured.vocabulary import TokenVocabulary

# JSON whitespace between tokens: one space, or one newline and an indent (pretty-printed JSON).
# Bounded, so an answer cannot spend its budget on blank space; outlines' own default is "[ ]?".
JSON_WHITESPACE = r"(?:[ ]?|\n[ ]{0,24})"
CACHE_SIZE = 32
DISK_FORMAT = 1  # bump when what `_build` makes of a regex changes: older files are then never read

log = logging.getLogger("dgemma.structured")


class ConstraintError(ValueError):
    """The regex cannot be compiled, or the vocabulary cannot write its language."""


@dataclass(eq=False)
class TokenAutomaton:
    """A deterministic automaton over token ids. States are 0 .. num_states-1; tokens are grouped in
    classes that move every state alike; edges (src, class, dst) are the transitions per class.

    `distance[q]`: fewest tokens from q to an accepting state (0 when q accepts).
    """

    regex: str
    vocab_size: int
    initial: int
    final: torch.Tensor  # (Q,) bool
    distance: torch.Tensor  # (Q,) long
    token_class: torch.Tensor  # (V,) long, -1: the token is allowed in no state
    edge_src: torch.Tensor  # (E,) long
    edge_class: torch.Tensor  # (E,) long
    edge_dst: torch.Tensor  # (E,) long
    class_order: torch.Tensor  # (N,) long: the allowed tokens sorted by class
    class_offsets: torch.Tensor  # (C+1,) long: class c is class_order[offsets[c]:offsets[c+1]]
    description: str = "regex"
    _next: dict = field(default_factory=dict, repr=False)  # (state, class) -> state
    _on_device: dict = field(default_factory=dict, repr=False)
    _edges_into: tuple | None = field(default=None, repr=False)

    @property
    def num_states(self) -> int:
        return self.final.shape[0]

    @property
    def num_classes(self) -> int:
        return self.class_offsets.shape[0] - 1

    @property
    def num_edges(self) -> int:
        return self.edge_src.shape[0]

    def next_state(self, state: int, token: int) -> int | None:
        """The state after `token`, or None where the token is not allowed."""
        if not 0 <= token < self.vocab_size:
            return None
        return self._next.get((state, int(self.token_class[token])))

    def allowed_tokens(self, state: int) -> torch.Tensor:
        """(k,) long: the token ids allowed in `state` (EOS not included: see `accepts`)."""
        classes = self.edge_class[self.edge_src == state]
        return torch.cat([self.class_order[self.class_offsets[c]: self.class_offsets[c + 1]] for c in classes.tolist()]
                         or [torch.empty(0, dtype=torch.long)]).sort().values

    def walk(self, tokens, state: int | None = None) -> int | None:
        """The state after `tokens` from `state` (the initial state by default), or None if one is not allowed."""
        state = self.initial if state is None else state
        for t in tokens:
            state = self.next_state(state, int(t))
            if state is None:
                return None
        return state

    def edges_into(self) -> tuple[np.ndarray, np.ndarray]:
        """Edges grouped by target state (host arrays): edges into q are order[offsets[q]:offsets[q+1]]."""
        if self._edges_into is None:
            dst = self.edge_dst.cpu().numpy()
            order = np.argsort(dst, kind="stable")
            offsets = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=self.num_states + 1))])
            self._edges_into = (order, offsets)
        return self._edges_into

    def is_final(self, state: int) -> bool:
        return bool(self.final[state])

    def on(self, device) -> "TokenAutomaton":
        """A copy whose tensors live on `device` (cached)."""
        device = torch.device(device)
        if device == self.final.device:
            return self
        if device not in self._on_device:
            moved = {k: getattr(self, k).to(device) for k in _TENSORS}
            self._on_device[device] = TokenAutomaton(self.regex, self.vocab_size, self.initial, description=self.description,
                                                     _next=self._next, **moved)
        return self._on_device[device]


_TENSORS = ("final", "distance", "token_class", "edge_src", "edge_class", "edge_dst", "class_order", "class_offsets")


# -- building --------------------------------------------------------------------------------------------

_cache: OrderedDict[tuple[str, str], TokenAutomaton] = OrderedDict()
_building: dict[tuple[str, str], Future] = {}  # builds in progress: later callers wait for the first
_cache_lock = threading.Lock()
_disk: Path | None = None


def set_disk_cache(folder: str | os.PathLike | None) -> None:
    """Keep built automata in `folder` (created when missing) and read them from there; None: memory only."""
    global _disk
    _disk = None if folder is None else Path(folder)


def regex_constraint(regex: str, vocabulary: TokenVocabulary, *, description: str = "regex") -> TokenAutomaton:
    """The automaton of `regex` (outlines-core's syntax: Rust `regex`, matched whole) over `vocabulary`."""
    key = (vocabulary.fingerprint, regex)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        pending = _building.get(key)
        building = pending is None
        if building:
            pending = _building[key] = Future()
    if not building:
        return pending.result()  # another thread builds it; its error is ours too
    try:
        automaton = _read(key, vocabulary, description)
        if automaton is None:
            automaton = _build(regex, vocabulary, description)
            _write(key, automaton)
    except BaseException as e:
        with _cache_lock:
            del _building[key]
        pending.set_exception(e)
        raise
    with _cache_lock:
        _cache[key] = automaton
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        del _building[key]
    pending.set_result(automaton)
    return automaton


def _disk_path(key: tuple[str, str]) -> Path | None:
    if _disk is None:
        return None
    from importlib.metadata import version

    name = hashlib.sha256(repr((DISK_FORMAT, version("outlines-core"), *key)).encode()).hexdigest()[:32]
    return _disk / f"{name}.pt"


def _read(key: tuple[str, str], vocabulary: TokenVocabulary, description: str) -> TokenAutomaton | None:
    """The automaton from the disk cache, or None (no cache, no file, or a file that is not this one's)."""
    path = _disk_path(key)
    if path is None or not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        if saved["regex"] != key[1] or saved["vocabulary"] != key[0] or saved["vocab_size"] != vocabulary.size:
            return None
        edges = zip(saved["edge_src"].tolist(), saved["edge_class"].tolist(), saved["edge_dst"].tolist())
        return TokenAutomaton(regex=saved["regex"], vocab_size=saved["vocab_size"], initial=saved["initial"],
                              description=description, _next={(s, c): d for s, c, d in edges},
                              **{k: saved[k] for k in _TENSORS})
    except Exception as e:  # a truncated or foreign file: build again (and overwrite it)
        log.warning("ignoring the cached automaton %s: %s", path, e)
        return None


def _write(key: tuple[str, str], automaton: TokenAutomaton) -> None:
    """Into the disk cache, atomically (a reader never sees half a file); a cache that cannot be written
    is only a warning."""
    path = _disk_path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            try:
                torch.save({"regex": key[1], "vocabulary": key[0], "vocab_size": automaton.vocab_size,
                            "initial": automaton.initial, **{k: getattr(automaton, k) for k in _TENSORS}}, f)
            except BaseException:
                os.unlink(f.name)
                raise
        os.replace(f.name, path)
    except OSError as e:
        log.warning("cannot write the automaton cache %s: %s", path, e)


def json_schema_constraint(schema, vocabulary: TokenVocabulary, *, whitespace: str = JSON_WHITESPACE
                           ) -> TokenAutomaton:
    """Answers that are JSON documents valid under `schema` (a dict or its JSON text), within the
    supported subset (dgemma.structured.schema); an unsupported keyword raises SchemaError naming it."""
    from outlines_core.json_schema import build_regex_from_schema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    schema = check_schema(schema)
    try:
        regex = build_regex_from_schema(json.dumps(schema), whitespace)
    except (ValueError, TypeError) as e:
        raise SchemaError(f"the schema cannot be compiled: {str(e).splitlines()[0]}") from None
    return regex_constraint(regex, vocabulary, description="json_schema")


def json_object_constraint(vocabulary: TokenVocabulary, *, whitespace: str = JSON_WHITESPACE) -> TokenAutomaton:
    """Any JSON object (nesting bounded by outlines-core's recursion depth): response_format json_object."""
    automaton = json_schema_constraint({"type": "object"}, vocabulary, whitespace=whitespace)
    return automaton


def _build(regex: str, vocabulary: TokenVocabulary, description: str) -> TokenAutomaton:
    import outlines_core

    # The regex library also determinises the *unanchored* search (a match may start anywhere), and
    # when a pattern's first character can recur inside it (a JSON string starting with '"' holds
    # '\\"'), tracking every possible start costs states exponential in the pattern's length:
    # '"(char){15,}"' took seconds, '{30,40}' longer than we waited. A leading \x01, which the
    # JSON grammar never writes, ends every such overlap; a token of its own steps past it.
    eos, anchor = vocabulary.size, vocabulary.size + 1  # no real tokens: dropped from the table below
    tokens = {b: list(ids) for b, ids in vocabulary.outlines_tokens().items()}
    if not tokens:
        raise ConstraintError("the vocabulary has no token a constraint can use")
    tokens.setdefault(b"\x01", []).append(anchor)
    try:
        index = outlines_core.Index(f"\\x01(?:{regex})", outlines_core.Vocabulary(eos, tokens))
    except ValueError as e:
        raise ConstraintError(f"cannot build the token automaton: {str(e).splitlines()[0]}") from None
    start = index.get_next_state(index.get_initial_state(), anchor)

    # The table as flat arrays (src, tok, dst), with outlines' state ids made dense.
    srcs, toks, dsts = [], [], []
    for state, row in index.get_transitions().items():
        toks.append(np.fromiter(row.keys(), dtype=np.int64, count=len(row)))
        dsts.append(np.fromiter(row.values(), dtype=np.int64, count=len(row)))
        srcs.append(np.full(len(row), state, dtype=np.int64))
    src, tok, dst = (np.concatenate(a) if a else np.empty(0, np.int64) for a in (srcs, toks, dsts))
    keep = tok < eos
    src, tok, dst = src[keep], tok[keep], dst[keep]
    names = np.unique(np.concatenate([src, dst, [start], list(index.get_final_states())]))
    src, dst = np.searchsorted(names, src), np.searchsorted(names, dst)
    initial = int(np.searchsorted(names, start))
    final = np.zeros(len(names), dtype=bool)
    final[np.searchsorted(names, list(index.get_final_states()))] = True

    # Keep the states on some path from the start to an accepting state, numbered densely.
    distance = _distance(src, dst, final)  # tokens to the nearest accepting state
    reachable = _distance(dst, src, np.arange(len(names)) == initial) >= 0  # edges reversed: from the start
    live = (distance >= 0) & reachable
    if not live[initial]:
        raise ConstraintError("the vocabulary cannot write any string this constraint accepts")
    keep = live[src] & live[dst]
    src, tok, dst = src[keep], tok[keep], dst[keep]
    new_id = np.cumsum(live) - 1
    src, dst, initial = new_id[src], new_id[dst], int(new_id[initial])
    final, distance = final[live], distance[live]

    token_class, edge_src, edge_class, edge_dst = _token_classes(src, tok, dst, len(final), vocabulary.size)
    allowed = np.nonzero(token_class >= 0)[0]
    order = allowed[np.argsort(token_class[allowed], kind="stable")]
    counts = np.bincount(token_class[allowed], minlength=int(token_class.max()) + 1 if len(allowed) else 0)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return TokenAutomaton(
        regex=regex, vocab_size=vocabulary.size, initial=initial, final=t(final), distance=t(distance),
        token_class=t(token_class), edge_src=t(edge_src), edge_class=t(edge_class), edge_dst=t(edge_dst),
        class_order=t(order), class_offsets=t(offsets), description=description,
        _next={(int(s), int(c)): int(d) for s, c, d in zip(edge_src, edge_class, edge_dst)},
    )


def _distance(src: np.ndarray, dst: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Fewest transitions from each state to a target state along edges src -> dst (-1: none), by BFS
    from the targets backwards. Called with the edges reversed, it gives the distance from a start."""
    num_states = len(targets)
    pair_ids = np.unique(src * num_states + dst)
    pairs = np.stack([pair_ids // num_states, pair_ids % num_states], 1)
    distance = np.where(targets, 0, -1)
    frontier = targets.copy()
    step = 0
    while frontier.any():
        step += 1
        reached = np.zeros_like(frontier)
        reached[pairs[frontier[pairs[:, 1]], 0]] = True
        frontier = reached & (distance < 0)
        distance[frontier] = step
    return distance


def _token_classes(src, tok, dst, num_states: int, vocab_size: int):
    """Group tokens whose transitions are the same in every state.

    Each token's set of (src, dst) pairs is summarised by two independent 64-bit sums of mixed pair
    ids (a set hash: order-free, collisions ~2^-128); tokens with equal summaries form one class.
    Returns token_class (V,) (-1 for tokens allowed nowhere) and the class edges (src, class, dst).
    """
    pair = (src * num_states + dst).astype(np.uint64)
    h1 = np.zeros(vocab_size, dtype=np.uint64)
    h2 = np.zeros(vocab_size, dtype=np.uint64)
    np.add.at(h1, tok, _mix(pair, np.uint64(0x9E3779B97F4A7C15)))
    np.add.at(h2, tok, _mix(pair, np.uint64(0xD1B54A32D192ED03)))
    n_pairs = np.bincount(tok, minlength=vocab_size)
    used = n_pairs > 0
    keys = (h1[used], h2[used], n_pairs[used])
    order = np.lexsort(keys)
    new_class = np.ones(len(order), dtype=bool)
    new_class[1:] = np.any([k[order][1:] != k[order][:-1] for k in keys], axis=0)
    classes = np.empty(len(order), dtype=np.int64)
    classes[order] = np.cumsum(new_class) - 1
    first = order[new_class]  # one member of each class, in class order
    token_class = np.full(vocab_size, -1, dtype=np.int64)
    token_class[used] = classes.reshape(-1)
    representative = np.nonzero(used)[0][first]  # one token per class
    is_rep = np.zeros(vocab_size, dtype=bool)
    is_rep[representative] = True
    rep = is_rep[tok]
    edge_src, edge_class, edge_dst = src[rep], token_class[tok[rep]], dst[rep]
    if int(n_pairs[representative][classes.reshape(-1)].sum()) != len(tok):  # a collision would break this
        raise ConstraintError("token classes are inconsistent (hash collision)")
    order = np.lexsort((edge_dst, edge_class, edge_src))
    return token_class, edge_src[order], edge_class[order], edge_dst[order]


def _mix(x: np.ndarray, seed: np.uint64) -> np.ndarray:
    """splitmix64 finaliser: spreads pair ids over 64 bits before they are summed."""
    with np.errstate(over="ignore"):
        z = x * seed + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
